#pragma once
// The first pass of a CPU sparse step: a sparse gradient's lookups summed per table row in FP32
// (sum_lookups), optionally unscaled in place and with grad_stats_'s statistics gathered as they
// are read (sparse_rows_sum_). Included only by the per-instruction-set kernel files.
#include <fusedamp/math/telemetry_math.h>
#include <fusedamp/math/unscale_math.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "half_patterns.h"
#include "lane_reduce.h"
#include "sparse_rows.h"
#include "vec_io.h"

namespace fusedamp::cpu::CPU_CAPABILITY {
namespace sparse_rows {

// What sum_lookups gathers for grad_stats_'s telemetry and sum of squares, in lanes, for a
// chunk of values; add() takes a pair of the values as given (p: their memory, n of them).
// 16-bit values are counted from their bit patterns (half_patterns.h: half the instructions
// of the float forms); FP32 ones as floats. The squares go to the lanes of SquareSums (j: the
// pair's place in its group), so every instruction set sums them in the same order.
template <typename TV>
struct LookupStats {
  static constexpr bool kHalf = !std::is_same_v<TV, float>;
  std::conditional_t<kHalf, HalfPatternLanes<TV, true, true>, math::TelemetryLanes<Vec>> lanes =
      {};
  SquareSums squares;

  LookupStats() {
    if constexpr (!kHalf) {
      lanes = math::telemetry_zero<Vec>();
    }
  }

  template <typename Place>
  C10_ALWAYS_INLINE void add(const TV* p, int64_t n, const Vec& v0, const Vec& v1, Place j) {
    if constexpr (kHalf) {
      lanes.add(p, n);
    } else {
      const Vec smallest_normal(math::smallest_normal<float>());
      math::accumulate_telemetry(lanes, v0, smallest_normal);
      math::accumulate_telemetry(lanes, v1, smallest_normal);
    }
    squares.add(j, v0, v1);
  }

