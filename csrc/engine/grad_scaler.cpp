// fusedamp::GradScaler (see include/fusedamp/grad_scaler.h).
#include <fusedamp/grad_scaler.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fusedamp/ops.h>
#include <fusedamp/optim/optimizer.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cmath>
#include <limits>
#include <map>
#include <vector>

namespace fusedamp {

namespace {
constexpr const char* kWho = "fusedamp::GradScaler";

void check_positive_finite(const char* name, double v) {
  TORCH_CHECK(std::isfinite(v) && v > 0.0, kWho, ": ", name, " must be finite and > 0, got ",
              v);
}
}  // namespace

void GradScaler::validate(const GradScalerOptions& o) {
  check_positive_finite("init_scale", o.init_scale());
  TORCH_CHECK(std::isfinite(o.growth_factor()) && o.growth_factor() > 1.0, kWho,
              ": growth_factor must be > 1, got ", o.growth_factor());
  TORCH_CHECK(o.backoff_factor() > 0.0 && o.backoff_factor() < 1.0, kWho,
              ": backoff_factor must be in (0, 1), got ", o.backoff_factor());
  TORCH_CHECK(o.growth_interval() >= 1 && o.growth_interval() <= std::numeric_limits<int32_t>::max(),
              kWho, ": growth_interval must be a positive int32, got ", o.growth_interval());
  TORCH_CHECK(o.hysteresis() >= 1 && o.hysteresis() <= std::numeric_limits<int32_t>::max(), kWho,
              ": hysteresis must be a positive int32, got ", o.hysteresis());
  if (o.min_scale()) {
    check_positive_finite("min_scale", *o.min_scale());
  }
  if (o.max_scale()) {
    check_positive_finite("max_scale", *o.max_scale());
  }
  if (o.min_scale() && o.max_scale()) {
    TORCH_CHECK(*o.min_scale() <= *o.max_scale(), kWho, ": min_scale (", *o.min_scale(),
                ") must not exceed max_scale (", *o.max_scale(), ")");
  }
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
    scale_ = scale_.to(target);
    growth_tracker_ = growth_tracker_.to(target);
    hysteresis_tracker_ = hysteresis_tracker_.to(target);
    found_inf_ = found_inf_.to(target);
    inv_scale_ = inv_scale_.to(target);
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

GradScaler::PerOptimizer& GradScaler::record(const void* optimizer) {
  return per_optimizer_[optimizer];
}

namespace {
c10::Device first_device(const torch::optim::Optimizer& opt) {
  for (const auto& g : opt.param_groups()) {
    for (const auto& p : g.params()) {
      return p.device();
    }
  }
  return c10::Device(c10::kCPU);
}
}  // namespace

GradScaler::PerOptimizer& GradScaler::record_unscale(const void* optimizer) {
  auto& r = record(optimizer);
  TORCH_CHECK(r.stage != Stage::Unscaled, kWho,
              "::unscale_: unscale_() has already been called on this optimizer since the "
              "last update()");
  TORCH_CHECK(r.stage != Stage::Stepped, kWho,
              "::unscale_: unscale_() is being called after step() (call update() first)");
  return r;
}

void GradScaler::unscale_(optim::Optimizer& optimizer) {
  if (!opts_.enabled()) {
    return;
  }
  auto& r = record_unscale(&optimizer);
  begin_iteration(first_device(optimizer));
  r.found_inf = optimizer.unscale_grads_(inv_scale_);
  r.stage = Stage::Unscaled;
}

void GradScaler::step(optim::Optimizer& optimizer) {
  if (!opts_.enabled()) {
    optimizer.step();
    return;
  }
  auto& r = record(&optimizer);
  TORCH_CHECK(r.stage != Stage::Stepped, kWho,
              "::step: step() has already been called since the last update()");
  begin_iteration(first_device(optimizer));
  auto f = optimizer.step_scaled(inv_scale_, r.stage == Stage::Unscaled);
  TORCH_CHECK(f.defined(), kWho,
              "::step: no inf checks were recorded for this optimizer (no parameter has a "
              "gradient)");
  r.found_inf = f;
  r.stage = Stage::Stepped;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (auto* fused = dynamic_cast<optim::Optimizer*>(&optimizer)) {
    unscale_(*fused);
    return;
  }
  if (!opts_.enabled()) {
    return;
  }
  auto& r = record_unscale(&optimizer);
  begin_iteration(first_device(optimizer));
  at::NoGradGuard no_grad;
  std::map<std::pair<int, int>, std::vector<at::Tensor>> by_device;
  for (const auto& g : optimizer.param_groups()) {
    for (const auto& p : g.params()) {
      if (p.grad().defined()) {
        const auto d = p.grad().device();
        by_device[{static_cast<int>(d.type()), d.index()}].push_back(p.grad());
      }
    }
  }
  at::Tensor total;
  for (auto& kv : by_device) {
    const auto d = kv.second.front().device();
    auto f = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(d));
    ops::unscale_and_check_(kv.second, f, d == inv_scale_.device() ? inv_scale_
                                                                     : inv_scale_.to(d, true));
    f = f.to(scale_.device());
    total = total.defined() ? total.add_(f) : f;
  }
  r.found_inf = total;
  r.stage = Stage::Unscaled;
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
  {
    auto& r = record(&optimizer);
    TORCH_CHECK(r.stage != Stage::Stepped, kWho,
                "::step: step() has already been called since the last update()");
    if (r.stage == Stage::Ready) {
      unscale_(optimizer);
    }
  }
  auto& r = record(&optimizer);
  TORCH_CHECK(r.found_inf.defined(), kWho,
              "::step: no inf checks were recorded for this optimizer (no parameter has a "
              "gradient)");
  if (r.found_inf.item<float>() == 0.f) {  // the host read torch.amp does too
    optimizer.step();
  }
  r.stage = Stage::Stepped;
}

void GradScaler::update() {
  if (!opts_.enabled()) {
    return;
  }
  std::vector<at::Tensor> found;
  for (const auto& kv : per_optimizer_) {
    if (kv.second.found_inf.defined()) {
      found.push_back(kv.second.found_inf);
    }
  }
  TORCH_CHECK(!found.empty(), kWho,
              "::update: no inf checks were recorded prior to update() (call step() first)");
  found_inf_.copy_(found.front());
  for (size_t i = 1; i < found.size(); ++i) {
    found_inf_.add_(found[i].to(found_inf_.device()));
  }
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
