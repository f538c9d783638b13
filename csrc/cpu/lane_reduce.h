#pragma once
// Reductions of a vector's lanes, in lane order. Included only by the per-instruction-set
// kernel files.
#include <fusedamp/math/unscale_math.h>

#include "vec_io.h"

namespace fusedamp::cpu::CPU_CAPABILITY {

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

}  // namespace fusedamp::cpu::CPU_CAPABILITY
