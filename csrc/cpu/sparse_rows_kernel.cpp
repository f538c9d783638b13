// CPU: the row-wise sparse steps (SGD, Adagrad, SparseAdam, row-wise Adagrad) of an embedding
// table. Two passes: the lookups' gradient rows are summed per table row into an FP32 scratch
// (each lookup read once, in the order given: duplicates never summed in FP16/BF16), then each
// touched row is stepped once: its weights (or FP32 master), its state and its summed gradient
// read, weights and state written (SGD with momentum: every row, see sparse_rows_math.h).
// Per touched row of d elements, FP32 table, Adagrad: 8d bytes read + 8d written, plus 4d read
// per lookup. The formulas are fusedamp::math's (math/sparse_rows_math.h); the first pass, and
// sparse_rows_sum_'s, is lookup_sums.h.
// Compiled once per instruction set; see cpu_kernels.h.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <fusedamp/math/sparse_rows_math.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "lane_reduce.h"
#include "lookup_sums.h"
#include "sparse_rows.h"
#include "step_weights.h"
#include "vec_io.h"

namespace fusedamp::cpu::CPU_CAPABILITY {
namespace sparse_rows {

// Rows stepped per parallel task: a row of 64 FP32 elements with Adam's state is ~1 KiB of
// traffic, so a task moves ~256 KiB.
constexpr int64_t kRowsPerTask = 256;

// Rows ahead whose memory a row loop asks for: the rows a batch looks up are scattered over
// the table, so each is a cache miss the hardware prefetchers cannot foresee.
constexpr int64_t kRowsAhead = 4;

inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) {
    __builtin_prefetch(static_cast<const char*>(p) + b, 1);
  }
}

inline bool all_bits_zero(const float* row, int64_t d) {
  uint32_t bits = 0;
  for (int64_t i = 0; i < d; ++i) {
    uint32_t b;
    std::memcpy(&b, row + i, sizeof(b));
    bits |= b;
  }
  return bits == 0;
}

// The scratch of summed gradient rows, reused across steps and not cleared: every slot's row
// is first written by a copy of its first lookup.
float* summed_rows(int64_t n) {
  thread_local std::vector<float> sums;
  if (static_cast<int64_t>(sums.size()) < n) {
    sums.resize(static_cast<size_t>(n));
  }
  return sums.data();
}

// Row r of what kStore keeps beside the table (its FP32 master or remainders); nullptr where
// it keeps nothing.
template <typename T, WeightStore kStore>
C10_ALWAYS_INLINE KeptElem<T, kStore>* kept_row(const SparseRowsStep& s, int64_t r) {
  if constexpr (master_mode_info(kStore).kept == MasterKept::kNothing) {
    return nullptr;
  } else {
    return static_cast<KeptElem<T, kStore>*>(s.master) + r * s.dim;
  }
}

// Walks one row in pairs of vectors: f(offset, count, p0, p1, g0, g1) with the weights as
// kStore keeps them (step_weights.h: the table, with its FP32 master or split remainders) and
// the gradient times
// grad_mult; the weights are written back the same way (rounded into an FP16/BF16 table, to
// nearest or stochastically from the element's index in the table).
template <typename T, WeightStore kStore, typename F>
C10_ALWAYS_INLINE void step_row(const SparseRowsStep& s, int64_t r, const float* g, const F& f) {
  const int64_t d = s.dim;
  StepWeights<T, kStore> w{static_cast<T*>(s.table) + r * d, kept_row<T, kStore>(s, r),
                           s.rounding_seed, s.counter, r * d};
  const Vec mult(s.grad_mult);
  for (int64_t i = 0; i < d; i += kPair) {
    const int64_t n = d - i;
    Vec p0, p1, g0, g1;
    w.load(i, n, p0, p1);
    PairIO<float>::load(g + i, n, g0, g1);
    f(i, n, p0, p1, g0 * mult, g1 * mult);
    w.store(i, n, p0, p1);
  }
}

