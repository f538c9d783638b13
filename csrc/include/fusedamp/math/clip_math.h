#pragma once
// The multiplier applied to every gradient inside a fused step: the inverse loss scale times
// the clipping coefficient of torch.nn.utils.clip_grad_norm_, both computed from device-side
// scalars so that no value ever has to reach the host.
#include <c10/macros/Macros.h>
#include <cmath>

namespace fusedamp::math {

// sum_sq is the sum of squares of the *scaled* gradients (from grad_stats_), so the norm of
// the unscaled gradients is sqrt(sum_sq) * inv_scale (FP32, the square root correctly rounded,
// as at::sqrt and torch's clip_grad_norm_ compute it).
C10_HOST_DEVICE inline float unscaled_grad_norm(float sum_sq, float inv_scale) {
#if defined(__CUDA_ARCH__)
  return ::sqrtf(sum_sq) * inv_scale;
#else
  return std::sqrt(sum_sq) * inv_scale;
#endif
}

// max_norm <= 0 disables clipping.
C10_HOST_DEVICE inline float grad_multiplier(float inv_scale, float sum_sq, float max_norm) {
  if (!(max_norm > 0.f)) {
    return inv_scale;
  }
  const float norm = unscaled_grad_norm(sum_sq, inv_scale);
  // Same formula as clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1. Written
  // so that a NaN norm gives a NaN coefficient, as torch's clamp(max=1) does (a NaN norm must
  // not turn clipping off).
  float coef = max_norm / (norm + 1e-6f);
  coef = coef > 1.f ? 1.f : coef;
  return inv_scale * coef;
}

}  // namespace fusedamp::math
