// fusedamp::GradScaler (see include/fusedamp/grad_scaler.h).
#include <fusedamp/grad_scaler.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fusedamp/ops.h>
#include <fusedamp/optim/optimizer.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../hyper_params.h"

namespace fusedamp {
namespace {
constexpr const char* kWho = "fusedamp::GradScaler";

void check_positive_finite(const char* name, double v) {
  TORCH_CHECK(std::isfinite(v) && v > 0.0, kWho, ": ", name, " must be finite and > 0, got ",
              v);
}

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

// Runs `op(grads, flag)` once per device over the gradients of `params` (grouped by device, in
// order) and returns the flags summed on `target`: nonzero where any device saw inf/NaN.
template <typename Op>
at::Tensor flag_over_devices(at::TensorList params, const c10::Device& target, const Op& op) {
  std::vector<std::pair<c10::Device, std::vector<at::Tensor>>> by_device;
  for (const auto& p : params) {
    const auto& g = p.grad();
    auto it = std::find_if(by_device.begin(), by_device.end(),
                           [&](const auto& e) { return e.first == g.device(); });
    if (it == by_device.end()) {
      by_device.emplace_back(g.device(), std::vector<at::Tensor>{});
      it = by_device.end() - 1;
    }
    it->second.push_back(g);
  }
  // 0-dim, as torch.amp's flags: torch's fused optimizers combine them with 0-dim step counts.
  auto total = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(target));
  for (auto& [device, grads] : by_device) {
    auto flag = device == target
                    ? total
                    : at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
    op(grads, flag);
    if (device != target) {
      total.add_(flag.to(target, /*non_blocking=*/true));
    }
  }
  return total;
}

}  // namespace

void GradScaler::validate(const GradScalerOptions& o) {
  check_positive_finite("init_scale", o.init_scale());
  hyper::check_scale_options(kWho, o.growth_factor(), o.backoff_factor(), o.growth_interval(),
                             o.hysteresis(), o.min_scale(), o.max_scale());
}

GradScaler::GradScaler(GradScalerOptions options) : opts_(std::move(options)) {
  validate(opts_);
}

void GradScaler::ensure_state(const c10::Device& device) {
  const auto target = opts_.device().value_or(device);
  if (!scale_.defined()) {
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(target);
    const auto i32 = at::TensorOptions().dtype(at::kInt).device(target);
    scale_ = at::full({1}, opts_.init_scale(), f32);
    growth_tracker_ = at::zeros({1}, i32);
    hysteresis_tracker_ = at::full({1}, opts_.hysteresis(), i32);
    found_inf_ = at::zeros({1}, f32);
    inv_scale_ = at::empty({1}, f32);
    bound_ = true;
  } else if (!bound_) {
    // Loaded before the device was known: move to where the training runs.
    for (at::Tensor* t : {&scale_, &growth_tracker_, &hysteresis_tracker_, &found_inf_,
                          &inv_scale_}) {
      *t = t->to(target);
    }
    bound_ = true;
  }
}

at::Tensor GradScaler::scale(const at::Tensor& loss) {
  if (!opts_.enabled()) {
    return loss;
  }
  TORCH_CHECK(loss.defined(), kWho, "::scale: the loss is an undefined tensor");
  TORCH_CHECK(loss.numel() == 1, kWho,
              "::scale: the loss must be a scalar (one element), got a tensor of shape ",
              loss.sizes(), "; reduce it first (e.g. .mean())");
  TORCH_CHECK(loss.is_floating_point(), kWho, "::scale: the loss must be floating point, got ",
              loss.scalar_type());
  ensure_state(loss.device());
  const auto s = scale_.device() == loss.device() ? scale_ : scale_.to(loss.device(), true);
  return loss * s.reshape(loss.sizes());
}

void GradScaler::begin_iteration(const c10::Device& fallback) {
  ensure_state(fallback);
  if (!inv_scale_fresh_) {
    // As torch: the reciprocal in double, rounded once to float.
    inv_scale_.copy_(scale_.to(at::kDouble).reciprocal());
    inv_scale_fresh_ = true;
  }
}

at::Tensor GradScaler::zero_flag() const {
  return at::zeros({}, scale_.options());
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
  if (!opts_.enabled()) {
    return;
  }
  auto& r = record_unscale(key);
  begin_iteration(first_device(params, c10::Device(c10::kCPU)));
  at::NoGradGuard no_grad;
  r.found_inf = flag_over_devices(params, scale_.device(), [&](auto& grads, auto& flag) {
    const auto& d = flag.device();
    ops::unscale_and_check_(grads, flag, d == inv_scale_.device() ? inv_scale_
                                                                  : inv_scale_.to(d, true));
  });
  r.stage = Stage::kUnscaled;
}

