#pragma once
// What every fusedamp optimizer's options struct shares (lr, weight_decay, maximize and the
// engine fields of FUSEDAMP_ENGINE_OPTION_FIELDS), handled in one place for Adam and SGD:
// access by name (set_group_option/group_option), serialisation, conversion to
// EngineGroupOptions, and the checked access to a group's options.
#include <fusedamp/optim/optimizer.h>

#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <optional>
#include <string>

namespace fusedamp::optim::detail {

// Returns false for a name that is not one of the shared options.
template <typename Options>
bool set_common_option(Options& o, const std::string& name, double value) {
  if (name == "lr") {
    o.lr(value);
  } else if (name == "weight_decay") {
    o.weight_decay(value);
  } else if (name == "max_grad_norm") {
    o.max_grad_norm(norm_option(value));
  } else if (name == "maximize") {
    o.maximize(value != 0.0);
  } else if (name == "master_weights") {
    o.master_weights(value != 0.0);
  } else if (name == "skip_nonfinite") {
    o.skip_nonfinite(value != 0.0);
  } else {
    return false;
  }
  return true;
}

template <typename Options>
std::optional<double> common_option(const Options& o, const std::string& name) {
  if (name == "lr") return o.lr();
  if (name == "weight_decay") return o.weight_decay();
  if (name == "max_grad_norm") return o.max_grad_norm().value_or(0.0);
  if (name == "maximize") return o.maximize() ? 1.0 : 0.0;
  if (name == "master_weights") return o.master_weights() ? 1.0 : 0.0;
  if (name == "skip_nonfinite") return o.skip_nonfinite() ? 1.0 : 0.0;
  return std::nullopt;
}

template <typename Options>
EngineGroupOptions engine_options_of(const Options& o) {
  return {o.master_weights(), o.max_grad_norm(), o.skip_nonfinite(), o.lr_tensor()};
}

template <typename Options>
void write_common_options(const Options& o, torch::serialize::OutputArchive& a) {
  a.write("lr", c10::IValue(o.lr()));
  a.write("weight_decay", c10::IValue(o.weight_decay()));
  a.write("maximize", c10::IValue(o.maximize()));
  a.write("master_weights", c10::IValue(o.master_weights()));
  a.write("skip_nonfinite", c10::IValue(o.skip_nonfinite()));
  if (o.max_grad_norm()) {
    a.write("max_grad_norm", c10::IValue(*o.max_grad_norm()));
  }
}

template <typename Options>
void read_common_options(Options& o, torch::serialize::InputArchive& a) {
  c10::IValue v;
  a.read("lr", v);
  o.lr(v.toDouble());
  a.read("weight_decay", v);
  o.weight_decay(v.toDouble());
  a.read("maximize", v);
  o.maximize(v.toBool());
  a.read("master_weights", v);
  o.master_weights(v.toBool());
  a.read("skip_nonfinite", v);
  o.skip_nonfinite(v.toBool());
  o.max_grad_norm(a.try_read("max_grad_norm", v) ? std::optional<double>(v.toDouble())
                                                 : std::nullopt);
}

// The options of param group `group`, as the optimizer's own options type.
template <typename Options>
Options& group_options_as(std::vector<torch::optim::OptimizerParamGroup>& groups, size_t group,
                          const char* who, const char* type_name) {
  TORCH_CHECK(group < groups.size(), who, ": param group ", group, " does not exist (",
              groups.size(), " groups)");
  auto* o = dynamic_cast<Options*>(&groups[group].options());
  TORCH_CHECK(o != nullptr, who, ": param group ", group, " does not hold ", type_name);
  return *o;
}

}  // namespace fusedamp::optim::detail
