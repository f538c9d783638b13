#pragma once
// The valid range of every hyper-parameter, written once for the operators (checks.cpp),
// the optimizers (engine/hyper_params.cpp) and the loss scaler. Callers word their messages
// for their audience — an operator names its arguments, an optimizer speaks torch.optim's
// words — but the ranges themselves live only here.
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

namespace fusedamp::hyper {

inline bool finite_nonneg(double v) {
  return std::isfinite(v) && v >= 0.0;
}
inline bool valid_lr(double v) {
  return finite_nonneg(v);
}
inline bool valid_eps(double v) {
  return finite_nonneg(v);
}
inline bool valid_weight_decay(double v) {
  return finite_nonneg(v);
}
inline bool valid_beta(double v) {
  return v >= 0.0 && v < 1.0;
}
inline bool valid_momentum(double v) {
  return finite_nonneg(v);
}
inline bool valid_dampening(double v) {
  return std::isfinite(v);
}
// Nesterov momentum needs a momentum and no dampening (torch.optim.SGD's rule).
inline bool valid_nesterov(bool nesterov, double momentum, double dampening) {
  return !nesterov || (momentum > 0.0 && dampening == 0.0);
}
inline bool valid_max_grad_norm(double v) {
  return std::isfinite(v) && v > 0.0;
}

// The loss scaler's options (fusedamp::GradScaler and the update_scale_ operator); throws
// c10::Error "<who>: <name> must be ..., got <value>".
void check_scale_options(const char* who, double growth_factor, double backoff_factor,
                         int64_t growth_interval, int64_t hysteresis,
                         std::optional<double> min_scale, std::optional<double> max_scale);

}  // namespace fusedamp::hyper
