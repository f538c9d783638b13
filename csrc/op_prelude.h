#pragma once
// The start of every fusedamp op, written once for all backends (CPU, CUDA, Meta and the
// fallback): for each op (its C++ signature is op_handles.h's, checked at registration) what
// every backend does first: check all arguments (op_checks.h, before anything is touched) and
// gather them into one struct; for the step ops that includes the math hyper-parameters and
// which optional device scalars were given. A backend is a struct of seven static functions,
// one per op, that take those structs; implement_ops<Backend>(m) registers them.
//
// What a backend does with a step's device scalars is its own: the CPU reads them on the host
// (its tensors are plain memory), CUDA passes their pointers to its kernels (no value reaches
// the host), the Meta kernels only check.
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <fusedamp/math/adam_math.h>
#include <fusedamp/math/scale_math.h>
#include <fusedamp/math/sgd_math.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "op_checks.h"
#include "op_handles.h"
#include "static_switch.h"
#include "step_addresses.h"
#include "step_scalars.h"

namespace fusedamp::prelude {

using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;

// ---- the loss scaler's ops ---------------------------------------------------------------

struct UnscaleAndCheck {
  static constexpr const char* kOp = op_handles::names::kUnscaleAndCheck;
  TensorList grads;
  const Tensor& found_inf;
  const Tensor& inv_scale;
  const OptTensor& sum_sq;     // given: grad_stats_'s sum of squares too (before unscaling)
  const OptTensor& telemetry;  // given (only with sum_sq): grad_stats_'s telemetry too
};

struct GradStats {
  static constexpr const char* kOp = op_handles::names::kGradStats;
  TensorList grads;
  const Tensor& found_inf;
  const Tensor& sum_sq;
  const OptTensor& tensor_flags;
  const OptTensor& telemetry;  // FP64[4] (math::TelemetrySlot) or absent
};

struct UpdateScale {
  static constexpr const char* kOp = op_handles::names::kUpdateScale;
  const Tensor& scale;
  const Tensor& growth_tracker;
  const Tensor& hysteresis_tracker;
  const Tensor& found_inf;
  double growth_factor;
  double backoff_factor;
  int64_t growth_interval;
  int64_t hysteresis;
  std::optional<double> min_scale;
  std::optional<double> max_scale;
  const OptTensor& amax;  // FP64[1]; given (and read) only with amax_target
  std::optional<double> amax_target;
  const Tensor* scale_history;  // FP32 ring, or nullptr
  int64_t scale_history_slot;

  math::ScaleHyper hyper() const {
    math::ScaleHyper h;
    h.growth_factor = growth_factor;
    h.backoff_factor = backoff_factor;
    h.growth_interval = static_cast<int32_t>(growth_interval);
    h.hysteresis = static_cast<int32_t>(hysteresis);
    h.min_scale = static_cast<float>(min_scale.value_or(0.0));
    h.max_scale = static_cast<float>(max_scale.value_or(0.0));
    h.amax_target = amax_target.value_or(0.0);
    return h;
  }
};

struct RecordTelemetry {
  static constexpr const char* kOp = op_handles::names::kRecordTelemetry;
  const Tensor& ring;
  int64_t slot;
  const Tensor& scale;
  const Tensor& found_inf;
  const Tensor& measured;
  const Tensor* pass_sum_sq;  // nullptr where absent
};

// ---- after a step ----------------------------------------------------------------------------

struct AccountStep {
  static constexpr const char* kOp = op_handles::names::kAccountStep;
  const Tensor& step_applied;
  const Tensor& skipped_steps;
  const Tensor* found_inf;      // nullptr: an unchecked step
  const Tensor* found_inf_out;  // nullptr where absent (given only with found_inf)
  const Tensor* grad_sum_sq;    // given with grad_norms
  const Tensor* inv_scale;      // nullptr: the norm is not scaled
  const Tensor* grad_norms;     // nullptr: no norm recorded
  int64_t grad_norm_slot;
};

// ---- the step ops ------------------------------------------------------------------------

// A step's optional device scalars as the op received them (checked: each a one-element FP32
// tensor on the params' device; nullptr where absent), and the host values that go with them.
struct ScalarArgs {
  const Tensor* lr_tensor = nullptr;  // overrides lr
  const Tensor* inv_scale = nullptr;
  const Tensor* found_inf = nullptr;
  const Tensor* grad_sum_sq = nullptr;
  float lr = 0.f;
  float max_grad_norm = 0.f;  // <= 0: no clipping

