#pragma once
// Reductions of a vector's lanes, in lane order. Included only by the per-instruction-set
// kernel files.
#include <fusedamp/math/unscale_math.h>

#include "vec_io.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace fusedamp::cpu::CPU_CAPABILITY {

// f(std::integral_constant<int64_t, J>) for J in the sequence, in order.
template <int64_t... J, typename F>
C10_ALWAYS_INLINE void for_each_place(std::integer_sequence<int64_t, J...>, const F& f) {
  (f(std::integral_constant<int64_t, J>{}), ...);
}

// Reductions over the first `live` lanes (all by default), in lane order.
inline bool has_nan(const Vec& v, int64_t live = Vec::size()) {
  float lanes[Vec::size()];
  v.store(lanes);
  for (int64_t l = 0; l < live; ++l) {
    if (math::is_nonfinite_marker(lanes[l])) {
      return true;
    }
  }
  return false;
}

// The first `live` lanes of v combined, from 0 (the identity of both: amax is non-negative).
template <typename Combine>
inline float lane_reduce(const Vec& v, int64_t live, const Combine& combine) {
  float lanes[Vec::size()];
  v.store(lanes);
  float r = 0.f;
  for (int64_t l = 0; l < live; ++l) {
    r = combine(r, lanes[l]);
  }
  return r;
}

inline float lane_sum(const Vec& v, int64_t live = Vec::size()) {
  return lane_reduce(v, live, [](float a, float b) { return a + b; });
}

inline float lane_max(const Vec& v, int64_t live = Vec::size()) {
  return lane_reduce(v, live, [](float a, float b) { return b > a ? b : a; });
}

// A sum of squares in math::kSquareSumLanes lanes (math/unscale_math.h: the order every CPU
// build follows). AVX-512 holds the lanes in one pair of vectors, AVX2 and DEFAULT in two, so a
// range is walked in groups of kSumLanes elements (for_each_pair_in_groups) and each pair of a
// group adds to its own lanes. Lanes past the end hold +0, which adds nothing: a range of at
// most kSumLanes / 2 elements sums its squares in order, as lane_sum does.
constexpr int64_t kSumLanes = math::kSquareSumLanes;
constexpr int64_t kPairsPerSumGroup = kSumLanes / kPair;
static_assert(kSumLanes % kPair == 0, "a pair's lanes are whole lanes of the sum");

struct SquareSums {
  Vec lanes[2 * kPairsPerSumGroup];

  SquareSums() {
    for (auto& v : lanes) {
      v = Vec(0.f);
    }
  }
  // The squares of pair J of a group.
  template <int64_t J>
  C10_ALWAYS_INLINE void add(std::integral_constant<int64_t, J>, const Vec& a, const Vec& b) {
    lanes[2 * J] = math::accumulate_square(lanes[2 * J], a);
    lanes[2 * J + 1] = math::accumulate_square(lanes[2 * J + 1], b);
  }
  float fold() const {
    float l[kSumLanes];
    for (int64_t k = 0; k < 2 * kPairsPerSumGroup; ++k) {
      lanes[k].store(l + k * Vec::size());
    }
    return math::fold_square_sums(l);
  }
};

// f(i, k, j) for the pairs of n elements in order: i the pair's first element, k its count
// (kPair, a constant, for every pair of a whole group; what is left for the last), j its place
// in its group of kSumLanes elements (a std::integral_constant, for SquareSums::add).
template <typename F>
C10_ALWAYS_INLINE void for_each_pair_in_groups(int64_t n, const F& f) {
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for_each_place(std::make_integer_sequence<int64_t, kPairsPerSumGroup>{},
                   [&](auto j) __attribute__((always_inline)) { f(i + j() * kPair, kPair, j); });
  }
  for_each_place(std::make_integer_sequence<int64_t, kPairsPerSumGroup>{},
                 [&](auto j) __attribute__((always_inline)) {
    const int64_t at = i + j() * kPair;
    if (at < n) {
      f(at, std::min<int64_t>(kPair, n - at), j);
    }
  });
}

}  // namespace fusedamp::cpu::CPU_CAPABILITY
