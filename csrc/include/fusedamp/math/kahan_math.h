#pragma once
// master_weights="kahan": the 16-bit weight w plus a 16-bit compensation c of the same dtype
// hold the value w + c (about twice the weight's precision), and each step stores its FP32
// result x as w = round(x), c = round(x − w): what rounding the weight dropped is carried to
// the next step instead of being lost (Kahan's compensated summation, applied to the weight).
//
// The model's weight is the truth: a compensation belongs to its weight only while w is the
// rounding of w + c (|c| at most half an ulp of w; exactly half where the step's rounding tied).
// Anything else means the weight was edited (a loaded snapshot, a clamp, a pruning mask) and
// the stale compensation is dropped: the step starts from w. A zero weight has none (a pruned
// weight stays exactly zero).
#include <fusedamp/math/lane_ops.h>

namespace fusedamp::math {

// The value a step updates. `sum` is w + c in FP32, `rounded_sum` its rounding to the weight's
// dtype (read back as FP32), as the kernel stores weights.
template <typename V>
C10_HOST_DEVICE inline V kahan_weight(V weight, V sum, V rounded_sum) {
  // Genuine: sum rounds to the weight, or sum lies exactly halfway between the weight and the
  // value it rounds to (a tie the step's own rounding resolved towards the weight).
  const V at_tie = LaneOps<V>::where_equal(sum + sum, weight + rounded_sum, sum, weight);
  return LaneOps<V>::where_equal(rounded_sum, weight, sum, at_tie);
}

// The compensation to store beside the new weight `rounded` = round(x): x − rounded, exact in
// FP32 (Sterbenz), rounded to the weight's dtype by the store.
template <typename V>
C10_HOST_DEVICE inline V kahan_compensation(V x, V rounded) {
  return x - rounded;
}

}  // namespace fusedamp::math
