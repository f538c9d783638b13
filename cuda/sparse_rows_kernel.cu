// CUDA: the row-wise sparse steps (SGD, Adagrad, SparseAdam, row-wise Adagrad) of an embedding
// table, with the CPU's formulas (math/sparse_rows_math.h) and the CPU's bits: each touched
// row's lookups are summed in FP32 in the order they appear in the gradient, with no atomics.
//
// The lookups are sorted stably by row (at::sort, a radix sort: deterministic, and a row's
// lookups keep their order), then one warp steps one row: it sums the row's lookups column by
// column, in the sorted order, and writes the row's weights (or FP32 master and table; BF16
// stochastically rounded from the element's index where asked) and
// state once. SGD with momentum visits every row of the table, as the CPU does (its dense
// buffer decays everywhere); a row found by binary search over the sorted lookups.
// A one-thread kernel first reads found_inf, the step count, inv_scale and the index range,
// and leaves the step's coefficients on the device: nothing comes back to the host.
// Memory traffic per touched row of d elements, FP32 table, Adagrad: 8d bytes read + 8d
// written, plus 4d read per lookup (twice for row-wise Adagrad, which sums its lookups once for
// the row's sum of squares and again for the update), plus the sort of the nnz indices.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sort.h>
#include <c10/cuda/CUDAException.h>
#include <fusedamp/math/sparse_rows_math.h>

#include <tuple>
#include <type_traits>

#include "../csrc/ops/sparse_rows_args.h"
#include "../csrc/ops/static_switch.h"
#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"
#include "step_weights.cuh"

