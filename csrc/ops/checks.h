#pragma once
// Argument validation shared by every backend (CPU, CUDA, Meta). Each check runs before a
// kernel touches memory, so a rejected call modifies nothing. Messages name the op and the
// argument so that the user can find the mistake.
#include <ATen/core/Tensor.h>
#include <fusedamp/ops.h>

#include "step_lists.h"

namespace fusedamp::checks {

// Each returns whether some grads are for the per-tensor path (per_tensor_grad below).
bool unscale_and_check(const ops::UnscaleAndCheck& a);
bool grad_stats(const ops::GradStats& a);

// A grad the fused kernels do not walk (they take FP32, FP16 and BF16 grads as one flat block):
// FP64, or strided but not dense. unscale_and_check_ leaves it to torch's own
// _amp_foreach_non_finite_check_and_unscale_ (as torch's op does itself), grad_stats_ to a few
// ATen ops. Only for grads that passed the checks.
bool per_tensor_grad(const at::Tensor& grad);

void update_scale(const ops::UpdateScale& a);
void record_telemetry(const ops::RecordTelemetry& a);
void account_step(const ops::AccountStep& a);

// The whole argument check of a fused step (its declaration's hyper-parameters, then `step`,
// derived from it: lists and, when there are params, the device scalars). Returns false for
// empty lists (a no-op). With step.rows, also fills them: one row of element addresses per
// list position, for the kernels.
bool adam_step(const ops::AdamStep& a, Step<math::AdamHyper>& step);
bool sgd_step(const ops::SgdStep& a, Step<math::SgdHyper>& step);

}  // namespace fusedamp::checks