  ScalarArgs(double lr_value, const OptTensor& lr_tensor_arg, const OptTensor& inv_scale_arg,
             const OptTensor& found_inf_arg, const OptTensor& grad_sum_sq_arg,
             std::optional<double> max_grad_norm_arg)
      : lr_tensor(present(lr_tensor_arg)),
        inv_scale(present(inv_scale_arg)),
        found_inf(present(found_inf_arg)),
        grad_sum_sq(present(grad_sum_sq_arg)),
        lr(static_cast<float>(lr_value)),
        max_grad_norm(static_cast<float>(max_grad_norm_arg.value_or(0.0))) {}

  // Their data pointers, for a backend whose tensors hold memory (not Meta).
  StepScalarPointers pointers() const {
    StepScalarPointers s;
    s.lr = data_of(lr_tensor);
    s.inv_scale = data_of(inv_scale);
    s.found_inf = data_of(found_inf);
    s.grad_sum_sq = data_of(grad_sum_sq);
    s.max_grad_norm = max_grad_norm;
    s.lr_host = lr;
    return s;
  }

 private:
  static const Tensor* present(const OptTensor& t) {
    return t && t->defined() ? &*t : nullptr;
  }
  static const float* data_of(const Tensor* t) {
    return t != nullptr ? t->const_data_ptr<float>() : nullptr;
  }
};

// What every step has, whatever its algorithm. The lists are not empty.
template <typename Hyper>
struct Step {
  TensorList params;
  TensorList master_params;  // empty, FP32 masters, int16 remainders or compensations
  TensorList grads;
  TensorList steps;  // per-tensor step counts, advanced unless the step is skipped
  Hyper hyper;
  ScalarArgs scalars;
  bool adopt_param_edits;  // master := param where param != rounding of master (masters only)
  bool write_back_grads;   // grads := the multiplied gradient the update used
  c10::IntArrayRef rounding_seeds;  // stochastic rounding: one seed per tensor; else empty
  // Where the backend takes them (takes_step_addresses): the checks' row of element
  // addresses per list position; nullptr otherwise.
  StepAddresses* addresses;

