#pragma once
// Host-side entry points of the CUDA kernels (one .cu file per kernel concept). Arguments have
// been validated (op_checks.h) and the device guard set by register_cuda.cu before any of these
// is called. Everything is enqueued on the current stream; nothing waits for the device.
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <fusedamp/math/adam_math.h>
#include <fusedamp/math/scale_math.h>
#include <fusedamp/math/sgd_math.h>

#include <optional>

#include "../csrc/static_switch.h"
#include "../csrc/step_scalars.h"

namespace fusedamp::cuda {

// unscale_kernels.cu
void unscale_and_check(at::TensorList grads, const at::Tensor& found_inf,
                       const at::Tensor& inv_scale, const std::optional<at::Tensor>& sum_sq,
                       const std::optional<at::Tensor>& telemetry);
void grad_stats(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& sum_sq,
                const std::optional<at::Tensor>& tensor_flags,
                const std::optional<at::Tensor>& telemetry);

// record_telemetry.cu (pass_sum_sq: nullptr where absent)
void record_telemetry(const at::Tensor& ring, int64_t slot, const at::Tensor& scale,
                      const at::Tensor& found_inf, const at::Tensor& measured,
                      const at::Tensor* pass_sum_sq);

// account_step.cu (the optional tensors: nullptr where absent)
void account_step(const at::Tensor& step_applied, const at::Tensor& skipped_steps,
                  const at::Tensor* found_inf, const at::Tensor* found_inf_out,
                  const at::Tensor* grad_sum_sq, const at::Tensor* inv_scale,
                  const at::Tensor* grad_norms, int64_t grad_norm_slot);

// update_scale.cu
void update_scale(const at::Tensor& scale, const at::Tensor& growth_tracker,
                  const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                  const std::optional<at::Tensor>& amax, const math::ScaleHyper& h,
                  const at::Tensor* scale_history, int64_t scale_history_slot);

// adam_kernel.cu
// max_exp_avg_sqs: empty without AMSGrad. store: how the weights are kept (master_params and
// rounding_seeds as that store needs them).
void adam(at::TensorList params, at::TensorList master_params, at::TensorList grads,
          at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
          at::TensorList steps, c10::IntArrayRef rounding_seeds, const math::AdamHyper& h,
          const StepScalarPointers& s, WeightStore store, bool write_back_grads);

// sgd_kernel.cu
void sgd(at::TensorList params, at::TensorList master_params, at::TensorList grads,
         at::TensorList momentum_buffers, at::TensorList steps, const math::SgdHyper& h,
         c10::IntArrayRef rounding_seeds, const StepScalarPointers& s, WeightStore store,
         bool write_back_grads);

// step_count.cu: steps[i] += 1 for every i, unless *found_inf != 0 (found_inf may be nullptr).
void advance_steps(at::TensorList steps, const float* found_inf);

}  // namespace fusedamp::cuda
