// CUDA: the two passes over the gradients.
//   unscale_and_check_  read 1 + write 1 element of the grad dtype (FP16: 4 bytes/element).
//   grad_stats_         read 1 element (FP16: 2 bytes/element), plus one FP32 partial per
//                       block of kChunk elements (negligible).
//   unscale_and_check_ with sum_sq (and telemetry): grad_stats_'s pass writing the unscaled
//                       values back: read 1 + write 1 element, no second pass.
// Lists may mix dtypes: tensors are grouped by dtype and each group is one multi-tensor apply.
// The non-finite test and the square sum are fusedamp::math's, shared with the CPU kernels.
//
// grad_stats_ reduces deterministically: each block writes the FP32 sum of squares of its
// chunk into a workspace slot, and those partials are added in a fixed order (FP64) into
// sum_sq: by one block, or for huge lists in two levels (add_partials). The same inputs give
// the same sum in eager mode and in a CUDA graph replay. FP16 grads scaled by 2^24 reach at
// most 65504^2 ~ 4.3e9 per square, so the FP32 per-chunk sums (<= 32768 squares, ~1.4e14) are
// far from overflow.
//
// Telemetry (when asked for) is reduced per block and combined with one FP64 atomic per slot:
// max of non-negative doubles and min of non-negative positions as signed 64-bit integer
// max/min of their bits (the same order, also against the negative values a slot may hold;
// atomic_max_of_nonnegative), counts as sums of integers below 2^53 — exact, so the result
// does not depend on the order the blocks finish in.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <fusedamp/math/telemetry_math.h>
#include <fusedamp/math/unscale_math.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "../csrc/ops/dispatch_float_types.h"
#include "../csrc/ops/static_switch.h"
#include "block_reduce.cuh"
#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"

namespace fusedamp::cuda {
namespace {

using UnscaleBatch = TensorBatch<1, 0>;
// extra[0]: &tensor_flags[i] or nullptr; extra[1]: not a pointer but tensor i's position in
// the op's list (the kernel only compares it), for the telemetry's first non-finite grad.
using StatsBatch = TensorBatch<1, 2>;

// What both gradient passes share: each lane's element read from the gradient, as FP32.
template <typename Elem>
struct GradLanes {
  Elem* g;  // Elem: T (unscale writes back) or const T (grad_stats only reads)

  template <int L>
  struct Regs {
    float x[L];
  };
  template <int L>
  __device__ __forceinline__ void load(int i, Regs<L>& r) const {
    load_lanes<L>(g + i, r.x);
  }
};

template <typename T>
struct UnscaleOp : GradLanes<T> {
  float inv_scale;
  float bad = 0.f;  // NaN once a non-finite element was seen

  template <int L>
  using Regs = typename GradLanes<T>::template Regs<L>;
  template <int L>
  __device__ __forceinline__ void apply(int, Regs<L>& r) {
#pragma unroll
    for (int l = 0; l < L; ++l) {
      bad = math::accumulate_nonfinite(bad, r.x[l]);
      r.x[l] = math::unscale(r.x[l], inv_scale);
    }
  }
  template <int L>
  __device__ __forceinline__ void store(int i, const Regs<L>& r) const {
    store_lanes<L>(this->g + i, r.x);
  }
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
    unscale_kernel(const __grid_constant__ UnscaleBatch m, float* found_inf,
                   const float* inv_scale) {
  const ChunkRef c = this_chunk(m);
  UnscaleOp<T> op{{static_cast<T*>(m.ptr[0][c.t]) + c.offset}, *inv_scale};
  chunk_loop<vec_width<T>()>(op, c.n, c.aligned);
  if (__syncthreads_or(math::is_nonfinite_marker(op.bad)) && threadIdx.x == 0) {
    *found_inf = 1.f;  // never reset; every writer stores the same value
  }
}

// The statistics pass: check, sum of squares and (kTelemetry) telemetry of the values as read;
// with kUnscale they are then unscaled and written back in the same pass (unscale_and_check_
// with statistics).
template <typename T, bool kUnscale, bool kTelemetry>
struct StatsOp : GradLanes<std::conditional_t<kUnscale, T, const T>> {
  using Lanes = GradLanes<std::conditional_t<kUnscale, T, const T>>;
  float inv_scale = 1.f;
  float bad = 0.f;
  float sq = 0.f;
  math::TelemetryLanes<float> tele = math::telemetry_zero<float>();

