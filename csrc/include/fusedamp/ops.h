#pragma once
// Typed C++ entry points for the fusedamp operators. Each call goes through the dispatcher,
// so CPU, CUDA and Meta tensors reach their own kernel, exactly as from Python
// (torch.ops.fusedamp.*). Semantics are documented with the schemas (csrc/schemas.cpp) and
// in README.md.
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <optional>

namespace fusedamp::ops {

using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;

void unscale_and_check_(TensorList grads, const Tensor& found_inf, const Tensor& inv_scale,
                        const OptTensor& sum_sq = std::nullopt,
                        const OptTensor& telemetry = std::nullopt);

void grad_stats_(
    TensorList grads, const Tensor& found_inf, const Tensor& sum_sq,
    const OptTensor& tensor_flags = std::nullopt, const OptTensor& telemetry = std::nullopt);

void update_scale_(
    const Tensor& scale, const Tensor& growth_tracker, const Tensor& hysteresis_tracker,
    const Tensor& found_inf, double growth_factor, double backoff_factor, int64_t growth_interval,
    int64_t hysteresis = 1, std::optional<double> min_scale = std::nullopt,
    std::optional<double> max_scale = std::nullopt, const OptTensor& amax = std::nullopt,
    std::optional<double> amax_target = std::nullopt,
    const OptTensor& scale_history = std::nullopt, int64_t scale_history_slot = 0);

// A loss scaler's telemetry record of one iteration into row `slot` of its ring (schemas.cpp,
// math/telemetry_math.h's columns), in one kernel.
void record_telemetry_(const Tensor& ring, int64_t slot, const Tensor& scale,
                       const Tensor& found_inf, const Tensor& measured,
                       const OptTensor& pass_sum_sq = std::nullopt);

// What a master-weight optimizer records after a step, in one kernel (schemas.cpp): from the
// step's found_inf, whether it was applied (step_applied) and the skipped-step count, the loss
// scaler's copy of the flag (found_inf_out); with grad_norms, the unscaled global gradient norm
// into grad_norms[grad_norm_slot].
void account_step_(const Tensor& step_applied, const Tensor& skipped_steps,
                   const OptTensor& found_inf = std::nullopt,
                   const OptTensor& found_inf_out = std::nullopt,
                   const OptTensor& grad_sum_sq = std::nullopt,
                   const OptTensor& inv_scale = std::nullopt,
                   const OptTensor& grad_norms = std::nullopt, int64_t grad_norm_slot = 0);

// The device-side scalars a fused step reads. All optional; each is a 1-element FP32 tensor on
// the parameters' device.
struct StepScalars {
  OptTensor lr_tensor;    // overrides the numeric lr
  OptTensor inv_scale;    // 1 / loss scale
  OptTensor found_inf;    // skip the whole step when != 0
  OptTensor grad_sum_sq;  // from grad_stats_, for clipping
  std::optional<double> max_grad_norm;
};

// What a step does besides updating params and state (both are flags of the step ops).
struct StepModes {
  // Masters follow edits of the model: where params[i] is no longer the rounding of
  // master_params[i] (a loaded snapshot, a clamp, a pruning mask, an EMA swap), the master
  // takes the param's value before the update. Costs a read of params (2 B/param at FP16).
  bool adopt_param_edits = true;
  // grads[i] receive the gradient the update used (times inv_scale and the clip coefficient),
  // as torch's fused optimizers leave .grad. Costs a write of grads (2 B/param at FP16).
  bool write_back_grads = false;
  // Stochastic rounding of BF16 params (no master_params): one seed per tensor; the random
  // bits are a function of (seed, step count, element index). Empty: round to nearest.
  c10::IntArrayRef rounding_seeds;
};

struct AdamArgs {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled_weight_decay = true;
  bool maximize = false;
};

// master_params: empty (no master), FP32 masters, int16 remainders beside BF16 params
// ("split"), or compensations of the params' dtype ("kahan"); see csrc/schemas.cpp.
void adam_step_(
    TensorList params, TensorList master_params, TensorList grads, TensorList exp_avgs,
    TensorList exp_avg_sqs, TensorList steps, const AdamArgs& args,
    const StepScalars& scalars = {}, const StepModes& modes = {},
    TensorList max_exp_avg_sqs = {});  // AMSGrad's running maxima; empty: plain Adam

struct SgdArgs {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
};

void sgd_step_(
    TensorList params, TensorList master_params, TensorList grads, TensorList momentum_buffers,
    TensorList steps, const SgdArgs& args, const StepScalars& scalars = {},
    const StepModes& modes = {});

}  // namespace fusedamp::ops
