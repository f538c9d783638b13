// fusedamp::optim::Adam / AdamW: options, validation, and the fused adam_step_ per bucket.
#include <fusedamp/optim/adam.h>

#include "common_options.h"

#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <cmath>

namespace fusedamp::optim {

AdamOptions::AdamOptions(double lr) : lr_(lr) {}

AdamWOptions::AdamWOptions(double lr) : AdamOptions(lr) {
  weight_decay(1e-2);
  decoupled_weight_decay(true);
}

void AdamOptions::serialize(torch::serialize::OutputArchive& a) const {
  detail::write_common_options(*this, a);
  a.write("beta1", c10::IValue(std::get<0>(betas_)));
  a.write("beta2", c10::IValue(std::get<1>(betas_)));
  a.write("eps", c10::IValue(eps_));
  a.write("decoupled_weight_decay", c10::IValue(decoupled_weight_decay_));
}

void AdamOptions::serialize(torch::serialize::InputArchive& a) {
  detail::read_common_options(*this, a);
  c10::IValue v;
  a.read("beta1", v);
  const double b1 = v.toDouble();
  a.read("beta2", v);
  betas_ = std::make_tuple(b1, v.toDouble());
  a.read("eps", v);
  eps_ = v.toDouble();
  a.read("decoupled_weight_decay", v);
  decoupled_weight_decay_ = v.toBool();
}

Adam::Adam(const std::vector<torch::optim::OptimizerParamGroup>& groups, AdamOptions defaults)
    : Optimizer(groups, std::make_unique<AdamOptions>(defaults)) {
  check_all_options();
}

Adam::Adam(std::vector<at::Tensor> params, AdamOptions defaults)
    : Adam({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

AdamW::AdamW(const std::vector<torch::optim::OptimizerParamGroup>& groups, AdamOptions defaults)
    : Adam(groups, defaults.decoupled_weight_decay(true)) {
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    group_options(i).decoupled_weight_decay(true);
  }
}

AdamW::AdamW(std::vector<at::Tensor> params, AdamOptions defaults)
    : AdamW({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

AdamOptions& Adam::group_options(size_t group) {
  return detail::group_options_as<AdamOptions>(param_groups_, group, "fusedamp::optim::Adam",
                                               "AdamOptions");
}

const AdamOptions& Adam::group_options(size_t group) const {
  return const_cast<Adam*>(this)->group_options(group);
}

void Adam::set_group_option(size_t group, const std::string& name, double value) {
  auto& o = group_options(group);
  if (detail::set_common_option(o, name, value)) {
    return;
  }
  if (name == "beta1") {
    o.betas(std::make_tuple(value, std::get<1>(o.betas())));
  } else if (name == "beta2") {
    o.betas(std::make_tuple(std::get<0>(o.betas()), value));
  } else if (name == "eps") {
    o.eps(value);
  } else {
    TORCH_CHECK(false, "fusedamp::optim::Adam: unknown option '", name, "'");
  }
}

double Adam::group_option(size_t group, const std::string& name) const {
  const auto& o = group_options(group);
  if (auto v = detail::common_option(o, name)) return *v;
  if (name == "beta1") return std::get<0>(o.betas());
  if (name == "beta2") return std::get<1>(o.betas());
  if (name == "eps") return o.eps();
  TORCH_CHECK(false, "fusedamp::optim::Adam: unknown option '", name, "'");
}

void Adam::set_group_lr_tensor(size_t group, const at::Tensor& lr) {
  group_options(group).lr_tensor(lr);
}

EngineGroupOptions Adam::engine_options(const torch::optim::OptimizerOptions& base) const {
  return detail::engine_options_of(static_cast<const AdamOptions&>(base));
}

void Adam::check_options(const torch::optim::OptimizerOptions& base, size_t group) const {
  const auto* o = dynamic_cast<const AdamOptions*>(&base);
  TORCH_CHECK(o != nullptr, "fusedamp::optim::Adam: param group ", group,
              " has options of another optimizer (expected AdamOptions)");
  const auto b1 = std::get<0>(o->betas());
  const auto b2 = std::get<1>(o->betas());
  TORCH_CHECK(std::isfinite(o->lr()) && o->lr() >= 0.0, "fusedamp::optim::Adam: invalid lr ",
              o->lr(), " in param group ", group, " (must be finite and >= 0)");
  TORCH_CHECK(b1 >= 0.0 && b1 < 1.0, "fusedamp::optim::Adam: invalid beta1 ", b1,
              " in param group ", group, " (must be in [0, 1))");
  TORCH_CHECK(b2 >= 0.0 && b2 < 1.0, "fusedamp::optim::Adam: invalid beta2 ", b2,
              " in param group ", group, " (must be in [0, 1))");
  TORCH_CHECK(std::isfinite(o->eps()) && o->eps() >= 0.0, "fusedamp::optim::Adam: invalid eps ",
              o->eps(), " in param group ", group, " (must be finite and >= 0)");
  TORCH_CHECK(std::isfinite(o->weight_decay()) && o->weight_decay() >= 0.0,
              "fusedamp::optim::Adam: invalid weight_decay ", o->weight_decay(),
              " in param group ", group, " (must be finite and >= 0)");
  detail::check_engine_options("fusedamp::optim::Adam", engine_options(*o), group);
}

std::pair<const char*, const char*> Adam::slot_names() const {
  return {kExpAvg, kExpAvgSq};
}

int Adam::slots_needed(const torch::optim::OptimizerOptions&) const {
  return 2;
}

void Adam::run_step(const Bucket& b, const torch::optim::OptimizerOptions& base,
                    const ops::StepScalars& s) {
  const auto& o = static_cast<const AdamOptions&>(base);
  ops::AdamArgs args;
  args.lr = o.lr();
  args.beta1 = std::get<0>(o.betas());
  args.beta2 = std::get<1>(o.betas());
  args.eps = o.eps();
  args.weight_decay = o.weight_decay();
  args.decoupled_weight_decay = o.decoupled_weight_decay();
  args.maximize = o.maximize();
  ops::adam_step_(b.params, b.masters, b.grads, b.a, b.b, b.steps, args, s);
}

std::unique_ptr<torch::optim::OptimizerOptions> Adam::make_options() const {
  return std::make_unique<AdamOptions>();
}

}  // namespace fusedamp::optim
