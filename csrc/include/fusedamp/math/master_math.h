#pragma once
// Master weights under the rule "the model's weights are the truth": the FP32 master carries the
// bits below the 16-bit weight, and after every step the weight is the rounding of its master.
// Where a weight is no longer that rounding, the user changed the model between steps (loaded a
// snapshot, clamped or zeroed weights, applied a pruning mask, swapped in an EMA); the step then
// starts from the weight, so the edit is kept instead of being overwritten from a stale master.
// An edit that lands exactly on the old rounding is indistinguishable from no edit and keeps the
// master's lower bits, which round to the same weight.
#include <fusedamp/math/lane_ops.h>

namespace fusedamp::math {

// The FP32 value a step updates: master, or param where param != rounded_master (the master
// rounded to the param's dtype and back, exactly as the step stores the param).
template <typename V>
C10_HOST_DEVICE inline V weight_to_update(V master, V param, V rounded_master) {
  return LaneOps<V>::where_equal(rounded_master, param, master, param);
}

}  // namespace fusedamp::math