  template <int L>
  using Regs = typename Lanes::template Regs<L>;
  template <int L>
  __device__ __forceinline__ void apply(int, Regs<L>& r) {
#pragma unroll
    for (int l = 0; l < L; ++l) {
      bad = math::accumulate_nonfinite(bad, r.x[l]);
      sq = math::accumulate_square(sq, r.x[l]);
      if constexpr (kTelemetry) {
        math::accumulate_telemetry(tele, r.x[l], math::smallest_normal<T>());
      }
      if constexpr (kUnscale) {
        r.x[l] = math::unscale(r.x[l], inv_scale);
      }
    }
  }
  template <int L>
  __device__ __forceinline__ void store(int i, const Regs<L>& r) const {
    if constexpr (kUnscale) {
      store_lanes<L>(this->g + i, r.x);
    }
  }
};

// Max and min of doubles by 64-bit integer atomics on their bits. The value combined in is never
// negative (an amax, a position), while the slot may hold a negative double (a position from an
// earlier pass, shifted back by the parameters walked since; a seed below zero). Read as
// *signed* integers, a non-negative double's bits keep its order against every double: the
// negative ones read as negative integers. (As unsigned integers they would read as larger than
// every non-negative one.)
__device__ __forceinline__ void atomic_max_of_nonnegative(double* slot, double x) {
  atomicMax(reinterpret_cast<long long*>(slot), __double_as_longlong(x));
}
__device__ __forceinline__ void atomic_min_of_nonnegative(double* slot, double x) {
  atomicMin(reinterpret_cast<long long*>(slot), __double_as_longlong(x));
}

// inv_scale: nullptr for grad_stats_ (read only), the scale's inverse to unscale as well.
template <typename T, bool kUnscale, bool kTelemetry>
__global__ void __launch_bounds__(kThreads)
    grad_stats_kernel(const __grid_constant__ StatsBatch m, float* found_inf, float* partials,
                      double* telemetry, const float* inv_scale) {
  const ChunkRef c = this_chunk(m);
  StatsOp<T, kUnscale, kTelemetry> op{{static_cast<T*>(m.ptr[0][c.t]) + c.offset}};
  if constexpr (kUnscale) {
    op.inv_scale = *inv_scale;
  }
  chunk_loop<vec_width<T>()>(op, c.n, c.aligned);
  const bool bad = __syncthreads_or(math::is_nonfinite_marker(op.bad)) != 0;
  const float sq = block_sum(op.sq);
  float amax = 0.f, n_small = 0.f, n_zero = 0.f;
  if constexpr (kTelemetry) {
    amax = block_max(op.tele.amax);
    n_small = block_sum(op.tele.n_small);  // <= kChunk: exact in float
    n_zero = block_sum(op.tele.n_zero);
  }
  if (threadIdx.x == 0) {
    partials[m.block_base + blockIdx.x] = sq;
    if (bad) {
      *found_inf = 1.f;
      if (float* flag = static_cast<float*>(m.extra[0][c.t])) {
        *flag = 1.f;
      }
    }
    if constexpr (kTelemetry) {
      atomic_max_of_nonnegative(telemetry + math::kAmax, static_cast<double>(amax));
      if (n_small > n_zero) {
        atomicAdd(telemetry + math::kSubnormal, static_cast<double>(n_small - n_zero));
      }
      if (n_zero > 0.f) {
        atomicAdd(telemetry + math::kZero, static_cast<double>(n_zero));
      }
      if (bad) {
        const auto position = reinterpret_cast<uintptr_t>(m.extra[1][c.t]);
        atomic_min_of_nonnegative(telemetry + math::kFirstNonfinite,
                                  static_cast<double>(position));
      }
    }
  }
}

// The final reduction adds at most this many values per block: 32 loads per thread. Up to it
// (grads of up to 2^28 elements) one block adds the per-chunk partials; beyond, one block per
// range of partials adds its range and one block adds those range sums, so that a huge grad
// list (10^10 elements: 305,176 partials) is not summed by a single SM.
constexpr int64_t kValuesPerFinalBlock = 8192;

// The FP64 sum of values[begin, end) over the block, valid in thread 0, in an order that
// depends only on the range.
template <typename T>
__device__ __forceinline__ double block_range_sum(const T* values, int64_t begin, int64_t end) {
  double s = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    s += static_cast<double>(values[i]);
  }
  return block_sum(s);
}

// sums[blockIdx.x] = the sum of the block's range of kValuesPerFinalBlock partials (the last
// range may be shorter).
__global__ void __launch_bounds__(kThreads)
    sum_ranges_kernel(const float* partials, int64_t n, double* sums) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kValuesPerFinalBlock;
  const int64_t end = begin + kValuesPerFinalBlock < n ? begin + kValuesPerFinalBlock : n;
  const double s = block_range_sum(partials, begin, end);
  if (threadIdx.x == 0) {
    sums[blockIdx.x] = s;
  }
}

// sum_sq += sum(values[0..n)), n <= kValuesPerFinalBlock (one block).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    add_sum_kernel(const T* values, int64_t n, float* sum_sq) {
  const double s = block_range_sum(values, 0, n);
  if (threadIdx.x == 0) {
    *sum_sq += static_cast<float>(s);
  }
}

