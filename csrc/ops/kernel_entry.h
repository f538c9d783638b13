#pragma once
// What every backend (CPU, CUDA, Meta, the fallback) does first, written once: each operator's
// kernel takes the arguments as the dispatcher passes them (the operator's Signature), gathers
// them into its declaration (fusedamp/ops.h), checks them all (checks.h: before anything is
// touched) and hands them to the backend. For the step ops it also derives, once for all
// backends, what the kernels walk (step_lists.h). A backend is a struct of static functions,
// one per operator, each taking the declaration (a step operator's: its Step);
// implement_ops<Backend>(m) registers them.
#include <fusedamp/math/scale_math.h>
#include <fusedamp/ops.h>
#include <torch/library.h>

#include <type_traits>

#include "checks.h"
#include "kernel_of.h"
#include "scratch_vector.h"
#include "step_lists.h"

namespace fusedamp::kernels {

// unscale_and_check_ / grad_stats_ over grads some of which the fused kernels do not walk
// (checks::per_tensor_grad): those go to ATen ops, the others to `fused`, with the same
// contract (per_tensor_grads.cpp). A rare path (FP64 models, odd layouts).
void unscale_and_check_split(void (*fused_unscale)(const ops::UnscaleAndCheck&),
                             void (*fused_stats)(const ops::GradStats&),
                             const ops::UnscaleAndCheck& op);
void grad_stats_split(void (*fused_stats)(const ops::GradStats&), const ops::GradStats& op);

template <typename Backend>
void run(const ops::UnscaleAndCheck& op) {
  if (!checks::unscale_and_check(op)) {
    Backend::unscale_and_check(op);
  } else {
    unscale_and_check_split(&Backend::unscale_and_check, &Backend::grad_stats, op);
  }
}

template <typename Backend>
void run(const ops::GradStats& op) {
  if (!checks::grad_stats(op)) {
    Backend::grad_stats(op);
  } else {
    grad_stats_split(&Backend::grad_stats, op);
  }
}

// update_scale_'s hyper-parameters as the scale state machine takes them (math/scale_math.h).
inline math::ScaleHyper scale_hyper(const ops::UpdateScale& op) {
  math::ScaleHyper h;
  h.growth_factor = op.growth_factor;
  h.backoff_factor = op.backoff_factor;
  h.growth_interval = static_cast<int32_t>(op.growth_interval);
  h.hysteresis = static_cast<int32_t>(op.hysteresis);
  h.min_scale = static_cast<float>(op.min_scale.value_or(0.0));
  h.max_scale = static_cast<float>(op.max_scale.value_or(0.0));
  h.amax_target = op.amax_target.value_or(0.0);
  return h;
}

template <typename Backend>
void run(const ops::UpdateScale& op) {
  checks::update_scale(op);
  Backend::update_scale(op);
}

template <typename Backend>
void run(const ops::RecordTelemetry& op) {
  checks::record_telemetry(op);
  Backend::record_telemetry(op);
}

template <typename Backend>
void run(const ops::AccountStep& op) {
  checks::account_step(op);
  Backend::account_step(op);
}

// Whether Backend's step kernels walk the element addresses the checks take (step_lists.h
// StepRows); a backend says so with `static constexpr bool kTakesRows = true;`.
template <typename Backend, typename = void>
struct takes_rows : std::false_type {};
template <typename Backend>
struct takes_rows<Backend, std::void_t<decltype(Backend::kTakesRows)>>
    : std::bool_constant<Backend::kTakesRows> {};

// A step operator: its Step (step_lists.h), checked, to the backend's kernel; empty lists are a
// no-op (the kernel is not called).
template <typename Backend, typename Args>
void run_step(const Args& op, void (*kernel)(const StepOf<Args>&)) {
  StepOf<Args> step = step_of(op);
  if constexpr (takes_rows<Backend>::value) {
    ScratchVector<StepRow> pooled(0);
    StepRows rows;
    rows.rows.swap(*pooled);  // back to the pool below, with its capacity
    step.rows = &rows;
    if (checks::step(op, step)) {
      kernel(step);
    }
    rows.rows.swap(*pooled);
  } else if (checks::step(op, step)) {
    kernel(step);
  }
}

// Every step operator of ops.h's list: Backend::step<Algorithm>.
template <typename Backend, typename Op>
std::enable_if_t<ops::IsStepOp<Op>::value> run(const Op& op) {
  run_step<Backend>(op, &Backend::template step<AlgorithmOf<Op>>);
}

// A step operator's kernel on rows its caller checked itself, this step, with checks::step_row
// (the engine's gradient walk): the op's other checks run, the rows' do not. Not registered:
// the dispatcher never comes here; the operator is always run<Backend> above. `rows` are the
// caller's (their addresses may be retaken: StepRows::needs_mutable_access).
template <typename Args>
void run_step_on_checked_rows(const Args& op, StepRows& rows,
                              void (*kernel)(const StepOf<Args>&)) {
  StepOf<Args> step = step_of(op);
  step.rows = &rows;
  if (checks::step(op, step, checks::RowsChecked::kByTheCaller)) {
    kernel(step);
  }
}

// What the dispatcher's kernels (kernel_of.h) hand each operator's declaration to.
template <typename Backend>
struct Entry {
  template <typename Op>
  static void run(const Op& op) {
    kernels::run<Backend>(op);
  }
};

// Inside TORCH_LIBRARY_IMPL(fusedamp, <dispatch key>, m): every operator, for Backend.
template <typename Backend, typename... Ops>
void implement(torch::Library& m, ops::OpList<Ops...>) {
  (m.impl(Ops::kShortName, &KernelOf<Ops>::template kernel<Entry<Backend>>), ...);
}

template <typename Backend>
void implement_ops(torch::Library& m) {
  implement<Backend>(m, ops::AllOps{});
}

}  // namespace fusedamp::kernels