namespace fusedamp::cuda {
namespace {

using Algorithm = kernels::SparseRowsAlgorithm;

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kRowsPerBlock = kThreads / kWarp;  // one warp per row

// What the row kernels read from the device, left there by sparse_rows_setup_kernel.
struct RowCoefficients {
  int skip;        // found_inf set (or an index out of range): nothing is written
  int first_step;  // the step count was 0 (SGD's momentum buffer starts as the gradient)
  uint32_t counter;  // the step count before the update (stochastic rounding's counter)
  float coef;      // SGD: -lr; Adagrad: -clr; SparseAdam: -step_size; row-wise: lr
  float grad_mult;  // inverse loss scale, negated under maximize
};

// What the one-thread kernel needs to form RowCoefficients.
struct SetupArgs {
  Algorithm algorithm;
  kernels::SparseRowsHyper hyper;
  int64_t nnz;
  int64_t num_rows;
};

// The pointers and per-op constants of a step's row kernels.
struct RowsArgs {
  void* table;
  void* master;  // what the store keeps beside the table (FP32 master, remainders), or null
  uint64_t rounding_seed;  // kStochastic
  int64_t num_rows;
  int64_t dim;
  const void* values;  // [nnz, dim], in the gradient's lookup order
  c10::ScalarType values_dtype;
  const int64_t* sorted_rows;  // the lookups' rows, sorted (stable)
  const int64_t* order;        // sorted position -> lookup
  int64_t nnz;
  float* state0;  // momentum buffer / Adagrad sum / exp_avg / row accumulators
  float* state1;  // exp_avg_sq
  float momentum;
  float one_minus_dampening;
  bool nesterov;
  float eps;
  float one_minus_beta1;
  float one_minus_beta2;
};

// Reads every device scalar once: a skipped step leaves the step count alone, as the CPU's
// early return does. The index range is the sorted indices' first and last: an index out of
// range is a device-side assert (as torch's own CUDA index kernels), and where asserts are
// compiled out the step is skipped, so nothing is written either way.
__global__ void sparse_rows_setup_kernel(RowCoefficients* out, float* step,
                                         const float* found_inf, const float* inv_scale,
                                         const int64_t* sorted_rows, SetupArgs a) {
  RowCoefficients c{};
  c.skip = found_inf != nullptr && *found_inf != 0.f;
  if (!c.skip && a.nnz > 0) {
    const int64_t low = sorted_rows[0];
    const int64_t high = sorted_rows[a.nnz - 1];
    const bool in_range = low >= 0 && high < a.num_rows;
    CUDA_KERNEL_ASSERT_PRINTF(in_range,
                              "fusedamp sparse row step: index %lld is out of range for a "
                              "table of %lld rows",
                              static_cast<long long>(low < 0 ? low : high),
                              static_cast<long long>(a.num_rows));
    c.skip = !in_range;
  }
  if (!c.skip) {
    const float step_before = *step;
    const double step_after = static_cast<double>(step_before) + 1.0;
    const float inv = inv_scale != nullptr ? *inv_scale : 1.f;
    c.first_step = step_before == 0.f;
    c.counter = static_cast<uint32_t>(step_before);
    c.grad_mult = a.hyper.maximize ? -inv : inv;
    c.coef = kernels::step_coefficient(a.algorithm, a.hyper, step_after);
    *step = static_cast<float>(step_after);
  }
  *out = c;
}

// One past the last sorted position of the row whose lookups start at `start` (every lane
// gets it): 32 positions per ballot.
__device__ __forceinline__ int64_t segment_end(const RowsArgs& a, int64_t start, int64_t row) {
  const int lane = threadIdx.x % kWarp;
  int64_t end = start + 1;
  while (true) {
    const int64_t j = end + lane;
    const unsigned same = __ballot_sync(kFullMask, j < a.nnz && a.sorted_rows[j] == row);
    if (same != kFullMask) {
      return end + (__ffs(~same) - 1);
    }
    end += kWarp;
  }
}

template <typename TV>
__device__ __forceinline__ float sum_column(const RowsArgs& a, int64_t start, int64_t end,
                                            int64_t i) {
  const TV* v = static_cast<const TV*>(a.values);
  float acc = to_float(v[a.order[start] * a.dim + i]);
  for (int64_t j = start + 1; j < end; ++j) {
    acc = acc + to_float(v[a.order[j] * a.dim + i]);
  }
  return acc;
}

// Column i of the row's gradient: its lookups summed in order, times grad_mult (the CPU
// multiplies the summed row, sparse_rows_kernel.cpp's step_row).
__device__ __forceinline__ float row_gradient(const RowsArgs& a, const RowCoefficients& c,
                                              int64_t start, int64_t end, int64_t i) {
  float sum;
  switch (a.values_dtype) {
    case at::kHalf:
      sum = sum_column<c10::Half>(a, start, end, i);
      break;
    case at::kBFloat16:
      sum = sum_column<c10::BFloat16>(a, start, end, i);
      break;
    default:
      sum = sum_column<float>(a, start, end, i);
      break;
  }
  return sum * c.grad_mult;
}

// The row's sum of squared gradients, grouped as math::kRowSquareSums says: lane l < 16 holds
// partial sum l, and every lane adds the 16 in order.
__device__ __forceinline__ float row_sum_of_squares(const RowsArgs& a, const RowCoefficients& c,
                                                    int64_t start, int64_t end) {
  constexpr int kSums = math::kRowSquareSums;
  static_assert(kSums <= kWarp, "one lane per partial sum");
  const int lane = threadIdx.x % kWarp;
  float partial = 0.f;
  if (lane < kSums) {
    for (int64_t i = lane; i < a.dim; i += kSums) {
      partial = math::row_square_partial(partial, row_gradient(a, c, start, end, i));
    }
  }
  float sum = 0.f;
#pragma unroll
  for (int l = 0; l < kSums; ++l) {
    sum += __shfl_sync(kFullMask, partial, l);
  }
  return sum;
}

// Row r's weights as kStore keeps them (step_weights.cuh: the table, with its FP32 master or
// split remainders, or rounded stochastically from the element's index in the table), read and
// written one column at a time.
template <typename T, WeightStore kStore>
__device__ __forceinline__ StepWeights<T, kStore> row_weights(const RowsArgs& a,
                                                              const RowCoefficients& c,
                                                              int64_t r) {
  StepWeights<T, kStore> w;
  w.param = static_cast<T*>(a.table) + r * a.dim;
  if constexpr (has_store_list(kStore)) {
    w.extra = static_cast<KeptElem<T, kStore>*>(a.master) + r * a.dim;
  } else {
    w.extra = nullptr;
  }
  w.seed = a.rounding_seed;
  w.step = c.counter;
  w.first_index = r * a.dim;
  return w;
}

// The rows looked up, except under SGD with momentum: the warp of sorted position k steps its
// row where k is the row's first lookup.
template <typename T, WeightStore kStore, Algorithm kAlgorithm>
__global__ void __launch_bounds__(kThreads)
    touched_rows_kernel(const RowsArgs a, const RowCoefficients* coefficients) {
  const RowCoefficients c = *coefficients;
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (c.skip || k >= a.nnz || (k > 0 && a.sorted_rows[k - 1] == a.sorted_rows[k])) {
    return;
  }
  const int lane = threadIdx.x % kWarp;
  const int64_t r = a.sorted_rows[k];
  const int64_t end = segment_end(a, k, r);
  float multiplier = 0.f;
  if constexpr (kAlgorithm == Algorithm::kRowWiseAdagrad) {
    float acc = a.state0[r];
    multiplier = math::rowwise_adagrad_multiplier(acc, row_sum_of_squares(a, c, k, end), a.dim,
                                                  c.coef, a.eps);
    __syncwarp();  // every lane has read the accumulator
    if (lane == 0) {
      a.state0[r] = acc;
    }
  }
  const auto w = row_weights<T, kStore>(a, c, r);
  for (int64_t i = lane; i < a.dim; i += kWarp) {
    const int64_t e = r * a.dim + i;
    const float g = row_gradient(a, c, k, end, i);
    float p[1];
    w.template load<1>(static_cast<int>(i), p);
    if constexpr (kAlgorithm == Algorithm::kSgd) {
      math::sparse_sgd_update(p[0], g, c.coef);
    } else if constexpr (kAlgorithm == Algorithm::kAdagrad) {
      float sum = a.state0[e];
      math::sparse_adagrad_update(p[0], sum, g, c.coef, a.eps);
      a.state0[e] = sum;
    } else if constexpr (kAlgorithm == Algorithm::kAdam) {
      float m = a.state0[e];
      float v = a.state1[e];
      math::sparse_adam_update(p[0], m, v, g, a.one_minus_beta1, a.one_minus_beta2, c.coef,
                               a.eps);
      a.state0[e] = m;
      a.state1[e] = v;
    } else {
      math::rowwise_adagrad_update(p[0], g, multiplier);
    }
    w.template store<1>(static_cast<int>(i), p);
  }
}

// The first sorted position of row r, or nnz.
__device__ __forceinline__ int64_t first_lookup(const RowsArgs& a, int64_t r) {
  int64_t lo = 0;
  int64_t hi = a.nnz;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (a.sorted_rows[mid] < r) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// SGD with momentum: every row (a warp each). A row not looked up takes g = 0 (times
// grad_mult, as the CPU multiplies its zero row) and is left alone where its buffer is all +0
// bits, the CPU's shortcut (sparse_rows_kernel.cpp), which also decides whether its table row
// is rewritten from the master.
template <typename T, WeightStore kStore>
__global__ void __launch_bounds__(kThreads)
    momentum_rows_kernel(const RowsArgs a, const RowCoefficients* coefficients) {
  const RowCoefficients c = *coefficients;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (c.skip || r >= a.num_rows) {
    return;
  }
  const int lane = threadIdx.x % kWarp;
  float* buf = a.state0 + r * a.dim;
  const int64_t start = first_lookup(a, r);
  const bool looked_up = start < a.nnz && a.sorted_rows[start] == r;
  if (!looked_up) {
    unsigned bits = 0;
    for (int64_t i = lane; i < a.dim; i += kWarp) {
      bits |= __float_as_uint(buf[i]);
    }
    if (!__any_sync(kFullMask, bits != 0)) {
      return;
    }
  }
  const int64_t end = looked_up ? segment_end(a, start, r) : start;
  const auto w = row_weights<T, kStore>(a, c, r);
  for (int64_t i = lane; i < a.dim; i += kWarp) {
    const float g = looked_up ? row_gradient(a, c, start, end, i) : 0.f * c.grad_mult;
    float p[1];
    w.template load<1>(static_cast<int>(i), p);
    float b = buf[i];
    math::sparse_sgd_momentum_update(p[0], b, g, c.coef, a.momentum, a.one_minus_dampening,
                                     a.nesterov, c.first_step != 0);
    buf[i] = b;
    w.template store<1>(static_cast<int>(i), p);
  }
}

unsigned blocks_for(int64_t warps) {
  return static_cast<unsigned>((warps + kRowsPerBlock - 1) / kRowsPerBlock);
}

template <typename T, WeightStore kStore, Algorithm kAlgorithm>
void launch_touched_rows(const RowsArgs& a, const RowCoefficients* c) {
  touched_rows_kernel<T, kStore, kAlgorithm>
      <<<blocks_for(a.nnz), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(a, c);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Launched only where the CPU runs its kernel: SGD with momentum always (every row's buffer
// moves), the others where there are lookups.
template <typename T, WeightStore kStore>
void launch_rows(const RowsArgs& a, Algorithm algorithm, bool momentum,
                 const RowCoefficients* c) {
  if (momentum) {
    if (a.num_rows > 0) {
      momentum_rows_kernel<T, kStore>
          <<<blocks_for(a.num_rows), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(a, c);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return;
  }
  if (a.nnz == 0) {
    return;
  }
  switch (algorithm) {
    case Algorithm::kSgd:
      return launch_touched_rows<T, kStore, Algorithm::kSgd>(a, c);
    case Algorithm::kAdagrad:
      return launch_touched_rows<T, kStore, Algorithm::kAdagrad>(a, c);
    case Algorithm::kAdam:
      return launch_touched_rows<T, kStore, Algorithm::kAdam>(a, c);
    case Algorithm::kRowWiseAdagrad:
      return launch_touched_rows<T, kStore, Algorithm::kRowWiseAdagrad>(a, c);
  }
}

}  // namespace

void sparse_rows_step(const kernels::SparseRowsOp& op) {
  const at::Tensor values = op.values.contiguous();
  const int64_t nnz = values.size(0);
  at::Tensor sorted_rows;
  at::Tensor order;
  if (nnz > 0) {
    std::tie(sorted_rows, order) =
        at::sort(op.indices.reshape({-1}), /*stable=*/true, /*dim=*/0, /*descending=*/false);
  }
  const kernels::SparseRowsHyper& h = op.hyper;
  const int64_t num_rows = op.table.size(0);
  const at::Tensor coefficients = at::empty({static_cast<int64_t>(sizeof(RowCoefficients))},
                                            op.table.options().dtype(at::kByte));
  auto* c = reinterpret_cast<RowCoefficients*>(coefficients.data_ptr<uint8_t>());
  const SetupArgs setup{op.algorithm, h, nnz, num_rows};
  sparse_rows_setup_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      c, op.step.data_ptr<float>(), input_or_null<float>(op.found_inf),
      input_or_null<float>(op.inv_scale), nnz > 0 ? sorted_rows.const_data_ptr<int64_t>() : nullptr,
      setup);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  RowsArgs a{};
  a.table = op.table.data_ptr();
  a.master = op.has_master() ? op.master->data_ptr() : nullptr;
  a.rounding_seed = static_cast<uint64_t>(op.rounding_seed.value_or(0));
  a.num_rows = num_rows;
  a.dim = op.table.size(1);
  a.values = values.const_data_ptr();
  a.values_dtype = values.scalar_type();
  a.sorted_rows = nnz > 0 ? sorted_rows.const_data_ptr<int64_t>() : nullptr;
  a.order = nnz > 0 ? order.const_data_ptr<int64_t>() : nullptr;
  a.nnz = nnz;
  a.state0 = op.state.empty() ? nullptr : op.state[0].data_ptr<float>();
  a.state1 = op.state.size() > 1 ? op.state[1].data_ptr<float>() : nullptr;
  a.momentum = static_cast<float>(h.momentum);
  a.one_minus_dampening = static_cast<float>(1.0 - h.dampening);
  a.nesterov = h.nesterov;
  a.eps = static_cast<float>(h.eps);
  a.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  a.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  const bool momentum = op.algorithm == Algorithm::kSgd && !op.state.empty();
  static_switch(
      [&](auto table, auto store) {
        using T = decltype(table);
        if constexpr (kernels::sparse_store_fits<T>(decltype(store)::value)) {
          launch_rows<T, decltype(store)::value>(a, op.algorithm, momentum, c);
        }
      },
      DtypeSwitch<float, c10::Half, c10::BFloat16>{op.table.scalar_type()},
      kernels::SparseRowStores{op.store()});
}

}  // namespace fusedamp::cuda
