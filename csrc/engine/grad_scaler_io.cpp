// fusedamp::GradScaler's options and state from outside: torch.amp's setters, checkpoints
// (save/load, load_state), each validated completely before anything is replaced.
#include <fusedamp/grad_scaler.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <cmath>
#include <limits>

#include "../ops/hyper_params.h"

namespace fusedamp {

void GradScaler::check_positive_finite(const char* name, double v) {
  TORCH_CHECK(std::isfinite(v) && v > 0.0, kWho, ": ", name, " must be finite and > 0, got ",
              v);
}

void GradScaler::validate(const GradScalerOptions& o) {
  check_positive_finite("init_scale", o.init_scale());
  hyper::check_scale_options(kWho, o.growth_factor(), o.backoff_factor(), o.growth_interval(),
                             o.hysteresis(), o.min_scale(), o.max_scale());
  check_positive_finite("amax_target", o.amax_target());
  TORCH_CHECK(o.telemetry_capacity() >= 1, kWho, ": telemetry_capacity must be >= 1, got ",
              o.telemetry_capacity());
  TORCH_CHECK(o.policy() != ScalePolicy::kAmax || o.telemetry() || !o.enabled(), kWho,
              ": the amax policy needs telemetry=true (amax is measured by the telemetry pass)");
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
namespace {

// The options a checkpoint carries, by archive name; integers and bools travel as doubles.
struct OptionField {
  const char* name;
  double (*get)(const GradScalerOptions&);
  void (*set)(GradScalerOptions&, double);
};
constexpr OptionField kOptionFields[] = {
    {"init_scale", [](const GradScalerOptions& o) { return o.init_scale(); },
     [](GradScalerOptions& o, double v) { o.init_scale(v); }},
    {"growth_factor", [](const GradScalerOptions& o) { return o.growth_factor(); },
     [](GradScalerOptions& o, double v) { o.growth_factor(v); }},
    {"backoff_factor", [](const GradScalerOptions& o) { return o.backoff_factor(); },
     [](GradScalerOptions& o, double v) { o.backoff_factor(v); }},
    {"growth_interval", [](const GradScalerOptions& o) { return double(o.growth_interval()); },
     [](GradScalerOptions& o, double v) { o.growth_interval(static_cast<int64_t>(v)); }},
    {"hysteresis", [](const GradScalerOptions& o) { return double(o.hysteresis()); },
     [](GradScalerOptions& o, double v) { o.hysteresis(static_cast<int64_t>(v)); }},
    {"enabled", [](const GradScalerOptions& o) { return o.enabled() ? 1.0 : 0.0; },
     [](GradScalerOptions& o, double v) { o.enabled(v != 0.0); }},
};
// Options added after the first archive version: read when present (older archives: torch's
// policy, the default target).
constexpr OptionField kLaterOptionFields[] = {
    {"policy", [](const GradScalerOptions& o) { return o.policy() == ScalePolicy::kAmax ? 1.0 : 0.0; },
     [](GradScalerOptions& o, double v) {
       o.policy(v != 0.0 ? ScalePolicy::kAmax : ScalePolicy::kTorch);
     }},
    {"amax_target", [](const GradScalerOptions& o) { return o.amax_target(); },
     [](GradScalerOptions& o, double v) { o.amax_target(v); }},
};
// The counters, by archive name, and the scaler member that holds each.
constexpr const char* kCounterNames[] = {"scale", "growth_tracker", "hysteresis_tracker"};

}  // namespace

void GradScaler::save(torch::serialize::OutputArchive& a) const {
  a.write("fusedamp_grad_scaler", c10::IValue(int64_t{2}));
  for (const auto& f : kOptionFields) {
    a.write(f.name, c10::IValue(f.get(opts_)));
  }
  for (const auto& f : kLaterOptionFields) {
    a.write(f.name, c10::IValue(f.get(opts_)));
  }
  for (const auto& [name, bound] : {std::pair{"min_scale", opts_.min_scale()},
                                    std::pair{"max_scale", opts_.max_scale()}}) {
    if (bound) {
      a.write(name, c10::IValue(*bound));
    }
  }
  if (scale_.defined()) {
    const at::Tensor* counters[] = {&scale_, &growth_tracker_, &hysteresis_tracker_};
    for (size_t i = 0; i < 3; ++i) {
      a.write(kCounterNames[i], counters[i]->to(at::kCPU), /*is_buffer=*/true);
    }
  }
}

void GradScaler::load(torch::serialize::InputArchive& a) {
  c10::IValue v;
  TORCH_CHECK(a.try_read("fusedamp_grad_scaler", v), kWho,
              "::load: the archive holds no fusedamp GradScaler state");
  auto o = opts_;
  for (const auto& f : kOptionFields) {
    a.read(f.name, v);
    f.set(o, v.isDouble() ? v.toDouble() : v.isBool() ? double(v.toBool()) : double(v.toInt()));
  }
  o.policy(ScalePolicy::kTorch);
  o.amax_target(kDefaultAmaxTarget);
  for (const auto& f : kLaterOptionFields) {
    if (a.try_read(f.name, v)) {
      f.set(o, v.toDouble());
    }
  }
  o.min_scale(a.try_read("min_scale", v) ? std::optional<double>(v.toDouble()) : std::nullopt);
  o.max_scale(a.try_read("max_scale", v) ? std::optional<double>(v.toDouble()) : std::nullopt);
  validate(o);
  at::Tensor counters[3];
  const bool has_state = a.try_read(kCounterNames[0], counters[0], true);
  if (has_state) {
    a.read(kCounterNames[1], counters[1], true);
    a.read(kCounterNames[2], counters[2], true);
    const auto& [s, g, h] = counters;
    TORCH_CHECK(s.numel() == 1 && g.numel() == 1 && h.numel() == 1, kWho,
                "::load: scale and trackers must have one element each");
    TORCH_CHECK(s.is_floating_point() && !g.is_floating_point() && !h.is_floating_point(), kWho,
                "::load: scale must be floating point and the trackers integers");
    check_state(s.item<double>(), g.item<int64_t>(), h.item<int64_t>());
  }
  opts_ = o;
  end_iteration();
  if (has_state) {
    load_state(counters[0].item<double>(), counters[1].item<int64_t>(),
               counters[2].item<int64_t>());
  }
}

void GradScaler::load_state(const GradScalerOptions& options, double scale,
                            int64_t growth_tracker, int64_t hysteresis_tracker) {
  validate(options);
  check_state(scale, growth_tracker, hysteresis_tracker);
  TORCH_CHECK(options.enabled() == opts_.enabled() && options.device() == opts_.device(), kWho,
              "::load_state: enabled and device are not part of a state");
  opts_ = options;
  load_state(scale, growth_tracker, hysteresis_tracker);
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
  end_iteration();
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