// The sum of squares of a row's gradient (times grad_mult), grouped as
// math::kRowSquareSums says: the same bits on every instruction set and on CUDA.
inline float row_sum_of_squares(const float* g, int64_t d, float grad_mult) {
  constexpr int64_t kSums = math::kRowSquareSums;
  float acc[kSums] = {};
  for (int64_t i = 0; i < d; i += kSums) {
    const int64_t n = std::min(kSums, d - i);
    for (int64_t l = 0; l < n; ++l) {
      acc[l] = math::row_square_partial(acc[l], g[i + l] * grad_mult);
    }
  }
  float sum = 0.f;
  for (int64_t l = 0; l < kSums; ++l) {
    sum += acc[l];
  }
  return sum;
}

template <typename T, WeightStore kStore>
void step_rows(const SparseRowsStep& s, const float* sums) {
  constexpr bool kMaster = master_mode_info(kStore).kept != MasterKept::kNothing;
  const int64_t d = s.dim;
  // The rows' memory asked for kRowsAhead slots ahead: weights (or master and table) and the
  // state of the table's shape.
  const bool row_state = s.state0 != nullptr && s.algorithm != SparseAlgorithm::kRowWiseAdagrad;
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(float));
  const auto touched = [&](auto&& row_step) {
    at::parallel_for(0, s.num_slots, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t slot = begin; slot < end; ++slot) {
        if (slot + kRowsAhead < end) {
          const int64_t ahead = s.rows[slot + kRowsAhead];
          if constexpr (kMaster) {
            prefetch_row(kept_row<T, kStore>(s, ahead), d * sizeof(KeptElem<T, kStore>));
          }
          prefetch_row(static_cast<T*>(s.table) + ahead * d, d * sizeof(T));
          if (row_state) {
            prefetch_row(s.state0 + ahead * d, row_bytes);
            if (s.state1 != nullptr) {
              prefetch_row(s.state1 + ahead * d, row_bytes);
            }
          }
        }
        row_step(s.rows[slot], sums + slot * d);
      }
    });
  };
  switch (s.algorithm) {
    case SparseAlgorithm::kSgd:
      if (s.state0 == nullptr) {
        touched([&](int64_t r, const float* g) {
          step_row<T, kStore>(s, r, g, [&](int64_t, int64_t, Vec& p0, Vec& p1, Vec g0, Vec g1) {
            math::sparse_sgd_update(p0, g0, s.neg_lr);
            math::sparse_sgd_update(p1, g1, s.neg_lr);
          });
        });
      } else {
        // Every row: the buffer of a row not looked up still decays and moves the row. A row
        // not looked up whose buffer is all +0 (never looked up, the long tail of a large
        // table) would keep every bit (+0 * momentum + +0 = +0; p + -lr * +0 = p), so only its
        // buffer is read.
        const std::vector<float> zeros(static_cast<size_t>(d), 0.f);
        at::parallel_for(0, s.num_rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            const int32_t slot = s.row_slot[r];
            float* buf = s.state0 + r * d;
            if (slot < 0 && all_bits_zero(buf, d)) {
              continue;
            }
            const float* g = slot >= 0 ? sums + slot * d : zeros.data();
            step_row<T, kStore>(s, r, g, [&](int64_t i, int64_t n, Vec& p0, Vec& p1, Vec g0,
                                              Vec g1) {
              Vec b0, b1;
              PairIO<float>::load(buf + i, n, b0, b1);
              math::sparse_sgd_momentum_update(p0, b0, g0, s.neg_lr, s.momentum,
                                               s.one_minus_dampening, s.nesterov, s.first_step);
              math::sparse_sgd_momentum_update(p1, b1, g1, s.neg_lr, s.momentum,
                                               s.one_minus_dampening, s.nesterov, s.first_step);
              PairIO<float>::store(buf + i, n, b0, b1);
            });
          }
        });
      }
      break;
    case SparseAlgorithm::kAdagrad:
      touched([&](int64_t r, const float* g) {
        float* sum = s.state0 + r * d;
        step_row<T, kStore>(s, r, g, [&](int64_t i, int64_t n, Vec& p0, Vec& p1, Vec g0,
                                          Vec g1) {
          Vec s0, s1;
          PairIO<float>::load(sum + i, n, s0, s1);
          math::sparse_adagrad_update(p0, s0, g0, s.neg_lr, s.eps);
          math::sparse_adagrad_update(p1, s1, g1, s.neg_lr, s.eps);
          PairIO<float>::store(sum + i, n, s0, s1);
        });
      });
      break;
    case SparseAlgorithm::kAdam:
      touched([&](int64_t r, const float* g) {
        float* m = s.state0 + r * d;
        float* v = s.state1 + r * d;
        step_row<T, kStore>(s, r, g, [&](int64_t i, int64_t n, Vec& p0, Vec& p1, Vec g0,
                                          Vec g1) {
          Vec m0, m1, v0, v1;
          PairIO<float>::load(m + i, n, m0, m1);
          PairIO<float>::load(v + i, n, v0, v1);
          math::sparse_adam_update(p0, m0, v0, g0, s.one_minus_beta1, s.one_minus_beta2,
                                   s.neg_lr, s.eps);
          math::sparse_adam_update(p1, m1, v1, g1, s.one_minus_beta1, s.one_minus_beta2,
                                   s.neg_lr, s.eps);
          PairIO<float>::store(m + i, n, m0, m1);
          PairIO<float>::store(v + i, n, v0, v1);
        });
      });
      break;
    case SparseAlgorithm::kRowWiseAdagrad:
      touched([&](int64_t r, const float* g) {
        const float multiplier = math::rowwise_adagrad_multiplier(
            s.state0[r], row_sum_of_squares(g, d, s.grad_mult), d, s.neg_lr, s.eps);
        step_row<T, kStore>(s, r, g, [&](int64_t, int64_t, Vec& p0, Vec& p1, Vec g0, Vec g1) {
          math::rowwise_adagrad_update(p0, g0, multiplier);
          math::rowwise_adagrad_update(p1, g1, multiplier);
        });
      });
      break;
  }
}

