#pragma once
// The optional scalars of a fused step (adam_step_, sgd_step_) as raw data pointers, and how a
// step reads them: written once for the host, where the CPU backend reads them (its tensors are
// plain memory), and for the device, where the CUDA kernels read them per block (so that no
// value ever has to reach the host). Filled by step_prelude.h.
#include <c10/macros/Macros.h>
#include <fusedamp/math/clip_math.h>

namespace fusedamp {

struct StepScalarPointers {
  const float* lr = nullptr;           // overrides lr_host
  const float* inv_scale = nullptr;    // 1 if absent
  const float* found_inf = nullptr;    // the step is skipped where *found_inf != 0
  const float* grad_sum_sq = nullptr;  // 0 if absent
  float max_grad_norm = 0.f;           // <= 0: no clipping
  float lr_host = 0.f;                 // used when lr is nullptr

  // A skipped step reads and writes nothing (steps included).
  C10_HOST_DEVICE bool skipped() const {
    return found_inf != nullptr && *found_inf != 0.f;
  }
  C10_HOST_DEVICE float learning_rate() const {
    return lr != nullptr ? *lr : lr_host;
  }
  // The factor every gradient is multiplied by: the inverse loss scale times the clip
  // coefficient (clip_math.h).
  C10_HOST_DEVICE float grad_multiplier() const {
    return math::grad_multiplier(inv_scale != nullptr ? *inv_scale : 1.f,
                                 grad_sum_sq != nullptr ? *grad_sum_sq : 0.f, max_grad_norm);
  }
};

}  // namespace fusedamp
