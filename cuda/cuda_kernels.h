#pragma once
// Host-side entry points of the CUDA kernels (one .cu file per family of kernels). Arguments have
// been validated (ops/checks.h) and the device guard set by register_cuda.cpp before any of these
// is called. Everything is enqueued on the current stream; nothing waits for the device.
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <fusedamp/math/scale_math.h>
#include <fusedamp/ops.h>

#include <optional>

#include "../csrc/ops/static_switch.h"
#include "../csrc/ops/step_lists.h"

namespace fusedamp::kernels {
struct SparseRowsOp;  // ops/sparse_rows_args.h
}  // namespace fusedamp::kernels

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

// A step (ops/step_lists.h) with its scalars' device pointers, for every algorithm of ops.h's
// FUSEDAMP_STEP_ALGORITHMS: by its own kernel file (own: <algorithm>_kernel.cu) or by
// step_kernel.cu (generic). Each advances the step counts (advance_steps).
template <typename Algorithm>
void step(const Step<typename Algorithm::Hyper>& step, const StepScalarPointers& s);
#define FUSEDAMP_DECLARE_CUDA_STEP_KERNEL(Algorithm, Op, op, kernels) \
  template <>                                                        \
  void step<math::Algorithm>(const Step<math::Algorithm::Hyper>& step, \
                             const StepScalarPointers& s);
FUSEDAMP_STEP_ALGORITHMS(FUSEDAMP_DECLARE_CUDA_STEP_KERNEL)
#undef FUSEDAMP_DECLARE_CUDA_STEP_KERNEL
// sparse_rows_kernel.cu: a row-wise sparse step (the CPU's bits, math/sparse_rows_math.h);
// it advances the op's step count unless the step is skipped.
void sparse_rows_step(const kernels::SparseRowsOp& op);
// quantized_kernel.cu: the kernels for a quantized state (step.block_scales given): Adam's
// int8 exp_avgs and uint8 exp_avg_sqs, SGD's int8 momentum buffers; step<math::Adam> and
// step<math::Sgd> call them. They advance no step count.
void adam_quantized(const Step<math::AdamHyper>& step, const StepScalarPointers& s);
void sgd_quantized(const Step<math::SgdHyper>& step, const StepScalarPointers& s);

}  // namespace fusedamp::cuda
