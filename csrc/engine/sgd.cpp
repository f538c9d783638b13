// fusedamp::optim::SGD: options, validation, and the fused sgd_step_ per bucket.
#include <fusedamp/optim/sgd.h>

#include "common_options.h"

#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <cmath>

namespace fusedamp::optim {

SGDOptions::SGDOptions(double lr) : lr_(lr) {}

void SGDOptions::serialize(torch::serialize::OutputArchive& a) const {
  detail::write_common_options(*this, a);
  a.write("momentum", c10::IValue(momentum_));
  a.write("dampening", c10::IValue(dampening_));
  a.write("nesterov", c10::IValue(nesterov_));
}

void SGDOptions::serialize(torch::serialize::InputArchive& a) {
  detail::read_common_options(*this, a);
  c10::IValue v;
  a.read("momentum", v);
  momentum_ = v.toDouble();
  a.read("dampening", v);
  dampening_ = v.toDouble();
  a.read("nesterov", v);
  nesterov_ = v.toBool();
}

SGD::SGD(const std::vector<torch::optim::OptimizerParamGroup>& groups, SGDOptions defaults)
    : Optimizer(groups, std::make_unique<SGDOptions>(defaults)) {
  check_all_options();
}

SGD::SGD(std::vector<at::Tensor> params, SGDOptions defaults)
    : SGD({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

SGDOptions& SGD::group_options(size_t group) {
  return detail::group_options_as<SGDOptions>(param_groups_, group, "fusedamp::optim::SGD",
                                              "SGDOptions");
}

const SGDOptions& SGD::group_options(size_t group) const {
  return const_cast<SGD*>(this)->group_options(group);
}

void SGD::set_group_option(size_t group, const std::string& name, double value) {
  auto& o = group_options(group);
  if (detail::set_common_option(o, name, value)) {
    return;
  }
  if (name == "momentum") {
    o.momentum(value);
  } else if (name == "dampening") {
    o.dampening(value);
  } else if (name == "nesterov") {
    o.nesterov(value != 0.0);
  } else {
    TORCH_CHECK(false, "fusedamp::optim::SGD: unknown option '", name, "'");
  }
}

double SGD::group_option(size_t group, const std::string& name) const {
  const auto& o = group_options(group);
  if (auto v = detail::common_option(o, name)) return *v;
  if (name == "momentum") return o.momentum();
  if (name == "dampening") return o.dampening();
  if (name == "nesterov") return o.nesterov() ? 1.0 : 0.0;
  TORCH_CHECK(false, "fusedamp::optim::SGD: unknown option '", name, "'");
}

void SGD::set_group_lr_tensor(size_t group, const at::Tensor& lr) {
  group_options(group).lr_tensor(lr);
}

EngineGroupOptions SGD::engine_options(const torch::optim::OptimizerOptions& base) const {
  return detail::engine_options_of(static_cast<const SGDOptions&>(base));
}

void SGD::check_options(const torch::optim::OptimizerOptions& base, size_t group) const {
  const auto* o = dynamic_cast<const SGDOptions*>(&base);
  TORCH_CHECK(o != nullptr, "fusedamp::optim::SGD: param group ", group,
              " has options of another optimizer (expected SGDOptions)");
  TORCH_CHECK(std::isfinite(o->lr()) && o->lr() >= 0.0, "fusedamp::optim::SGD: invalid lr ",
              o->lr(), " in param group ", group, " (must be finite and >= 0)");
  TORCH_CHECK(std::isfinite(o->momentum()) && o->momentum() >= 0.0,
              "fusedamp::optim::SGD: invalid momentum ", o->momentum(), " in param group ",
              group, " (must be finite and >= 0)");
  TORCH_CHECK(std::isfinite(o->dampening()), "fusedamp::optim::SGD: invalid dampening ",
              o->dampening(), " in param group ", group);
  TORCH_CHECK(std::isfinite(o->weight_decay()) && o->weight_decay() >= 0.0,
              "fusedamp::optim::SGD: invalid weight_decay ", o->weight_decay(),
              " in param group ", group, " (must be finite and >= 0)");
  TORCH_CHECK(!o->nesterov() || (o->momentum() > 0.0 && o->dampening() == 0.0),
              "fusedamp::optim::SGD: Nesterov momentum requires momentum > 0 and zero "
              "dampening (param group ", group, ")");
  detail::check_engine_options("fusedamp::optim::SGD", engine_options(*o), group);
}

std::pair<const char*, const char*> SGD::slot_names() const {
  return {kMomentumBuffer, nullptr};
}

int SGD::slots_needed(const torch::optim::OptimizerOptions& base) const {
  return static_cast<const SGDOptions&>(base).momentum() != 0.0 ? 1 : 0;
}

void SGD::run_step(const Bucket& b, const torch::optim::OptimizerOptions& base,
                   const ops::StepScalars& s) {
  const auto& o = static_cast<const SGDOptions&>(base);
  ops::SgdArgs args;
  args.lr = o.lr();
  args.momentum = o.momentum();
  args.dampening = o.dampening();
  args.weight_decay = o.weight_decay();
  args.nesterov = o.nesterov();
  args.maximize = o.maximize();
  ops::sgd_step_(b.params, b.masters, b.grads, b.a, b.steps, args, s);
}

std::unique_ptr<torch::optim::OptimizerOptions> SGD::make_options() const {
  return std::make_unique<SGDOptions>();
}

}  // namespace fusedamp::optim
