#pragma once
// What every bucket's step op call has besides its algorithm's hyper-parameters, and how it
// goes into either step operator's declaration (fusedamp/ops.h).
#include <ATen/core/Tensor.h>

#include <optional>

#include "bucket_plan.h"

namespace fusedamp::optim::detail {

struct StepInputs {
  std::optional<at::Tensor> lr_tensor;    // the group's tensor lr, on the bucket's device
  std::optional<at::Tensor> inv_scale;    // 1 / loss scale
  std::optional<at::Tensor> found_inf;    // the step is skipped where it is not 0
  std::optional<at::Tensor> grad_sum_sq;  // of the statistics pass, for clipping
  std::optional<double> max_grad_norm;
  bool adopt_param_edits = true;
  bool write_back_grads = false;
};

// b's lists and `in` into Args (ops::AdamStep or ops::SgdStep); the caller adds its
// algorithm's hyper-parameters and state lists.
template <typename Args>
void fill_step(Args& a, const Bucket& b, const StepInputs& in) {
  a.params = b.params;
  a.master_params = b.state(StateSlot::kMasterParam);
  a.grads = b.grads;
  a.steps = b.steps;
  a.lr_tensor = in.lr_tensor;
  a.inv_scale = in.inv_scale;
  a.found_inf = in.found_inf;
  a.grad_sum_sq = in.grad_sum_sq;
  a.max_grad_norm = in.max_grad_norm;
  a.adopt_param_edits = in.adopt_param_edits;
  a.write_back_grads = in.write_back_grads;
  if (!b.rounding_seeds.empty()) {
    a.rounding_seeds = b.rounding_seeds;
  }
}

}  // namespace fusedamp::optim::detail
