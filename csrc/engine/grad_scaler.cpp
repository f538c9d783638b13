// fusedamp::GradScaler (see include/fusedamp/grad_scaler.h).
#include <fusedamp/grad_scaler.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <fusedamp/ops.h>
#include <fusedamp/optim/optimizer.h>
#include <torch/optim/optimizer.h>

#include <cmath>
#include <vector>

#include "inverse_scale.h"
#include "scaler_grads.h"
#include "scaler_telemetry.h"
#include "small_writes.h"


namespace fusedamp {
namespace {

// 2^15: the largest power of two below FP16's largest finite value, 65504.
constexpr double kLargestHalfPowerOfTwo = 32768.0;

std::vector<at::Tensor> params_with_grads(const torch::optim::Optimizer& opt) {
  std::vector<at::Tensor> out;
  for (const auto& g : opt.param_groups()) {
    for (const auto& p : g.params()) {
      if (p.grad().defined()) {
        out.push_back(p);
      }
    }
  }
  return out;
}

c10::Device first_device(at::TensorList params, const c10::Device& fallback) {
  return params.empty() ? fallback : params.front().device();
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : opts_(std::move(options)) {
  validate(opts_);
  if (opts_.enabled() && opts_.telemetry()) {
    telemetry_ = std::make_unique<detail::ScalerTelemetry>(opts_.telemetry_capacity());
  }
}

GradScaler::~GradScaler() = default;
GradScaler::GradScaler(GradScaler&&) noexcept = default;
GradScaler& GradScaler::operator=(GradScaler&&) noexcept = default;

GradTelemetrySink* GradScaler::telemetry_sink() {
  return telemetry_.get();
}

TelemetryLog GradScaler::telemetry() const {
  return telemetry_ ? telemetry_->read() : TelemetryLog{};
}

void GradScaler::ensure_state(const c10::Device& device) {
  const auto target = opts_.device().value_or(device);
  if (!scale_.defined()) {
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(target);
    const auto i32 = at::TensorOptions().dtype(at::kInt).device(target);
    scale_ = at::full({1}, opts_.init_scale(), f32);
    growth_tracker_ = at::zeros({1}, i32);
    hysteresis_tracker_ = at::full({1}, opts_.hysteresis(), i32);
    found_inf_ = at::zeros({}, f32);
    inv_scale_ = at::empty({1}, f32);
    bound_ = true;
  } else if (!bound_) {
    // Loaded before the device was known: move to where the training runs.
    for (at::Tensor* t : {&scale_, &growth_tracker_, &hysteresis_tracker_, &found_inf_,
                          &inv_scale_}) {
      *t = t->to(target);
    }
    bound_ = true;
  } else {
    return;
  }
  scale_0d_ = scale_.reshape({});  // made once, not on every step
}

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!opts_.enabled()) {
    return outputs;
  }
  TORCH_CHECK(outputs.defined(), kWho, "::scale: the tensor is undefined");
  TORCH_CHECK(outputs.is_floating_point(), kWho, "::scale: the tensor must be floating point, got ",
              outputs.scalar_type());
  ensure_state(outputs.device());
  if (outputs.scalar_type() == at::kHalf) {
    // The gradient that reaches an FP16 output is the scale itself, rounded to FP16: above
    // 65504 it is inf and the step is lost to the scale alone (torch's default 2^16 loses
    // every FP16-loss run's first step). The scale is held to the largest power of two FP16
    // carries, on the device (no sync); an FP32 loss keeps torch's sequence.
    scale_.clamp_max_(kLargestHalfPowerOfTwo);
  }
  // The scale as a 0-dim tensor, as torch.amp's: a scalar FP16 loss gives an FP32 result, a
  // tensor of outputs keeps its dtype (type promotion).
  const auto s = scale_.device() == outputs.device() ? scale_ : scale_.to(outputs.device(), true);
  return outputs * s.reshape({});
}

void GradScaler::begin_iteration(const c10::Device& fallback) {
  ensure_state(fallback);
  if (!iteration_begun_) {
    iteration_begun_ = true;
    if (telemetry_) {
      telemetry_->begin_iteration(scale_.device());
    }
  }
}

const at::Tensor& GradScaler::inv_scale_tensor() const {
  // Computed when first asked for in an iteration: an optimizer that unscales in its own step
  // (fusedamp's, torch's fused ones) never needs the scaler's.
  if (!inv_scale_current_ && inv_scale_.defined()) {
    detail::inverse_scale_into(inv_scale_, scale_);
    inv_scale_current_ = true;
  }
  return inv_scale_;
}

void GradScaler::end_iteration() {
  per_optimizer_.clear();
  iteration_begun_ = false;
  inv_scale_current_ = false;
}

at::Tensor GradScaler::zero_flag() const {
  at::Tensor flag = at::empty({}, scale_.options());
  detail::zero_small(flag);
  return flag;
}

GradScaler::PerOptimizer& GradScaler::record_unscale(OptimizerKey key) {
  auto& r = per_optimizer_[key];
  TORCH_CHECK(r.stage != Stage::kUnscaled, kWho,
              "::unscale_: unscale_() has already been called on this optimizer since the "
              "last update()");
  TORCH_CHECK(r.stage != Stage::kStepped, kWho,
              "::unscale_: unscale_() is being called after step() (call update() first)");
  return r;
}

GradScaler::PerOptimizer& GradScaler::record_step(OptimizerKey key) {
  auto& r = per_optimizer_[key];
  TORCH_CHECK(r.stage != Stage::kStepped, kWho,
              "::step: step() has already been called since the last update()");
  return r;
}

// ---- stages by key ----------------------------------------------------------------------------

void GradScaler::unscale_(OptimizerKey key, at::TensorList params) {
  unscale_through(key, params, telemetry_.get());
}

void GradScaler::unscale_(OptimizerKey key, at::TensorList params, ShardedGradStats& shards) {
  unscale_through(key, params, &shards);
  if (opts_.enabled() && !shards.has_pass()) {
    // No gradient the fused pass takes (the flag came from the per-tensor check alone): the
    // collectives still need this process's flag.
    shards.seed(per_optimizer_.at(key).found_inf);
  }
}

void GradScaler::unscale_through(OptimizerKey key, at::TensorList params,
                                 GradTelemetrySink* sink) {
  if (!opts_.enabled()) {
    return;
  }
  auto& r = record_unscale(key);
  begin_iteration(first_device(params, c10::Device(c10::kCPU)));
  at::NoGradGuard no_grad;
  r.found_inf = detail::unscale_grads(params, inv_scale_tensor(), scale_.device(), sink);
  r.stage = Stage::kUnscaled;
}

GradScaler::AmpHandover GradScaler::begin_amp_step(OptimizerKey key,
                                                   at::TensorList params_to_check) {
  TORCH_CHECK(opts_.enabled(), kWho, "::begin_amp_step: the scaler is disabled");
  auto& r = record_step(key);
  begin_iteration(first_device(params_to_check, c10::Device(c10::kCPU)));
  AmpHandover h;
  if (r.stage == Stage::kReady) {
    h.grad_scale = scale_0d_;  // a 0-dim view, as torch.amp hands its scale over
    at::NoGradGuard no_grad;
    r.found_inf = params_to_check.empty() ? zero_flag()
                                          : detail::check_grads(params_to_check, scale_.device(),
                                                                telemetry_.get());
  }
  h.found_inf = r.found_inf;
  return h;
}

bool GradScaler::begin_plain_step(OptimizerKey key, at::TensorList params) {
  if (record_step(key).stage == Stage::kReady) {
    unscale_(key, params);
  }
  const auto& found = per_optimizer_.at(key).found_inf;
  return found.item<float>() == 0.f;  // the host read torch.amp does too
}

void GradScaler::end_step(OptimizerKey key) {
  per_optimizer_[key].stage = Stage::kStepped;
}

// ---- the C++ optimizers --------------------------------------------------------------------

void GradScaler::unscale_(optim::Optimizer& optimizer) {
  unscale_(static_cast<torch::optim::Optimizer&>(optimizer));
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  unscale_(&optimizer, params_with_grads(optimizer));
}

void GradScaler::step(optim::Optimizer& optimizer) {
  if (!opts_.enabled()) {
    optimizer.step();
    return;
  }
  for (const auto& g : optimizer.param_groups()) {
    if (!g.params().empty()) {
      ensure_state(g.params().front().device());  // the scale lives where the training runs
      break;
    }
  }
  auto h = begin_amp_step(&optimizer, {});
  optimizer.step_amp(h.grad_scale, h.found_inf, telemetry_sink());
  end_step(&optimizer);
}

void GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (auto* fused = dynamic_cast<optim::Optimizer*>(&optimizer)) {
    step(*fused);
    return;
  }
  if (!opts_.enabled()) {
    optimizer.step();
    return;
  }
  const auto params = params_with_grads(optimizer);
  TORCH_CHECK(!params.empty() || per_optimizer_.count(&optimizer), kWho,
              "::step: no inf checks were recorded for this optimizer (no parameter has a "
              "gradient)");
  if (begin_plain_step(&optimizer, params)) {
    optimizer.step();
  }
  end_step(&optimizer);
}

