// fusedamp::hyper (see hyper_params.h).
#include "hyper_params.h"

#include <c10/util/Exception.h>

namespace fusedamp::hyper {

void check_scale_options(const char* who, double growth_factor, double backoff_factor,
                         int64_t growth_interval, int64_t hysteresis,
                         std::optional<double> min_scale, std::optional<double> max_scale) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(std::isfinite(growth_factor) && growth_factor > 1.0, who,
              ": growth_factor must be > 1, got ", growth_factor);
  TORCH_CHECK(backoff_factor > 0.0 && backoff_factor < 1.0, who,
              ": backoff_factor must be in (0, 1), got ", backoff_factor);
  TORCH_CHECK(growth_interval >= 1 && growth_interval <= kInt32Max, who,
              ": growth_interval must be a positive int32, got ", growth_interval);
  TORCH_CHECK(hysteresis >= 1 && hysteresis <= kInt32Max, who,
              ": hysteresis must be a positive int32, got ", hysteresis);
  for (const auto& [name, bound] : {std::pair{"min_scale", min_scale}, {"max_scale", max_scale}}) {
    if (bound) {
      TORCH_CHECK(std::isfinite(*bound) && *bound > 0.0, who, ": ", name,
                  " must be finite and > 0, got ", *bound);
    }
  }
  if (min_scale && max_scale) {
    TORCH_CHECK(*min_scale <= *max_scale, who, ": min_scale (", *min_scale,
                ") must not exceed max_scale (", *max_scale, ")");
  }
}

}  // namespace fusedamp::hyper
