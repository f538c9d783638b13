// fusedamp::ops::* — typed calls into the dispatcher (see include/fusedamp/ops.h).
#include <fusedamp/ops.h>

#include <ATen/record_function.h>

#include "op_calls.h"
#include "op_handles.h"

namespace fusedamp::ops {

void unscale_and_check_(TensorList grads, const Tensor& found_inf, const Tensor& inv_scale,
                        const OptTensor& sum_sq, const OptTensor& telemetry) {
  op_handles::unscale_and_check().call(grads, found_inf, inv_scale, sum_sq, telemetry);
}

void grad_stats_(
    TensorList grads, const Tensor& found_inf, const Tensor& sum_sq,
    const OptTensor& tensor_flags, const OptTensor& telemetry) {
  op_handles::grad_stats().call(grads, found_inf, sum_sq, tensor_flags, telemetry);
}

void update_scale_(
    const Tensor& scale, const Tensor& growth_tracker, const Tensor& hysteresis_tracker,
    const Tensor& found_inf, double growth_factor, double backoff_factor, int64_t growth_interval,
    int64_t hysteresis, std::optional<double> min_scale, std::optional<double> max_scale,
    const OptTensor& amax, std::optional<double> amax_target, const OptTensor& scale_history,
    int64_t scale_history_slot) {
  op_handles::update_scale().call(
      scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
      growth_interval, hysteresis, min_scale, max_scale, amax, amax_target, scale_history,
      scale_history_slot);
}

void record_telemetry_(const Tensor& ring, int64_t slot, const Tensor& scale,
                       const Tensor& found_inf, const Tensor& measured,
                       const OptTensor& pass_sum_sq) {
  op_handles::record_telemetry().call(ring, slot, scale, found_inf, measured, pass_sum_sq);
}

void account_step_(const Tensor& step_applied, const Tensor& skipped_steps,
                   const OptTensor& found_inf, const OptTensor& found_inf_out,
                   const OptTensor& grad_sum_sq, const OptTensor& inv_scale,
                   const OptTensor& grad_norms, int64_t grad_norm_slot) {
  op_handles::account_step().call(step_applied, skipped_steps, found_inf, found_inf_out,
                                   grad_sum_sq, inv_scale, grad_norms, grad_norm_slot);
}

namespace {

// A step op's arguments from fusedamp's structs, handed to `invoke`: the dispatcher's call, or
// a redispatch straight to a known kernel (detail::*_step_to).
template <typename Invoke>
void adam_arguments(const Invoke& invoke, TensorList params, TensorList master_params,
                    TensorList grads, TensorList exp_avgs, TensorList exp_avg_sqs,
                    TensorList steps, const AdamArgs& a, const StepScalars& s,
                    const StepModes& modes, TensorList max_exp_avg_sqs) {
  invoke(params, master_params, grads, exp_avgs, exp_avg_sqs, steps, a.lr, a.beta1, a.beta2,
         a.eps, a.weight_decay, a.decoupled_weight_decay, a.maximize, s.lr_tensor, s.inv_scale,
         s.found_inf, s.grad_sum_sq, s.max_grad_norm, modes.adopt_param_edits,
         modes.write_back_grads,
         max_exp_avg_sqs.empty() ? std::nullopt : std::optional<TensorList>(max_exp_avg_sqs),
         modes.rounding_seeds.empty() ? c10::OptionalIntArrayRef()
                                      : c10::OptionalIntArrayRef(modes.rounding_seeds));
}

template <typename Invoke>
void sgd_arguments(const Invoke& invoke, TensorList params, TensorList master_params,
                   TensorList grads, TensorList momentum_buffers, TensorList steps,
                   const SgdArgs& a, const StepScalars& s, const StepModes& modes) {
  invoke(params, master_params, grads, momentum_buffers, steps, a.lr, a.momentum, a.dampening,
         a.weight_decay, a.nesterov, a.maximize, s.lr_tensor, s.inv_scale, s.found_inf,
         s.grad_sum_sq, s.max_grad_norm, modes.adopt_param_edits, modes.write_back_grads,
         modes.rounding_seeds.empty() ? c10::OptionalIntArrayRef()
                                      : c10::OptionalIntArrayRef(modes.rounding_seeds));
}

// The dispatcher's call, or (with `keys`) a redispatch to their kernel. A redispatch records
// no profiler event of its own: the call's name is recorded here, as the dispatcher would.
template <typename Signature>
auto invoker(const c10::TypedOperatorHandle<Signature>& op, const char* name,
             std::optional<c10::DispatchKeySet> keys) {
  return [&op, name, keys](auto&&... args) {
    if (!keys) {
      op.call(args...);
      return;
    }
    RECORD_FUNCTION(name, std::vector<c10::IValue>());
    op.redispatch(*keys, args...);
  };
}

}  // namespace

void adam_step_(
    TensorList params, TensorList master_params, TensorList grads, TensorList exp_avgs,
    TensorList exp_avg_sqs, TensorList steps, const AdamArgs& a, const StepScalars& s,
    const StepModes& modes, TensorList max_exp_avg_sqs) {
  detail::adam_step_to(std::nullopt, params, master_params, grads, exp_avgs, exp_avg_sqs, steps,
                       a, s, modes, max_exp_avg_sqs);
}

void sgd_step_(
    TensorList params, TensorList master_params, TensorList grads, TensorList momentum_buffers,
    TensorList steps, const SgdArgs& a, const StepScalars& s, const StepModes& modes) {
  detail::sgd_step_to(std::nullopt, params, master_params, grads, momentum_buffers, steps, a, s,
                      modes);
}

namespace detail {

void adam_step_to(std::optional<c10::DispatchKeySet> keys, TensorList params,
                  TensorList master_params, TensorList grads, TensorList exp_avgs,
                  TensorList exp_avg_sqs, TensorList steps, const AdamArgs& a,
                  const StepScalars& s, const StepModes& modes, TensorList max_exp_avg_sqs) {
  adam_arguments(invoker(op_handles::adam_step(), op_handles::names::kAdamStep, keys), params,
                 master_params, grads, exp_avgs, exp_avg_sqs, steps, a, s, modes,
                 max_exp_avg_sqs);
}

void sgd_step_to(std::optional<c10::DispatchKeySet> keys, TensorList params,
                 TensorList master_params, TensorList grads, TensorList momentum_buffers,
                 TensorList steps, const SgdArgs& a, const StepScalars& s,
                 const StepModes& modes) {
  sgd_arguments(invoker(op_handles::sgd_step(), op_handles::names::kSgdStep, keys), params,
                master_params, grads, momentum_buffers, steps, a, s, modes);
}

}  // namespace detail

}  // namespace fusedamp::ops

namespace fusedamp::detail {
int link_anchor() {
  return 1;
}
}  // namespace fusedamp::detail
