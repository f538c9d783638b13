#pragma once
// OptimizerOf<Options>: what Adam and SGD share, written once — the typed access to a group's
// options, the options every fusedamp optimizer carries (lr, weight_decay, maximize and the
// engine fields of FUSEDAMP_ENGINE_OPTION_FIELDS: by name, serialised, validated), and the
// adaptation of the engine's untyped hooks to the algorithm's typed ones. An algorithm adds
// only its own: its named hyper-parameters, their checks, the state it needs and its fused op.
#include <fusedamp/optim/optimizer.h>
#include <fusedamp/optim/options.h>

#include <c10/util/Exception.h>

#include <memory>
#include <optional>
#include <string>

namespace fusedamp::optim {

namespace detail {
// Validation shared by every optimizer kind (csrc/engine/hyper_params.cpp); throws
// c10::ValueError with torch.optim's wording, naming the group.
void check_common_options(const char* who, double lr, double weight_decay,
                          const EngineGroupOptions& e, size_t group);
}  // namespace detail

template <typename Options>
class OptimizerOf : public Optimizer {
 public:
  Options& group_options(size_t group) { return as(checked_group(group)); }
  const Options& group_options(size_t group) const { return as(checked_group(group)); }

 protected:
  using Optimizer::Optimizer;

  // ---- what the algorithm adds -------------------------------------------------------------
  virtual bool set_algorithm_option(Options& o, const std::string& name, double v) const = 0;
  virtual std::optional<double> algorithm_option(const Options& o,
                                                 const std::string& name) const = 0;
  // Throws c10::ValueError for an invalid algorithm hyper-parameter of group `group`.
  virtual void check_algorithm(const Options& o, size_t group) const = 0;
  virtual StateSlots slots_for(const Options& o) const = 0;
  virtual void run(const detail::Bucket& b, const Options& o,
                   const ops::StepScalars& s) const = 0;

 private:
  static Options& as(torch::optim::OptimizerOptions& o) { return static_cast<Options&>(o); }
  static const Options& as(const torch::optim::OptimizerOptions& o) {
    return static_cast<const Options&>(o);
  }

  EngineGroupOptions engine_options(const torch::optim::OptimizerOptions& base) const final {
    const auto& o = as(base);
    return {o.master_weights(), o.max_grad_norm(), o.skip_nonfinite(), o.lr_tensor()};
  }

  void check_group(const torch::optim::OptimizerOptions& base, size_t group) const final {
    const auto* o = dynamic_cast<const Options*>(&base);
    TORCH_CHECK_VALUE(o != nullptr, "fusedamp::optim::", kind(), ": param group ", group,
                      " holds the options of another optimizer");
    detail::check_common_options(kind(), o->lr(), o->weight_decay(), engine_options(*o), group);
    check_algorithm(*o, group);
  }

  StateSlots slots_needed(const torch::optim::OptimizerOptions& o) const final {
    return slots_for(as(o));
  }

  bool set_own_option(torch::optim::OptimizerOptions& base, const std::string& name,
                      double value) const final {
    auto& o = as(base);
    if (name == "lr") {
      o.lr(value);
    } else if (name == "weight_decay") {
      o.weight_decay(value);
    } else if (name == "max_grad_norm") {
      o.max_grad_norm(value);  // checked by check_options(); "off" is set_group_max_grad_norm
    } else if (name == "maximize") {
      o.maximize(value != 0.0);
    } else if (name == "master_weights") {
      o.master_weights(value != 0.0);
    } else if (name == "skip_nonfinite") {
      o.skip_nonfinite(value != 0.0);
    } else {
      return set_algorithm_option(o, name, value);
    }
    return true;
  }

  std::optional<double> own_option(const torch::optim::OptimizerOptions& base,
                                   const std::string& name) const final {
    const auto& o = as(base);
    if (name == "lr") return o.lr();
    if (name == "weight_decay") return o.weight_decay();
    if (name == "max_grad_norm") return o.max_grad_norm().value_or(0.0);
    if (name == "maximize") return o.maximize() ? 1.0 : 0.0;
    if (name == "master_weights") return o.master_weights() ? 1.0 : 0.0;
    if (name == "skip_nonfinite") return o.skip_nonfinite() ? 1.0 : 0.0;
    return algorithm_option(o, name);
  }

  void set_lr_tensor(torch::optim::OptimizerOptions& o, const at::Tensor& lr) const final {
    as(o).lr_tensor(lr);
  }

  void set_max_grad_norm(torch::optim::OptimizerOptions& o,
                         std::optional<double> max_norm) const final {
    as(o).max_grad_norm(max_norm);
  }

  std::unique_ptr<torch::optim::OptimizerOptions> make_options() const final {
    return std::make_unique<Options>();
  }

  void run_bucket(const detail::Bucket& b, const torch::optim::OptimizerOptions& o,
                  const ops::StepScalars& s) const final {
    run(b, as(o), s);
  }
};

}  // namespace fusedamp::optim
