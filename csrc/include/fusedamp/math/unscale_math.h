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

C10_HOST_DEVICE inline bool is_nonfinite_marker(float acc) {
  return acc != acc;  // NaN
}

}  // namespace fusedamp::math