GradScaler::AmpHandover GradScaler::begin_amp_step(OptimizerKey key,
                                                   at::TensorList params_to_check) {
  TORCH_CHECK(opts_.enabled(), kWho, "::begin_amp_step: the scaler is disabled");
  auto& r = record_step(key);
  begin_iteration(first_device(params_to_check, c10::Device(c10::kCPU)));
  AmpHandover h;
  if (r.stage == Stage::kReady) {
    h.grad_scale = scale_.reshape({});  // 0-dim view, as torch.amp hands its scale over
    at::NoGradGuard no_grad;
    r.found_inf = params_to_check.empty()
                      ? zero_flag()
                      : flag_over_devices(params_to_check, scale_.device(), [](auto& g, auto& f) {
                          ops::grad_stats_(g, f, at::zeros_like(f));
                        });
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
  optimizer.step_amp(h.grad_scale, h.found_inf);
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
  bool any = false;
  for (const auto& [key, r] : per_optimizer_) {
    if (!r.found_inf.defined()) {
      continue;
    }
    if (!any) {
      found_inf_.copy_(r.found_inf);
      any = true;
    } else {
      found_inf_.add_(r.found_inf.to(found_inf_.device()));
    }
  }
  TORCH_CHECK(any, kWho,
              "::update: no inf checks were recorded prior to update() (call step() first)");
  ops::update_scale_(scale_, growth_tracker_, hysteresis_tracker_, found_inf_,
                     opts_.growth_factor(), opts_.backoff_factor(), opts_.growth_interval(),
                     opts_.hysteresis(), opts_.min_scale(), opts_.max_scale());
  per_optimizer_.clear();
  inv_scale_fresh_ = false;
}

void GradScaler::update(double new_scale) {
  if (!opts_.enabled()) {
    return;
  }
  check_positive_finite("new_scale", new_scale);
  ensure_state(opts_.device().value_or(c10::Device(c10::kCPU)));
  scale_.fill_(new_scale);
  per_optimizer_.clear();
  inv_scale_fresh_ = false;
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

void GradScaler::set_growth_factor(double v) {
  auto o = opts_;
  o.growth_factor(v);
  validate(o);
  opts_ = o;
}

void GradScaler::set_backoff_factor(double v) {
  auto o = opts_;
  o.backoff_factor(v);
  validate(o);
  opts_ = o;
}

void GradScaler::set_growth_interval(int64_t v) {
  auto o = opts_;
  o.growth_interval(v);
  validate(o);
  opts_ = o;
}
void GradScaler::save(torch::serialize::OutputArchive& a) const {
  a.write("fusedamp_grad_scaler", c10::IValue(int64_t{1}));
  a.write("init_scale", c10::IValue(opts_.init_scale()));
  a.write("growth_factor", c10::IValue(opts_.growth_factor()));
  a.write("backoff_factor", c10::IValue(opts_.backoff_factor()));
  a.write("growth_interval", c10::IValue(opts_.growth_interval()));
  a.write("hysteresis", c10::IValue(opts_.hysteresis()));
  a.write("enabled", c10::IValue(opts_.enabled()));
  if (opts_.min_scale()) {
    a.write("min_scale", c10::IValue(*opts_.min_scale()));
  }
  if (opts_.max_scale()) {
    a.write("max_scale", c10::IValue(*opts_.max_scale()));
  }
  if (scale_.defined()) {
    a.write("scale", scale_.to(at::kCPU), /*is_buffer=*/true);
    a.write("growth_tracker", growth_tracker_.to(at::kCPU), /*is_buffer=*/true);
    a.write("hysteresis_tracker", hysteresis_tracker_.to(at::kCPU), /*is_buffer=*/true);
  }
}

void GradScaler::load(torch::serialize::InputArchive& a) {
  c10::IValue v;
  TORCH_CHECK(a.try_read("fusedamp_grad_scaler", v), kWho,
              "::load: the archive holds no fusedamp GradScaler state");
  auto o = opts_;
  a.read("init_scale", v);
  o.init_scale(v.toDouble());
  a.read("growth_factor", v);
  o.growth_factor(v.toDouble());
  a.read("backoff_factor", v);
  o.backoff_factor(v.toDouble());
  a.read("growth_interval", v);
  o.growth_interval(v.toInt());
  a.read("hysteresis", v);
  o.hysteresis(v.toInt());
  a.read("enabled", v);
  o.enabled(v.toBool());
  o.min_scale(a.try_read("min_scale", v) ? std::optional<double>(v.toDouble()) : std::nullopt);
  o.max_scale(a.try_read("max_scale", v) ? std::optional<double>(v.toDouble()) : std::nullopt);
  validate(o);
  at::Tensor s, g, h;
  const bool has_state = a.try_read("scale", s, true);
  if (has_state) {
    a.read("growth_tracker", g, true);
    a.read("hysteresis_tracker", h, true);
    TORCH_CHECK(s.numel() == 1 && g.numel() == 1 && h.numel() == 1, kWho,
                "::load: scale and trackers must have one element each");
    TORCH_CHECK(s.is_floating_point() && !g.is_floating_point() && !h.is_floating_point(), kWho,
                "::load: scale must be floating point and the trackers integers");
    check_state(s.item<double>(), g.item<int64_t>(), h.item<int64_t>());
  }
  opts_ = o;
  per_optimizer_.clear();
  inv_scale_fresh_ = false;
  if (has_state) {
    load_state(s.item<double>(), g.item<int64_t>(), h.item<int64_t>());
  }
}

void GradScaler::load_state(double scale, int64_t growth_tracker, int64_t hysteresis_tracker) {
  check_state(scale, growth_tracker, hysteresis_tracker);
  if (!scale_.defined()) {
    // Not bound to a device yet: keep it on the CPU until the first scale()/step().
    ensure_state(c10::Device(c10::kCPU));
    bound_ = opts_.device().has_value();
  }
  scale_.fill_(scale);
  growth_tracker_.fill_(growth_tracker);
  hysteresis_tracker_.fill_(hysteresis_tracker);
  per_optimizer_.clear();
  inv_scale_fresh_ = false;
}

void GradScaler::check_state(double scale, int64_t growth_tracker, int64_t hysteresis_tracker) {
  check_positive_finite("scale", scale);
  TORCH_CHECK(growth_tracker >= 0 && growth_tracker <= std::numeric_limits<int32_t>::max(), kWho,
              ": growth_tracker must be a non-negative int32, got ", growth_tracker);
  TORCH_CHECK(hysteresis_tracker >= 0 &&
                  hysteresis_tracker <= std::numeric_limits<int32_t>::max(),
              kWho, ": hysteresis_tracker must be a non-negative int32, got ",
              hysteresis_tracker);
}

}  // namespace fusedamp