// sum_sq += the sum of the n per-chunk partials (see the file's comment).
void add_partials(const at::Tensor& partials, int64_t n, const at::Tensor& sum_sq,
                  cudaStream_t stream) {
  const float* part = partials.const_data_ptr<float>();
  float* out = sum_sq.data_ptr<float>();
  if (n <= kValuesPerFinalBlock) {
    add_sum_kernel<float><<<1, kThreads, 0, stream>>>(part, n, out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const int64_t ranges = (n + kValuesPerFinalBlock - 1) / kValuesPerFinalBlock;
  // ranges = elements / 2^28 (32768 per chunk, 8192 chunks per range): the second level fits
  // one block up to 2^41 (2.2e12) gradient elements.
  TORCH_INTERNAL_ASSERT(ranges <= kValuesPerFinalBlock, "grad_stats_: too many partials");
  // Allocated on the stream like the partials (the caching allocator, capture-safe).
  at::Tensor range_sums = at::empty({ranges}, partials.options().dtype(at::kDouble));
  double* sums = range_sums.data_ptr<double>();
  sum_ranges_kernel<<<static_cast<unsigned>(ranges), kThreads, 0, stream>>>(part, n, sums);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  add_sum_kernel<double><<<1, kThreads, 0, stream>>>(sums, ranges, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Tensors grouped by dtype, in list order within a group; idx holds their list positions.
struct DtypeGroup {
  c10::ScalarType dtype;
  std::vector<at::Tensor> tensors;
  std::vector<size_t> idx;
};

std::vector<DtypeGroup> group_by_dtype(at::TensorList grads) {
  std::vector<DtypeGroup> groups;
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto dt = grads[i].scalar_type();
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const DtypeGroup& g) { return g.dtype == dt; });
    if (it == groups.end()) {
      groups.push_back(DtypeGroup{dt, {}, {}});
      it = groups.end() - 1;
    }
    it->tensors.push_back(grads[i]);
    it->idx.push_back(i);
  }
  return groups;
}

auto no_extra = [](size_t, void**) {};

}  // namespace

namespace {

// grad_stats_'s pass (see the kernel), unscaling as well when inv_scale is given.
void stats_pass(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& sum_sq,
                const std::optional<at::Tensor>& tensor_flags,
                const std::optional<at::Tensor>& telemetry, const float* inv_scale) {
  const int64_t total = total_chunks(grads);
  if (total == 0) {
    return;  // nothing to add; found_inf, the flags and the telemetry keep their values
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  // Every block of every group writes its slot, so the workspace needs no initialisation.
  at::Tensor partials = at::empty({total}, found_inf.options());
  float* part = partials.data_ptr<float>();
  float* fi = found_inf.data_ptr<float>();
  float* flags = tensor_flags && tensor_flags->defined() ? tensor_flags->data_ptr<float>()
                                                         : nullptr;
  double* tele = telemetry && telemetry->defined() ? telemetry->data_ptr<double>() : nullptr;
  int64_t base = 0;
  for (const auto& grp : group_by_dtype(grads)) {
    auto extra = [&](size_t k, void** slots) {
      slots[0] = flags != nullptr ? static_cast<void*>(flags + grp.idx[k]) : nullptr;
      slots[1] = reinterpret_cast<void*>(static_cast<uintptr_t>(grp.idx[k]));
    };
    FUSEDAMP_DISPATCH_FLOAT_TYPES(grp.dtype, "fusedamp_grad_stats_cuda", [&] {
      static_switch(
          [&](auto unscale, auto with_telemetry) {
            multi_tensor_apply<1, 2>(
                {at::TensorList(grp.tensors)}, decltype(unscale)::value ? 1u : 0u,
                vec_width<scalar_t>(), extra,
                [&](const StatsBatch& b, int64_t blocks) {
                  grad_stats_kernel<scalar_t, decltype(unscale)::value,
                                    decltype(with_telemetry)::value>
                      <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
                          b, fi, part + base, tele, inv_scale);
                  C10_CUDA_KERNEL_LAUNCH_CHECK();
                });
          },
          BoolSwitch{inv_scale != nullptr}, BoolSwitch{tele != nullptr});
    });
    base += total_chunks(grp.tensors);
  }
  add_partials(partials, total, sum_sq, stream);
}

}  // namespace

void unscale_and_check(at::TensorList grads, const at::Tensor& found_inf,
                       const at::Tensor& inv_scale, const std::optional<at::Tensor>& sum_sq,
                       const std::optional<at::Tensor>& telemetry) {
  const float* is = inv_scale.const_data_ptr<float>();
  if (sum_sq && sum_sq->defined()) {
    stats_pass(grads, found_inf, *sum_sq, std::nullopt, telemetry, is);
    return;
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  float* fi = found_inf.data_ptr<float>();
  for (const auto& grp : group_by_dtype(grads)) {
    FUSEDAMP_DISPATCH_FLOAT_TYPES(grp.dtype, "fusedamp_unscale_and_check_cuda", [&] {
      multi_tensor_apply<1, 0>(
          {at::TensorList(grp.tensors)}, 1u, vec_width<scalar_t>(), no_extra,
          [&](const UnscaleBatch& b, int64_t blocks) {
            unscale_kernel<scalar_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
                b, fi, is);
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
    });
  }
}

void grad_stats(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& sum_sq,
                const std::optional<at::Tensor>& tensor_flags,
                const std::optional<at::Tensor>& telemetry) {
  stats_pass(grads, found_inf, sum_sq, tensor_flags, telemetry, nullptr);
}

}  // namespace fusedamp::cuda