// ---- the scale --------------------------------------------------------------------------------

void GradScaler::update() {
  if (!opts_.enabled()) {
    return;
  }
  const bool amax_policy =
      telemetry_ && opts_.policy() == ScalePolicy::kAmax && telemetry_->measured();
  TORCH_CHECK(!amax_policy || opts_.amax_target() < telemetry_->dtype_max(), kWho,
              "::update: amax_target ", opts_.amax_target(),
              " is not below the largest finite value of the gradients' dtype (",
              telemetry_ ? telemetry_->dtype_max() : 0.0,
              "): every step at the scale it aims for would overflow");
  bool any = false;
  for (const auto& [key, r] : per_optimizer_) {
    if (!r.found_inf.defined()) {
      continue;
    }
    if (!any) {
      // The flags are the scaler's own, made for this iteration (0-dim, as torch.amp's): the
      // first becomes found_inf_ without a copy (a kernel launch on a GPU) or a reshape where
      // it can; the others are added into it.
      const auto& first = r.found_inf;
      if (first.device() == scale_.device() && first.scalar_type() == at::kFloat &&
          first.dim() == 0) {
        found_inf_ = first;
      } else {
        found_inf_ = first.to(scale_.device(), at::kFloat).reshape({}).clone();
      }
      any = true;
    } else {
      found_inf_.add_(r.found_inf.to(found_inf_.device()));
    }
  }
  TORCH_CHECK(any, kWho,
              "::update: no inf checks were recorded prior to update() (call step() first)");
  std::optional<at::Tensor> amax;
  std::optional<double> amax_target;
  if (telemetry_) {
    // No pass this iteration (a sharded optimizer's step): nothing measured, torch's rule.
    if (amax_policy) {
      amax = telemetry_->amax();
      amax_target = opts_.amax_target();
    }
    telemetry_->record(scale_, found_inf_);  // the scale the gradients carried
  }
  ops::update_scale_({scale_, growth_tracker_, hysteresis_tracker_, found_inf_,
                      opts_.growth_factor(), opts_.backoff_factor(), opts_.growth_interval(),
                      opts_.hysteresis(), opts_.min_scale(), opts_.max_scale(), amax,
                      amax_target});
  end_iteration();
}

