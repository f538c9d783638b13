#pragma once
// Host-side entry points of the CUDA kernels (one .cu file per family of kernels). Arguments have
// been validated (ops/checks.h) and the device guard set by register_cuda.cpp before any of these
// is called. Everything is enqueued on the current stream; nothing waits for the device.
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <fusedamp/math/adam_math.h>
#include <fusedamp/math/scale_math.h>
#include <fusedamp/math/sgd_math.h>
#include <fusedamp/ops.h>

#include <optional>

#include "../csrc/ops/static_switch.h"
#include "../csrc/ops/step_lists.h"

namespace fusedamp::cuda {

// The elements of an optional tensor argument a kernel reads, or nullptr where it is absent.
template <typename T>
const T* input_or_null(const std::optional<at::Tensor>& t) {
  return t && t->defined() ? t->const_data_ptr<T>() : nullptr;
}

// The same for an argument a kernel writes.
template <typename T>
T* output_or_null(const std::optional<at::Tensor>& t) {
  return t && t->defined() ? t->data_ptr<T>() : nullptr;
}

// unscale_kernels.cu
void unscale_and_check(at::TensorList grads, const at::Tensor& found_inf,
                       const at::Tensor& inv_scale, const std::optional<at::Tensor>& sum_sq,
                       const std::optional<at::Tensor>& telemetry);
void grad_stats(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& sum_sq,
                const std::optional<at::Tensor>& tensor_flags,
                const std::optional<at::Tensor>& telemetry);

// bookkeeping.cu: the one-thread kernels of the telemetry row, the step account and the loss
// scale; and the per-tensor step counts: steps[i] += 1 for every i, unless *found_inf != 0
// (found_inf may be nullptr).
void record_telemetry(const ops::RecordTelemetry& op);
void account_step(const ops::AccountStep& op);
void update_scale(const ops::UpdateScale& op, const math::ScaleHyper& h);
void advance_steps(at::TensorList steps, const float* found_inf);

// adam_kernel.cu, sgd_kernel.cu: a step (ops/step_lists.h) with its scalars' device pointers.
void adam(const Step<math::AdamHyper>& step, const StepScalarPointers& s);
void sgd(const Step<math::SgdHyper>& step, const StepScalarPointers& s);
// quantized_kernel.cu: the kernels for a quantized state (step.block_scales given): Adam's
// int8 exp_avgs and uint8 exp_avg_sqs, SGD's int8 momentum buffers; adam() and sgd() call
// them. They advance no step count.
void adam_quantized(const Step<math::AdamHyper>& step, const StepScalarPointers& s);
void sgd_quantized(const Step<math::SgdHyper>& step, const StepScalarPointers& s);

}  // namespace fusedamp::cuda
