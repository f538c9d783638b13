// fusedamp::optim::Adam / AdamW: options, their checks, and the fused adam_step_ per bucket.
#include <fusedamp/optim/adam.h>

#include <torch/serialize/archive.h>

#include <fusedamp/ops.h>

#include "bucket_plan.h"
#include "optimizer_of_impl.h"
#include "option_checks.h"
#include "options_io.h"
#include "step_call.h"

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
  a.write("amsgrad", c10::IValue(amsgrad_));
}

void AdamOptions::serialize(torch::serialize::InputArchive& a) {
  detail::read_common_options(*this, a);
  c10::IValue v;
  a.read("beta1", v);
  const double beta1 = v.toDouble();
  a.read("beta2", v);
  betas_ = std::make_tuple(beta1, v.toDouble());
  a.read("eps", v);
  eps_ = v.toDouble();
  a.read("decoupled_weight_decay", v);
  decoupled_weight_decay_ = v.toBool();
  amsgrad_ = a.try_read("amsgrad", v) && v.toBool();  // absent from older archives: off
}

template <>
struct AlgorithmOf<AdamOptions> {
  static constexpr const char* kName = "Adam";

  static StateSlots known_slots() {
    return {StateSlot::kMasterParam, StateSlot::kExpAvg, StateSlot::kExpAvgSq,
            StateSlot::kMaxExpAvgSq, StateSlot::kMomentScales};
  }

  static StateSlots slots_for(const AdamOptions& o) {
    const StateSlots moments{StateSlot::kExpAvg, StateSlot::kExpAvgSq};
    if (o.state_dtype() == at::kChar) {  // 8-bit codes and their block scales
      return moments.with(StateSlot::kMomentScales);
    }
    return o.amsgrad() ? moments.with(StateSlot::kMaxExpAvgSq) : moments;
  }

  static bool set_option(AdamOptions& o, const std::string& name, double v) {
    if (name == "beta1") {
      o.betas(std::make_tuple(v, std::get<1>(o.betas())));
    } else if (name == "beta2") {
      o.betas(std::make_tuple(std::get<0>(o.betas()), v));
    } else if (name == "eps") {
      o.eps(v);
    } else if (name == "decoupled_weight_decay") {
      o.decoupled_weight_decay(detail::flag_option(name, v));
    } else if (name == "amsgrad") {
      o.amsgrad(detail::flag_option(name, v));
    } else {
      return false;
    }
    return true;
  }

  static std::optional<double> option(const AdamOptions& o, const std::string& name) {
    if (name == "beta1") return std::get<0>(o.betas());
    if (name == "beta2") return std::get<1>(o.betas());
    if (name == "eps") return o.eps();
    if (name == "decoupled_weight_decay") return o.decoupled_weight_decay() ? 1.0 : 0.0;
    if (name == "amsgrad") return o.amsgrad() ? 1.0 : 0.0;
    return std::nullopt;
  }

  static void check(const AdamOptions& o, size_t group) {
    detail::check_adam_options(kName, std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(),
                               o.amsgrad(), o.state_dtype(), group);
  }

  static ops::AdamStep args(const detail::Bucket& b, const AdamOptions& o,
                            const ops::StepShared& in) {
    ops::AdamStep a;
    detail::fill_step(a, b, o, in);
    a.exp_avgs = b.state(StateSlot::kExpAvg);
    a.exp_avg_sqs = b.state(StateSlot::kExpAvgSq);
    if (o.amsgrad()) {
      a.max_exp_avg_sqs = b.state(StateSlot::kMaxExpAvgSq);
    }
    if (o.state_dtype() == at::kChar) {
      a.moment_scales = b.state(StateSlot::kMomentScales);
    }
    a.beta1 = std::get<0>(o.betas());
    a.beta2 = std::get<1>(o.betas());
    a.eps = o.eps();
    a.decoupled_weight_decay = o.decoupled_weight_decay();
    return a;
  }
};

template class OptimizerOf<AdamOptions>;

AdamW::AdamW(const std::vector<torch::optim::OptimizerParamGroup>& groups, AdamOptions defaults)
    : Adam(groups, defaults.decoupled_weight_decay(true)) {
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    group_options(i).decoupled_weight_decay(true);
  }
}

AdamW::AdamW(std::vector<at::Tensor> params, AdamOptions defaults)
    : AdamW({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

}  // namespace fusedamp::optim