  void into(SparseRowsSumResult& out) const {
    if constexpr (kHalf) {
      using P = math::HalfPatterns<TV>;
      out.amax = std::max(out.amax, static_cast<double>(P::value(lanes.largest(
                                        lanes.finite_top))));
      out.n_small += static_cast<double>(lanes.sum(lanes.n_small));
      out.n_zero += static_cast<double>(lanes.sum(lanes.n_zero));
    } else {
      out.amax = std::max(out.amax, static_cast<double>(lane_max(lanes.amax)));
      out.n_small += lane_sum(lanes.n_small);
      out.n_zero += lane_sum(lanes.n_zero);
    }
    out.sum_sq += static_cast<double>(squares.fold());
  }
};

// A pair that runs past the values' end loads zeros there: `count` of them were counted as
// small and as zero.
inline void uncount_padding(SparseRowsSumResult& out, int64_t count) {
  out.n_small -= static_cast<double>(count);
  out.n_zero -= static_cast<double>(count);
}

// grad_stats_'s statistics of n values as given (`out` gathers them), read flat: whole pairs
// but for the last, whatever the row width (a short row alone would leave most of a pair's
// lanes idle). Counts stay in lanes for at most 2^12 groups of kSumLanes values (a lane takes
// one per pair: at most 2^14 with the narrowest pairs, of 8), exact in 16-bit and float lanes
// alike, then go into doubles. The chunks are the same on every instruction set.
template <typename TV>
void flat_stats(const TV* v, int64_t n, SparseRowsSumResult& out) {
  constexpr int64_t kMaxChunk = (int64_t{1} << 12) * kSumLanes;
  for (int64_t c0 = 0; c0 < n; c0 += kMaxChunk) {
    const int64_t c1 = std::min(n, c0 + kMaxChunk);
    LookupStats<TV> stats;
    const TV* c = v + c0;
    for_each_pair_in_groups(c1 - c0, [&](int64_t i, int64_t k, auto j)
                                         __attribute__((always_inline)) {
      Vec v0, v1;
      PairIO<TV>::load(c + i, k, v0, v1);
      stats.add(c + i, k, v0, v1, j);
    });
    stats.into(out);
    uncount_padding(out, (kPair - (c1 - c0) % kPair) % kPair);  // the last pair's
  }
}

// Lookups per block: ~4,096 values. Where the statistics read a block flat, the sums read it
// again from the core's first-level cache.
constexpr int64_t kBlockValues = 4096;

// Slots are numbered in first-lookup order, so lookup k is its row's first exactly when its
// slot is the next new one. With kUnscale each lookup is first multiplied by inv_scale and
// written back into values (in its dtype), the value then added being the one written. The
// result says whether any partial sum was non-finite: an inf or NaN lookup leaves its row's sum
// so, and so does a sum that overflows FP32. With kStats it also holds grad_stats_'s telemetry
// and sum of squares of the values as given (math/telemetry_math.h), before they are unscaled:
// in the same read, or, for rows shorter than kSumLanes, flat block by block (such a row would
// leave most lanes idle: 26 FP16 tables of 512 lookups of 16 on AVX-512, telemetry's cost
// 1.12x the step -> 1.04x; with rows of 64 the reread cost more than it saved). kSumLanes, not
// a pair, is the bound so that every instruction set sums the squares in the same order.
template <typename TV, bool kUnscale, bool kStats>
SparseRowsSumResult sum_lookups(TV* values, int64_t nnz, int64_t d, const int32_t* slot_of,
                                float* sums, float inv_scale) {
  const int64_t block = std::max<int64_t>(1, kBlockValues / std::max<int64_t>(d, 1));
  const Vec scale(inv_scale);
  Vec bad(0.f);
  SparseRowsSumResult out;
  int32_t next_new = 0;
  const bool flat = d < kSumLanes;
  for (int64_t k0 = 0; k0 < nnz; k0 += block) {
    const int64_t k1 = std::min(nnz, k0 + block);
    LookupStats<TV> stats;
    if (kStats && flat) {
      flat_stats<TV>(values + k0 * d, (k1 - k0) * d, out);
    }
    for (int64_t k = k0; k < k1; ++k) {
      const int32_t slot = slot_of[k];
      float* acc = sums + static_cast<int64_t>(slot) * d;
      TV* v = values + k * d;
      const bool first = slot == next_new;
      next_new += first ? 1 : 0;
      for_each_pair_in_groups(d, [&](int64_t i, int64_t n, auto j) __attribute__((always_inline)) {
        Vec a0, a1, v0, v1;
        PairIO<TV>::load(v + i, n, v0, v1);
        if (kStats && !flat) {
          stats.add(v + i, n, v0, v1, j);
        }
        if constexpr (kUnscale) {
          PairIO<TV>::store(v + i, n, math::unscale(v0, scale), math::unscale(v1, scale));
          if constexpr (!std::is_same_v<TV, float>) {
            PairIO<TV>::load(v + i, n, v0, v1);  // the rounding the gradient holds
          } else {
            v0 = math::unscale(v0, scale);
            v1 = math::unscale(v1, scale);
          }
        }
        if (!first) {
          PairIO<float>::load(acc + i, n, a0, a1);
          v0 = a0 + v0;
          v1 = a1 + v1;
        }
        bad = math::accumulate_nonfinite(math::accumulate_nonfinite(bad, v0), v1);
        PairIO<float>::store(acc + i, n, v0, v1);
      });
    }
    if (kStats && !flat) {
      stats.into(out);
    }
  }
  if (kStats && !flat) {
    uncount_padding(out, (kPair - d % kPair) % kPair * nnz);  // each row's last pair's
  }
  out.nonfinite = has_nan(bad);  // lanes past a short row's end were loaded as zeros: 0
  return out;
}

}  // namespace sparse_rows
}  // namespace fusedamp::cpu::CPU_CAPABILITY
