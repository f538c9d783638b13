#pragma once
// The loss-scale state machine, one step. With hysteresis == 1 and no bounds this is exactly
// torch._amp_update_scale_: on overflow scale *= backoff and the growth tracker resets; after
// growth_interval clean steps in a row scale *= growth (only if the result is finite).
// Hysteresis h: back off only on the h-th overflow in a row (the hysteresis tracker counts
// the overflows still tolerated; a clean step refills it). Once it is exhausted, every further
// consecutive overflow backs off. min_scale / max_scale clamp the result (<= 0 means unset).
#include <c10/macros/Macros.h>
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
};

C10_HOST_DEVICE inline bool finite_f(float x) {
  return x - x == 0.f;
}

C10_HOST_DEVICE inline void update_scale(
    float& scale, int32_t& growth_tracker, int32_t& hysteresis_tracker, bool found_inf,
    const ScaleHyper& h) {
  if (found_inf) {
    growth_tracker = 0;
    hysteresis_tracker = hysteresis_tracker > 0 ? hysteresis_tracker - 1 : 0;
    if (hysteresis_tracker <= 0) {
      float s = static_cast<float>(scale * h.backoff_factor);
      if (h.min_scale > 0.f && s < h.min_scale) {
        s = h.min_scale;
      }
      scale = s;
    }
    return;
  }
  hysteresis_tracker = h.hysteresis;
  const int32_t successful = growth_tracker + 1;
  if (successful == h.growth_interval) {
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
