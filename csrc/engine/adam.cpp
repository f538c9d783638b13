// fusedamp::optim::Adam / AdamW: options, their checks, and the fused adam_step_ per bucket.
#include <fusedamp/optim/adam.h>

#include <torch/serialize/archive.h>

#include <fusedamp/ops.h>

#include "bucket_plan.h"
#include "optimizer_of_impl.h"
#include "option_checks.h"
#include "step_call.h"

namespace fusedamp::optim {

AdamWOptions::AdamWOptions(double lr) : AdamOptions(lr) {
  weight_decay(1e-2);
  decoupled_weight_decay(true);
}

template <>
struct AlgorithmOf<AdamOptions> {
  static constexpr const char* kName = "Adam";

  // Its options beyond the shared ones (shared_options.h), as rows of option_table.h;
  // amsgrad is absent from older archives (off).
  static constexpr detail::OptionRow<AdamOptions> kOptions[] = {
      detail::beta_row<AdamOptions, 0>(),
      detail::beta_row<AdamOptions, 1>(),
      FUSEDAMP_OPTION_ROW(AdamOptions, eps, OptionForm::kNumber),
      FUSEDAMP_OPTION_ROW(AdamOptions, decoupled_weight_decay, OptionForm::kFlag),
      FUSEDAMP_OPTION_ROW(AdamOptions, amsgrad, OptionForm::kFlag, /*optional_in_archives=*/true),
  };

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

FUSEDAMP_OPTIONS_SERIALIZED_BY_TABLE(AdamOptions)
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
