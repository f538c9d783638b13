#pragma once
// Argument validation shared by every backend (CPU, CUDA, Meta). Each check runs before a
// kernel touches memory, so a rejected call modifies nothing. Messages name the op and the
// argument so that the user can find the mistake.
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/OptionalArrayRef.h>
#include <optional>

namespace fusedamp {
struct StepAddresses;  // step_addresses.h
}

namespace fusedamp::checks {

struct TensorFacts;  // tensor_facts.h

using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;

// Returns whether some grads are for torch's per-tensor kernel (per_tensor_grad below).
bool unscale_and_check(const char* op, TensorList grads, const Tensor& found_inf,
                       const Tensor& inv_scale, const OptTensor& sum_sq,
                       const OptTensor& telemetry);

// A grad the fused kernels do not walk (they take FP32, FP16 and BF16 grads as one flat block):
// FP64, or strided but not dense. unscale_and_check_ leaves it to torch's own
// _amp_foreach_non_finite_check_and_unscale_ (as torch's op does itself), grad_stats_ to a few
// ATen ops. Only for grads that passed the checks.
bool per_tensor_grad(const Tensor& grad);

// Returns whether some grads are for the per-tensor path (per_tensor_grad below).
bool grad_stats(const char* op, TensorList grads, const Tensor& found_inf, const Tensor& sum_sq,
                const OptTensor& tensor_flags, const OptTensor& telemetry);

void update_scale(const char* op, const Tensor& scale, const Tensor& growth_tracker,
                  const Tensor& hysteresis_tracker, const Tensor& found_inf, double growth_factor,
                  double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                  std::optional<double> min_scale, std::optional<double> max_scale,
                  const OptTensor& amax, std::optional<double> amax_target,
                  const OptTensor& scale_history, int64_t scale_history_slot);

void record_telemetry(const char* op, const Tensor& ring, int64_t slot, const Tensor& scale,
                      const Tensor& found_inf, const Tensor& measured,
                      const OptTensor& pass_sum_sq);

void account_step(const char* op, const Tensor& step_applied, const Tensor& skipped_steps,
                  const OptTensor& found_inf, const OptTensor& found_inf_out,
                  const OptTensor& grad_sum_sq, const OptTensor& inv_scale,
                  const OptTensor& grad_norms, int64_t grad_norm_slot);

// The optional device scalars of a fused step.
void step_scalars(const char* op, const Tensor& like, const OptTensor& lr_tensor,
                  const OptTensor& inv_scale, const OptTensor& found_inf,
                  const OptTensor& grad_sum_sq, std::optional<double> max_grad_norm,
              c10::OptionalIntArrayRef rounding_seeds);

// Position i of a caller's kept rows (StepAddresses::state_taken), taken ahead of the step
// op's call by a caller that walks the params and grads right before it anyway (the engine's
// gradient walk): param and grad (the call's params[i] and grads[i], of dtype grad_dtype like
// every grad of the call) checked exactly as the call's own walk checks them (the same code,
// the same messages, naming `op`), and their addresses taken into held.rows[i]. False, with
// nothing raised, where the call must check everything itself (param's layout is not the
// recorded one). Once every row is taken, the caller sets held.rows_taken (see there).
bool take_held_row(const char* op, size_t i, const Tensor& param, const Tensor& grad,
                   c10::ScalarType grad_dtype, StepAddresses& held);

// take_held_row for a caller that has read param's and grad's facts itself (on the held
// device, with spans) and found them clean (tensor_facts.h clean_param_and_grad): what is
// left of the op's checks is the recorded dtype and layout. False, with nothing raised, where
// the call must check everything itself.
bool take_clean_row(size_t i, const TensorFacts& param, const TensorFacts& grad,
                    StepAddresses& held);

// The whole argument check of a fused step: lists, hyper-parameters and (when there are
// params) the device scalars. Returns false for empty lists (a no-op). With `addresses`, also
// fills it: one row of element addresses per list position, for the kernels.
bool adam_step(const char* op, TensorList params, TensorList master_params, TensorList grads,
               TensorList exp_avgs, TensorList exp_avg_sqs, TensorList max_exp_avg_sqs,
               TensorList steps, double lr,
               double beta1, double beta2, double eps, double weight_decay,
               const OptTensor& lr_tensor, const OptTensor& inv_scale,
               const OptTensor& found_inf, const OptTensor& grad_sum_sq,
               std::optional<double> max_grad_norm, c10::OptionalIntArrayRef rounding_seeds,
               StepAddresses* addresses = nullptr);

bool sgd_step(const char* op, TensorList params, TensorList master_params, TensorList grads,
              TensorList momentum_buffers, TensorList steps, double lr, double momentum,
              double dampening, double weight_decay, bool nesterov, const OptTensor& lr_tensor,
              const OptTensor& inv_scale, const OptTensor& found_inf,
              const OptTensor& grad_sum_sq, std::optional<double> max_grad_norm,
              c10::OptionalIntArrayRef rounding_seeds, StepAddresses* addresses = nullptr);

}  // namespace fusedamp::checks
