#pragma once
// What a master-weight optimizer records after each step (account_step_): whether the step was
// applied, the running count of skipped steps, and the global norm of the unscaled gradients.
// found_inf is the step's flag as the statistics pass and torch's check leave it: 0 when every
// gradient was finite, nonzero (1, or a sum over devices) when some were not. A NaN flag counts
// as set, as torch's `found_inf != 0` does.
#include <c10/macros/Macros.h>
#include <fusedamp/math/clip_math.h>

#include <cstdint>

namespace fusedamp::math {

// 1 when the step was applied (nothing found), else 0: last_step_applied's value.
C10_HOST_DEVICE inline float step_applied(float found_inf) {
  return found_inf == 0.f ? 1.f : 0.f;
}

// What a step adds to the skipped-step counter.
C10_HOST_DEVICE inline int64_t steps_skipped(float found_inf) {
  return found_inf != 0.f ? 1 : 0;
}

}  // namespace fusedamp::math
