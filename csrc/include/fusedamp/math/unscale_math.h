#pragma once
// Unscaling and the overflow check. `x * 0` is 0 for every finite x and NaN for inf and NaN,
// so adding it into an accumulator detects non-finite values with no compare or branch per
// element, in float and in vector lanes alike.
#include <fusedamp/math/lane_ops.h>

namespace fusedamp::math {

template <typename V>
C10_HOST_DEVICE inline V unscale(V g, V inv_scale) {
  return g * inv_scale;
}

// acc stays finite (0) until a non-finite value has been seen, then it is NaN for good.
template <typename V>
C10_HOST_DEVICE inline V accumulate_nonfinite(V acc, V x) {
  return acc + x * V(0.f);
}

// One fused multiply-add per element (one instruction on AVX2, AVX-512 and CUDA).
template <typename V>
C10_HOST_DEVICE inline V accumulate_square(V acc, V x) {
  return LaneOps<V>::fma(x, x, acc);
}

// The order of a range's sum of squares (the global norm behind clipping, grad_stats_), the
// same whatever a kernel's vector width: element i goes into partial sum i % kSquareSumLanes
// (accumulate_square, in increasing i), then the partial sums fold as s[l] + s[l + half] for
// l < half, those added in order from +0 (fold_square_sums). The CPU builds all follow it
// (cpu/lane_reduce.h SquareSums); the CUDA kernels sum in their blocks' order. 32: the lanes of
// an AVX-512 pair (that build's loop is one pair per group; AVX2's and DEFAULT's, two).
constexpr int kSquareSumLanes = 32;

C10_HOST_DEVICE inline float fold_square_sums(const float* s) {
  constexpr int half = kSquareSumLanes / 2;
  float r = 0.f;
  for (int l = 0; l < half; ++l) {
    r += s[l] + s[l + half];
  }
  return r;
}

C10_HOST_DEVICE inline bool is_nonfinite_marker(float acc) {
  return acc != acc;  // NaN
}

}  // namespace fusedamp::math