// The element types of a checked FP32/FP16/BF16 table or gradient.
using FloatTypes = DtypeSwitch<float, c10::Half, c10::BFloat16>;

}  // namespace sparse_rows

void sparse_rows_step(const SparseRowsStep& s) {
  using namespace sparse_rows;
  // Lookups that are all distinct rows with FP32 values (sparse_rows_sum_'s output) are their
  // own sums, slot k being lookup k: the copy into the scratch would change no bit.
  const float* sums = nullptr;
  if (s.values_dtype == at::kFloat && s.num_slots == s.nnz) {
    sums = static_cast<const float*>(s.values);
  } else {
    float* scratch = summed_rows(s.num_slots * s.dim);
    static_switch(
        [&](auto v) {
          using TV = decltype(v);
          sum_lookups<TV, false, false>(static_cast<TV*>(const_cast<void*>(s.values)), s.nnz,
                                        s.dim, s.slot_of, scratch, 1.f);
        },
        FloatTypes{s.values_dtype});
    sums = scratch;
  }
  static_switch(
      [&](auto t, auto store) {
        using T = decltype(t);
        if constexpr (kernels::sparse_store_fits<T>(decltype(store)::value)) {
          step_rows<T, decltype(store)::value>(s, sums);
        }
      },
      FloatTypes{s.table_dtype}, kernels::SparseRowStores{s.store});
}

SparseRowsSumResult sparse_rows_sum(const SparseRowsSumPass& s) {
  using namespace sparse_rows;
  SparseRowsSumResult out;
  static_switch(
      [&](auto v, auto unscale, auto stats) {
        using TV = decltype(v);
        out = sum_lookups<TV, decltype(unscale)::value, decltype(stats)::value>(
            static_cast<TV*>(s.values), s.nnz, s.dim, s.slot_of, s.sums,
            s.unscale ? s.inv_scale : 1.f);
      },
      FloatTypes{s.values_dtype}, BoolSwitch{s.unscale}, BoolSwitch{s.stats});
  return out;
}

}  // namespace fusedamp::cpu::CPU_CAPABILITY
