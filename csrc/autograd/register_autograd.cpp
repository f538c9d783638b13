// The Autograd and ADInplaceOrView kernels of fusedamp's operators: what torch's own in-place
// ops have, written out unboxed (without them every call took torch's boxed autograd fallback,
// which boxes each tensor list into IValues: most of an op's host time with many tensors).
//
//   Autograd          the ops update optimizer state in place and are not differentiable: a
//                     mutated tensor that requires grad is refused while grad mode is on (as
//                     torch refuses an in-place op on a leaf that requires grad); then below.
//   ADInplaceOrView   below, then every mutated tensor's version counter is bumped, as for any
//                     in-place op, so autograd notices a parameter changed after it was saved
//                     for backward (e.g. a step between forward and backward).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <initializer_list>
#include <iterator>
#include <optional>

#include "../op_handles.h"

namespace fusedamp::autograd {
namespace {

using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;

// One mutated argument: a list or a single tensor.
struct Mutated {
  TensorList list;
  const Tensor* single = nullptr;
  Mutated(TensorList l) : list(l) {}  // NOLINT(google-explicit-constructor)
  Mutated(const Tensor& t) : single(&t) {}  // NOLINT(google-explicit-constructor)
  template <typename F>
  void each(const F& f) const {
    if (single != nullptr) {
      f(*single);
    }
    for (const auto& t : list) {
      f(t);
    }
  }
};

// The ops' typed handles (op_handles.h), by short names for the kernels below.
namespace names = op_handles::names;  // each op's name, for the refusals' messages
const auto& unscale_op = op_handles::unscale_and_check;
const auto& stats_op = op_handles::grad_stats;
const auto& scale_op = op_handles::update_scale;
const auto& telemetry_op = op_handles::record_telemetry;
const auto& account_op = op_handles::account_step;
const auto& adam_op = op_handles::adam_step;
const auto& sgd_op = op_handles::sgd_step;

void refuse_in_grad_mode(const char* op, std::initializer_list<Mutated> mutated) {
  if (!c10::GradMode::is_enabled()) {
    return;
  }
  for (const auto& m : mutated) {
    m.each([&](const Tensor& t) {
      TORCH_CHECK(!t.defined() || !t.requires_grad(), op,
                  ": updates tensors in place and is not differentiable, but a tensor it "
                  "modifies requires grad; call it under torch.no_grad() (as an optimizer "
                  "step runs)");
    });
  }
}

void bump_versions(std::initializer_list<Mutated> mutated) {
  for (const auto& m : mutated) {
    m.each([](const Tensor& t) {
      if (t.defined()) {
        torch::autograd::impl::bump_version(t);
      }
    });
  }
}

// ---- unscale_and_check_ --------------------------------------------------------------------
// The optional outputs a statistics pass writes (grad_stats_'s and unscale_and_check_'s).
void refuse_optional_in_grad_mode(const char* op, const OptTensor& a, const OptTensor& b) {
  for (const OptTensor* written : {&a, &b}) {
    if (*written && (*written)->defined()) {
      refuse_in_grad_mode(op, {**written});
    }
  }
}

void bump_optional(const OptTensor& a, const OptTensor& b) {
  for (const OptTensor* written : {&a, &b}) {
    if (*written && (*written)->defined()) {
      bump_versions({**written});
    }
  }
}

void unscale_autograd(c10::DispatchKeySet ks, TensorList grads, const Tensor& found_inf,
                      const Tensor& inv_scale, const OptTensor& sum_sq,
                      const OptTensor& telemetry) {
  refuse_in_grad_mode(names::kUnscaleAndCheck, {grads, found_inf});
  refuse_optional_in_grad_mode(names::kUnscaleAndCheck, sum_sq, telemetry);
  unscale_op().redispatch(ks & c10::after_autograd_keyset, grads, found_inf, inv_scale, sum_sq,
                          telemetry);
}

void unscale_view(c10::DispatchKeySet ks, TensorList grads, const Tensor& found_inf,
                  const Tensor& inv_scale, const OptTensor& sum_sq, const OptTensor& telemetry) {
  unscale_op().redispatch(ks & c10::after_ADInplaceOrView_keyset, grads, found_inf, inv_scale,
                          sum_sq, telemetry);
  bump_versions({grads, found_inf});
  bump_optional(sum_sq, telemetry);
}

// ---- grad_stats_ ---------------------------------------------------------------------------
void stats_autograd(c10::DispatchKeySet ks, TensorList grads, const Tensor& found_inf,
                    const Tensor& sum_sq, const OptTensor& flags, const OptTensor& telemetry) {
  refuse_in_grad_mode(names::kGradStats, {found_inf, sum_sq});
  refuse_optional_in_grad_mode(names::kGradStats, telemetry, std::nullopt);
  stats_op().redispatch(ks & c10::after_autograd_keyset, grads, found_inf, sum_sq, flags,
                        telemetry);
}

void stats_view(c10::DispatchKeySet ks, TensorList grads, const Tensor& found_inf,
                const Tensor& sum_sq, const OptTensor& flags, const OptTensor& telemetry) {
  stats_op().redispatch(ks & c10::after_ADInplaceOrView_keyset, grads, found_inf, sum_sq, flags,
                        telemetry);
  bump_versions({found_inf, sum_sq});
  bump_optional(flags, telemetry);
}

// ---- update_scale_ -------------------------------------------------------------------------
void scale_autograd(c10::DispatchKeySet ks, const Tensor& scale, const Tensor& growth,
                    const Tensor& hysteresis, const Tensor& found_inf, double growth_factor,
                    double backoff_factor, int64_t interval, int64_t hysteresis_steps,
                    std::optional<double> min_scale, std::optional<double> max_scale,
                    const OptTensor& amax, std::optional<double> amax_target,
                    const OptTensor& history, int64_t history_slot) {
  refuse_in_grad_mode(names::kUpdateScale, {scale, growth, hysteresis});
  refuse_optional_in_grad_mode(names::kUpdateScale, history, std::nullopt);
  scale_op().redispatch(ks & c10::after_autograd_keyset, scale, growth, hysteresis, found_inf,
                        growth_factor, backoff_factor, interval, hysteresis_steps, min_scale,
                        max_scale, amax, amax_target, history, history_slot);
}

void scale_view(c10::DispatchKeySet ks, const Tensor& scale, const Tensor& growth,
                const Tensor& hysteresis, const Tensor& found_inf, double growth_factor,
                double backoff_factor, int64_t interval, int64_t hysteresis_steps,
                std::optional<double> min_scale, std::optional<double> max_scale,
                const OptTensor& amax, std::optional<double> amax_target,
                const OptTensor& history, int64_t history_slot) {
  scale_op().redispatch(ks & c10::after_ADInplaceOrView_keyset, scale, growth, hysteresis,
                        found_inf, growth_factor, backoff_factor, interval, hysteresis_steps,
                        min_scale, max_scale, amax, amax_target, history, history_slot);
  bump_versions({scale, growth, hysteresis});
  bump_optional(history, std::nullopt);
}

// ---- record_telemetry_ ---------------------------------------------------------------------
void telemetry_autograd(c10::DispatchKeySet ks, const Tensor& ring, int64_t slot,
                        const Tensor& scale, const Tensor& found_inf, const Tensor& measured,
                        const OptTensor& pass_sum_sq) {
  refuse_in_grad_mode(names::kRecordTelemetry, {ring});
  telemetry_op().redispatch(ks & c10::after_autograd_keyset, ring, slot, scale, found_inf,
                            measured, pass_sum_sq);
}

void telemetry_view(c10::DispatchKeySet ks, const Tensor& ring, int64_t slot,
                    const Tensor& scale, const Tensor& found_inf, const Tensor& measured,
                    const OptTensor& pass_sum_sq) {
  telemetry_op().redispatch(ks & c10::after_ADInplaceOrView_keyset, ring, slot, scale,
                            found_inf, measured, pass_sum_sq);
  bump_versions({ring});
}

// ---- account_step_ -------------------------------------------------------------------------
void account_autograd(c10::DispatchKeySet ks, const Tensor& applied, const Tensor& skipped,
                      const OptTensor& found_inf, const OptTensor& found_inf_out,
                      const OptTensor& sum_sq, const OptTensor& inv_scale,
                      const OptTensor& norms, int64_t slot) {
  refuse_in_grad_mode(names::kAccountStep, {applied, skipped});
  refuse_optional_in_grad_mode(names::kAccountStep, found_inf_out, norms);
  account_op().redispatch(ks & c10::after_autograd_keyset, applied, skipped, found_inf,
                          found_inf_out, sum_sq, inv_scale, norms, slot);
}

void account_view(c10::DispatchKeySet ks, const Tensor& applied, const Tensor& skipped,
                  const OptTensor& found_inf, const OptTensor& found_inf_out,
                  const OptTensor& sum_sq, const OptTensor& inv_scale, const OptTensor& norms,
                  int64_t slot) {
  account_op().redispatch(ks & c10::after_ADInplaceOrView_keyset, applied, skipped, found_inf,
                          found_inf_out, sum_sq, inv_scale, norms, slot);
  bump_versions({applied, skipped});
  bump_optional(found_inf_out, norms);
}

// ---- adam_step_ ----------------------------------------------------------------------------
void adam_autograd(c10::DispatchKeySet ks, TensorList params, TensorList masters,
                   TensorList grads, TensorList exp_avgs, TensorList exp_avg_sqs,
                   TensorList steps, double lr, double beta1, double beta2, double eps,
                   double weight_decay, bool decoupled, bool maximize, const OptTensor& lr_t,
                   const OptTensor& inv_scale, const OptTensor& found_inf,
                   const OptTensor& sum_sq, std::optional<double> max_norm, bool adopt_edits,
                   bool write_grads, std::optional<TensorList> v_maxes,
                   c10::OptionalIntArrayRef seeds) {
  refuse_in_grad_mode(names::kAdamStep, {params, masters, exp_avgs, exp_avg_sqs, steps,
                                         write_grads ? grads : TensorList(),
                                         v_maxes.value_or(TensorList())});
  adam_op().redispatch(ks & c10::after_autograd_keyset, params, masters, grads, exp_avgs,
                       exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay, decoupled,
                       maximize, lr_t, inv_scale, found_inf, sum_sq, max_norm, adopt_edits,
                       write_grads, v_maxes, seeds);
}

void adam_view(c10::DispatchKeySet ks, TensorList params, TensorList masters, TensorList grads,
               TensorList exp_avgs, TensorList exp_avg_sqs, TensorList steps, double lr,
               double beta1, double beta2, double eps, double weight_decay, bool decoupled,
               bool maximize, const OptTensor& lr_t, const OptTensor& inv_scale,
               const OptTensor& found_inf, const OptTensor& sum_sq,
               std::optional<double> max_norm, bool adopt_edits, bool write_grads,
               std::optional<TensorList> v_maxes, c10::OptionalIntArrayRef seeds) {
  adam_op().redispatch(ks & c10::after_ADInplaceOrView_keyset, params, masters, grads, exp_avgs,
                       exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay, decoupled,
                       maximize, lr_t, inv_scale, found_inf, sum_sq, max_norm, adopt_edits,
                       write_grads, v_maxes, seeds);
  bump_versions({params, masters, exp_avgs, exp_avg_sqs, steps,
                 write_grads ? grads : TensorList(), v_maxes.value_or(TensorList())});
}

// ---- sgd_step_ -----------------------------------------------------------------------------
void sgd_autograd(c10::DispatchKeySet ks, TensorList params, TensorList masters, TensorList grads,
                  TensorList bufs, TensorList steps, double lr, double momentum,
                  double dampening, double weight_decay, bool nesterov, bool maximize,
                  const OptTensor& lr_t, const OptTensor& inv_scale, const OptTensor& found_inf,
                  const OptTensor& sum_sq, std::optional<double> max_norm, bool adopt_edits,
                  bool write_grads, c10::OptionalIntArrayRef seeds) {
  refuse_in_grad_mode(names::kSgdStep,
                      {params, masters, bufs, steps, write_grads ? grads : TensorList()});
  sgd_op().redispatch(ks & c10::after_autograd_keyset, params, masters, grads, bufs, steps, lr,
                      momentum, dampening, weight_decay, nesterov, maximize, lr_t, inv_scale,
                      found_inf, sum_sq, max_norm, adopt_edits, write_grads, seeds);
}

void sgd_view(c10::DispatchKeySet ks, TensorList params, TensorList masters, TensorList grads,
              TensorList bufs, TensorList steps, double lr, double momentum, double dampening,
              double weight_decay, bool nesterov, bool maximize, const OptTensor& lr_t,
              const OptTensor& inv_scale, const OptTensor& found_inf, const OptTensor& sum_sq,
              std::optional<double> max_norm, bool adopt_edits, bool write_grads,
              c10::OptionalIntArrayRef seeds) {
  sgd_op().redispatch(ks & c10::after_ADInplaceOrView_keyset, params, masters, grads, bufs,
                      steps, lr, momentum, dampening, weight_decay, nesterov, maximize, lr_t,
                      inv_scale, found_inf, sum_sq, max_norm, adopt_edits, write_grads, seeds);
  bump_versions({params, masters, bufs, steps, write_grads ? grads : TensorList()});
}

// One kernel per op, in the order of schemas.cpp, for one dispatch key.
template <typename... Kernels>
void impl_all(torch::Library& m, Kernels... kernels) {
  static constexpr const char* kOps[] = {"unscale_and_check_", "grad_stats_", "update_scale_",
                                         "record_telemetry_", "account_step_", "adam_step_",
                                         "sgd_step_"};
  static_assert(sizeof...(Kernels) == std::size(kOps), "one kernel per op");
  size_t i = 0;
  (m.impl(kOps[i++], kernels), ...);
}

}  // namespace
}  // namespace fusedamp::autograd

TORCH_LIBRARY_IMPL(fusedamp, Autograd, m) {
  using namespace fusedamp::autograd;
  impl_all(m, &unscale_autograd, &stats_autograd, &scale_autograd, &telemetry_autograd,
           &account_autograd, &adam_autograd, &sgd_autograd);
}

TORCH_LIBRARY_IMPL(fusedamp, ADInplaceOrView, m) {
  using namespace fusedamp::autograd;
  impl_all(m, &unscale_view, &stats_view, &scale_view, &telemetry_view, &account_view,
           &adam_view, &sgd_view);
}