  WeightStore weight_store() const {
    return weight_store_of(master_params, adopt_param_edits, !rounding_seeds.empty());
  }
};

struct AdamStep : Step<math::AdamHyper> {
  static constexpr const char* kOp = op_handles::names::kAdamStep;
  TensorList exp_avgs;
  TensorList exp_avg_sqs;
  TensorList max_exp_avg_sqs;  // AMSGrad's running maxima; empty: plain Adam
};

struct SgdStep : Step<math::SgdHyper> {
  static constexpr const char* kOp = op_handles::names::kSgdStep;
  TensorList momentum_buffers;  // empty when momentum is 0
};

// ---- grads the fused kernels do not walk ----------------------------------------------------

// grad_stats_ over grads some of which are per-tensor ones (checks::per_tensor_grad): the
// others go to the backend's kernel (their flags through a list of their own, merged back by
// position), these to ATen ops: the same found_inf, sum of squares (in FP64, added as FP32) and
// flags, on the device, without a host sync. A rare path (FP64 models, odd layouts).
void grad_stats_split(void (*fused_stats)(const GradStats&), TensorList grads,
                      const Tensor& found_inf, const Tensor& sum_sq,
                      const OptTensor& tensor_flags, const OptTensor& telemetry);

// ---- the ops, as registered -----------------------------------------------------------------

// Whether Backend's step kernels take the element addresses the checks read (step_addresses.h);
// a backend says so with `static constexpr bool kTakesStepAddresses = true;`.
template <typename Backend, typename = void>
struct takes_step_addresses : std::false_type {};
template <typename Backend>
struct takes_step_addresses<Backend, std::void_t<decltype(Backend::kTakesStepAddresses)>>
    : std::bool_constant<Backend::kTakesStepAddresses> {};

// Where Backend's kernels take the addresses: the rows its caller lent for these lists (the
// engine's, kept from its previous step over them), else `own`, the call's own.
template <typename Backend>
StepAddresses* step_rows_for(TensorList params, TensorList master_params, TensorList steps,
                             StepAddresses& own) {
  if constexpr (takes_step_addresses<Backend>::value) {
    StepAddresses* lent = borrow_step_rows(params, master_params, steps);
    return lent != nullptr ? lent : &own;
  } else {
    return nullptr;
  }
}

// Grads the fused kernels do not walk (FP64, or strided but not dense) go to torch's own
// kernel, which torch's op also uses for them; the contract is the same. With statistics and
// such grads (a rare mix), grad_stats_'s own path reads them all first, then the plain unscale.
template <typename Backend>
void unscale_and_check(TensorList grads, const Tensor& found_inf, const Tensor& inv_scale,
                       const OptTensor& sum_sq, const OptTensor& telemetry) {
  const bool per_tensor_grads = checks::unscale_and_check(UnscaleAndCheck::kOp, grads, found_inf,
                                                          inv_scale, sum_sq, telemetry);
  if (!per_tensor_grads) {
    Backend::unscale_and_check(UnscaleAndCheck{grads, found_inf, inv_scale, sum_sq, telemetry});
    return;
  }
  if (sum_sq && sum_sq->defined()) {
    grad_stats_split(&Backend::grad_stats, grads, found_inf, *sum_sq, std::nullopt, telemetry);
  }
  std::vector<Tensor> fused, per_tensor;
  for (const auto& g : grads) {
    (checks::per_tensor_grad(g) ? per_tensor : fused).push_back(g);
  }
  Backend::unscale_and_check(
      UnscaleAndCheck{fused, found_inf, inv_scale, std::nullopt, std::nullopt});
  Tensor found_inf_handle = found_inf;  // the same tensor; torch's signature takes Tensor&
  at::_amp_foreach_non_finite_check_and_unscale_(per_tensor, found_inf_handle, inv_scale);
}

template <typename Backend>
void grad_stats(TensorList grads, const Tensor& found_inf, const Tensor& sum_sq,
                const OptTensor& tensor_flags, const OptTensor& telemetry) {
  if (!checks::grad_stats(GradStats::kOp, grads, found_inf, sum_sq, tensor_flags, telemetry)) {
    Backend::grad_stats(GradStats{grads, found_inf, sum_sq, tensor_flags, telemetry});
    return;
  }
  grad_stats_split(&Backend::grad_stats, grads, found_inf, sum_sq, tensor_flags, telemetry);
}

template <typename Backend>
void update_scale(const Tensor& scale, const Tensor& growth_tracker,
                  const Tensor& hysteresis_tracker, const Tensor& found_inf, double growth_factor,
                  double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                  std::optional<double> min_scale, std::optional<double> max_scale,
                  const OptTensor& amax, std::optional<double> amax_target,
                  const OptTensor& scale_history, int64_t scale_history_slot) {
  checks::update_scale(UpdateScale::kOp, scale, growth_tracker, hysteresis_tracker, found_inf,
                       growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
                       max_scale, amax, amax_target, scale_history, scale_history_slot);
  Backend::update_scale(UpdateScale{
      scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
      growth_interval, hysteresis, min_scale, max_scale, amax, amax_target,
      scale_history.has_value() && scale_history->defined() ? &*scale_history : nullptr,
      scale_history_slot});
}

template <typename Backend>
void record_telemetry(const Tensor& ring, int64_t slot, const Tensor& scale,
                      const Tensor& found_inf, const Tensor& measured,
                      const OptTensor& pass_sum_sq) {
  checks::record_telemetry(RecordTelemetry::kOp, ring, slot, scale, found_inf, measured,
                           pass_sum_sq);
  Backend::record_telemetry(RecordTelemetry{
      ring, slot, scale, found_inf, measured,
      pass_sum_sq && pass_sum_sq->defined() ? &*pass_sum_sq : nullptr});
}

template <typename Backend>
void account_step(const Tensor& step_applied, const Tensor& skipped_steps,
                  const OptTensor& found_inf, const OptTensor& found_inf_out,
                  const OptTensor& grad_sum_sq, const OptTensor& inv_scale,
                  const OptTensor& grad_norms, int64_t grad_norm_slot) {
  checks::account_step(AccountStep::kOp, step_applied, skipped_steps, found_inf, found_inf_out,
                       grad_sum_sq, inv_scale, grad_norms, grad_norm_slot);
  const auto present = [](const OptTensor& t) -> const Tensor* {
    return t && t->defined() ? &*t : nullptr;
  };
  Backend::account_step(AccountStep{step_applied, skipped_steps, present(found_inf),
                                    present(found_inf_out), present(grad_sum_sq),
                                    present(inv_scale), present(grad_norms), grad_norm_slot});
}

// Empty lists are a no-op: the backend is not called.
template <typename Backend>
void adam_step(TensorList params, TensorList master_params, TensorList grads,
               TensorList exp_avgs, TensorList exp_avg_sqs, TensorList steps, double lr,
               double beta1, double beta2, double eps, double weight_decay,
               bool decoupled_weight_decay, bool maximize, const OptTensor& lr_tensor,
               const OptTensor& inv_scale, const OptTensor& found_inf,
               const OptTensor& grad_sum_sq, std::optional<double> max_grad_norm,
               bool adopt_param_edits, bool write_back_grads,
               std::optional<TensorList> max_exp_avg_sqs, c10::OptionalIntArrayRef rounding_seeds) {
  const TensorList v_maxes = max_exp_avg_sqs.value_or(TensorList());
  StepAddresses addresses;
  StepAddresses* const taken = step_rows_for<Backend>(params, master_params, steps, addresses);
  if (checks::adam_step(AdamStep::kOp, params, master_params, grads, exp_avgs, exp_avg_sqs,
                        v_maxes, steps, lr, beta1, beta2, eps, weight_decay, lr_tensor, inv_scale,
                        found_inf, grad_sum_sq, max_grad_norm, rounding_seeds, taken)) {
    Backend::adam_step(AdamStep{
        {params, master_params, grads, steps,
         math::make_adam_hyper(lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay,
                               maximize),
         ScalarArgs(lr, lr_tensor, inv_scale, found_inf, grad_sum_sq, max_grad_norm),
         adopt_param_edits, write_back_grads, rounding_seeds.value_or(c10::IntArrayRef()),
         taken},
        exp_avgs,
        exp_avg_sqs,
        v_maxes});
  }
}

template <typename Backend>
void sgd_step(TensorList params, TensorList master_params, TensorList grads,
              TensorList momentum_buffers, TensorList steps, double lr, double momentum,
              double dampening, double weight_decay, bool nesterov, bool maximize,
              const OptTensor& lr_tensor, const OptTensor& inv_scale, const OptTensor& found_inf,
              const OptTensor& grad_sum_sq, std::optional<double> max_grad_norm,
              bool adopt_param_edits, bool write_back_grads,
              c10::OptionalIntArrayRef rounding_seeds) {
  StepAddresses addresses;
  StepAddresses* const taken = step_rows_for<Backend>(params, master_params, steps, addresses);
  if (checks::sgd_step(SgdStep::kOp, params, master_params, grads, momentum_buffers, steps, lr,
                       momentum, dampening, weight_decay, nesterov, lr_tensor, inv_scale,
                       found_inf, grad_sum_sq, max_grad_norm, rounding_seeds, taken)) {
    Backend::sgd_step(SgdStep{
        {params, master_params, grads, steps,
         math::make_sgd_hyper(lr, momentum, dampening, weight_decay, nesterov, maximize),
         ScalarArgs(lr, lr_tensor, inv_scale, found_inf, grad_sum_sq, max_grad_norm),
         adopt_param_edits, write_back_grads, rounding_seeds.value_or(c10::IntArrayRef()),
         taken},
        momentum_buffers});
  }
}

// Inside TORCH_LIBRARY_IMPL(fusedamp, <dispatch key>, m): every op, checked, then Backend's.
template <typename Backend>
void implement_ops(torch::Library& m) {
  // The kernels' signatures are the typed handles' (op_handles.h), which callers use.
  static_assert(std::is_same_v<decltype(&unscale_and_check<Backend>), op_handles::UnscaleSig*>);
  static_assert(std::is_same_v<decltype(&grad_stats<Backend>), op_handles::StatsSig*>);
  static_assert(std::is_same_v<decltype(&update_scale<Backend>), op_handles::ScaleSig*>);
  static_assert(
      std::is_same_v<decltype(&record_telemetry<Backend>), op_handles::TelemetrySig*>);
  static_assert(std::is_same_v<decltype(&account_step<Backend>), op_handles::AccountSig*>);
  static_assert(std::is_same_v<decltype(&adam_step<Backend>), op_handles::AdamSig*>);
  static_assert(std::is_same_v<decltype(&sgd_step<Backend>), op_handles::SgdSig*>);
  m.impl("unscale_and_check_", &unscale_and_check<Backend>);
  m.impl("grad_stats_", &grad_stats<Backend>);
  m.impl("update_scale_", &update_scale<Backend>);
  m.impl("record_telemetry_", &record_telemetry<Backend>);
  m.impl("account_step_", &account_step<Backend>);
  m.impl("adam_step_", &adam_step<Backend>);
  m.impl("sgd_step_", &sgd_step<Backend>);
}

}  // namespace fusedamp::prelude
