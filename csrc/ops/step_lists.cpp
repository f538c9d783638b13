// The Step of each step operator's arguments (step_lists.h).
#include "step_lists.h"

namespace fusedamp {
namespace {

// What adam_step_ and sgd_step_ share, from either declaration.
template <typename Hyper, typename Args>
Step<Hyper> common_step(const Args& a, const Hyper& hyper) {
  Step<Hyper> s{};
  s.op = Args::kName;
  s.params = a.params;
  s.master_params = a.master_params;
  s.grads = a.grads;
  s.steps = a.steps;
  s.hyper = hyper;
  s.lr = static_cast<float>(a.lr);
  s.shared = &a.shared;
  s.with_rounding_seeds = a.rounding_seeds.has_value();
  s.rounding_seeds = a.rounding_seeds.value_or(c10::IntArrayRef());
  return s;
}

}  // namespace

Step<math::AdamHyper> step_of(const ops::AdamStep& a) {
  auto s = common_step(a, math::make_adam_hyper(a.beta1, a.beta2, a.eps, a.weight_decay,
                                                a.decoupled_weight_decay, a.maximize));
  s.state.add("exp_avgs", a.exp_avgs);
  s.state.add("exp_avg_sqs", a.exp_avg_sqs);
  if (a.max_exp_avg_sqs.has_value() && !a.max_exp_avg_sqs->empty()) {  // AMSGrad
    s.state.add("max_exp_avg_sqs", *a.max_exp_avg_sqs);
  }
  s.block_scales = a.moment_scales.value_or(at::TensorList());
  s.block_scales_name = "moment_scales";
  return s;
}

Step<math::SgdHyper> step_of(const ops::SgdStep& a) {
  auto s = common_step(a, math::make_sgd_hyper(a.momentum, a.dampening, a.weight_decay,
                                               a.nesterov, a.maximize));
  if (a.momentum != 0.0) {
    s.state.add("momentum_buffers", a.momentum_buffers);
  }
  s.block_scales = a.momentum_scales.value_or(at::TensorList());
  s.block_scales_name = "momentum_scales";
  return s;
}

}  // namespace fusedamp