void GradScaler::update(double new_scale) {
  if (!opts_.enabled()) {
    return;
  }
  check_positive_finite("new_scale", new_scale);
  ensure_state(opts_.device().value_or(c10::Device(c10::kCPU)));
  scale_.fill_(new_scale);
  end_iteration();
  if (telemetry_) {
    telemetry_->discard();
  }
}

void GradScaler::update(const at::Tensor& new_scale) {
  if (!opts_.enabled()) {
    return;
  }
  TORCH_CHECK(new_scale.defined() && new_scale.numel() == 1 && new_scale.is_floating_point() &&
                  !new_scale.requires_grad(),
              kWho,
              "::update: new_scale must be a float or a one-element floating-point tensor "
              "without requires_grad, got ",
              new_scale.defined() ? new_scale.toString() : std::string("an undefined tensor"),
              new_scale.defined() ? " of " + std::to_string(new_scale.numel()) + " elements"
                                  : std::string());
  const auto target = opts_.device().value_or(scale_.defined() ? scale_.device()
                                                               : new_scale.device());
  TORCH_CHECK(new_scale.device().type() == target.type(), kWho,
              "::update: new_scale is on ", new_scale.device(), ", the scale on ", target);
  ensure_state(target);
  scale_.copy_(new_scale.reshape({1}), /*non_blocking=*/true);
  end_iteration();
  if (telemetry_) {
    telemetry_->discard();
  }
}

double GradScaler::get_scale() const {
  if (!opts_.enabled()) {
    return 1.0;
  }
  if (!scale_.defined()) {
    return opts_.init_scale();
  }
  return static_cast<double>(scale_.item<float>());
}

}  // namespace fusedamp
