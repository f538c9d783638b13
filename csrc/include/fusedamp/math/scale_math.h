#pragma once
// The loss-scale state machine, one step. With hysteresis == 1 and no bounds this is exactly
// torch._amp_update_scale_: on overflow scale *= backoff and the growth tracker resets; after
// growth_interval clean steps in a row scale *= growth (only if the result is finite).
// Hysteresis h is Megatron-Core's (DynamicGradScaler; DeepSpeed's default): the tracker counts
// the overflows still tolerated, every overflow spends one, and only a growth refills it. Once
// it is exhausted every overflow backs off, until the scale grows again. Refilling it on every
// clean step instead (DeepSpeed's consecutive_hysteresis) tolerates an overflow every other
// step forever: the scale never backs off while half the steps are skipped.
// min_scale / max_scale clamp the result (<= 0 means unset).
//
// The amax policy (amax_target > 0): the step also knows amax, the largest finite |gradient|
// of this step's scaled gradients (grad_stats_'s telemetry). amax / scale is the gradients' own
// magnitude, so the scale that puts it just under amax_target is known without trial and error:
// the largest power of two p with amax / scale * p <= amax_target. On a clean step with
// amax > 0 the scale moves there at once (up or down: no waiting growth_interval steps). An
// overflow says that some gradient (or an activation gradient inside the backward pass) went
// past FP16's largest value at this scale, so the true amax is at least max(65504, the finite
// amax): the scale backs off to where that bound would sit under the target, or by torch's
// backoff factor if that is further. Overflowing from far too high a scale (2^24, say) then
// costs one or two skipped steps instead of one per halving, and the first clean step moves
// the scale back up to what it measures. Symmetrically, a clean step whose gradients are all
// zero (amax == 0) proves that every one was below FP16's smallest subnormal, 2^-24, at this
// scale: the scale grows at once to where 2^-24 would sit under the target (x 2^31 for the
// default target). A caller with no measurement at all (no gradient pass this step) passes no
// amax: torch's rule.
#include <c10/macros/Macros.h>
#include <cmath>
#include <cstdint>

namespace fusedamp::math {

// The factors stay double: torch's _amp_update_scale_ (CPU and CUDA) multiplies the FP32 scale
// by the double factor and rounds the product to float once. In float, factors that are not
// powers of two drift from torch within a few steps, and 1 + 1e-8 rounds to 1 (no growth).
struct ScaleHyper {
  double growth_factor;
  double backoff_factor;
  int32_t growth_interval;
  int32_t hysteresis;
  float min_scale;  // <= 0: none
  float max_scale;  // <= 0: none
  double amax_target = 0.0;  // > 0: the amax policy
};

// The amax an overflow proves at least: FP16's largest finite value (loss scaling exists for
// FP16; a BF16 or FP32 gradient that overflows went past far more).
constexpr double kOverflowAmax = 65504.0;
// The amax an all-zero step proves at most: FP16's smallest subnormal (2^-24).
constexpr double kAllZeroAmax = 5.9604644775390625e-08;

C10_HOST_DEVICE inline bool finite_f(float x) {
  return x - x == 0.f;
}

// The largest power of two p with amax / scale * p <= target (amax > 0 and finite), within
// FP32's normal range.
C10_HOST_DEVICE inline float amax_policy_scale(float scale, double amax, double target) {
  const double ratio = target * static_cast<double>(scale) / amax;
  int exponent = 0;
  // ratio = m * 2^exponent with m in [0.5, 1): the largest power of two <= ratio is 2^(e-1).
#if defined(__CUDA_ARCH__)
  (void)::frexp(ratio, &exponent);
#else
  (void)std::frexp(ratio, &exponent);
#endif
  exponent -= 1;
  exponent = exponent > 127 ? 127 : (exponent < -126 ? -126 : exponent);
#if defined(__CUDA_ARCH__)
  return static_cast<float>(::ldexp(1.0, exponent));
#else
  return static_cast<float>(std::ldexp(1.0, exponent));
#endif
}

C10_HOST_DEVICE inline float clamp_scale(float s, const ScaleHyper& h) {
  if (h.max_scale > 0.f && s > h.max_scale) {
    s = h.max_scale;
  }
  if (h.min_scale > 0.f && s < h.min_scale) {
    s = h.min_scale;
  }
  return s;
}

// amax: this step's largest finite |scaled gradient|; read only when h.amax_target > 0 (a
// negative or NaN amax: no measurement).
C10_HOST_DEVICE inline void update_scale(
    float& scale, int32_t& growth_tracker, int32_t& hysteresis_tracker, bool found_inf,
    const ScaleHyper& h, double amax = -1.0) {
  const bool amax_policy = h.amax_target > 0.0;
  const bool measured = amax_policy && amax >= 0.0 && amax - amax == 0.0;
  if (found_inf) {
    growth_tracker = 0;
    hysteresis_tracker = hysteresis_tracker > 0 ? hysteresis_tracker - 1 : 0;
    if (hysteresis_tracker <= 0) {
      float s = static_cast<float>(scale * h.backoff_factor);
      if (amax_policy) {
        const double at_least = measured && amax > kOverflowAmax ? amax : kOverflowAmax;
        const float limit = amax_policy_scale(scale, at_least, h.amax_target);
        s = limit < s ? limit : s;
      }
      if (h.min_scale > 0.f && s < h.min_scale) {
        s = h.min_scale;
      }
      scale = s;
    }
    return;
  }
  if (measured) {
    const double at_most = amax > 0.0 ? amax : kAllZeroAmax;
    const float moved = clamp_scale(amax_policy_scale(scale, at_most, h.amax_target), h);
    if (moved > scale) {  // the amax policy's growth
      hysteresis_tracker = h.hysteresis;
    }
    scale = moved;
    growth_tracker = 0;
    return;
  }
  const int32_t successful = growth_tracker + 1;
  if (successful == h.growth_interval) {
    // Megatron refills at every completed growth interval, also where max_scale (or FP32's
    // range) holds the scale where it is.
    hysteresis_tracker = h.hysteresis;
    float s = static_cast<float>(scale * h.growth_factor);
    if (h.max_scale > 0.f && s > h.max_scale) {
      s = h.max_scale;
    }
    if (finite_f(s)) {
      scale = s;
    }
    growth_tracker = 0;
  } else {
    growth_tracker = successful;
  }
}

}  // namespace fusedamp::math
