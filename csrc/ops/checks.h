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

// Who checks a step's rows: the op's own walk, or its caller before the call (step_row below).
enum class RowsChecked : uint8_t { kByTheOp, kByTheCaller };

// The whole argument check of a fused step (its declaration's hyper-parameters, then `step`,
// derived from it: lists and, when there are params, the device scalars). Returns false for
// empty lists (a no-op). With step.rows, the op's walk also fills them: one row of element
// addresses per list position, for the kernels; rows its caller checked (kByTheCaller) are
// only matched against the lists. Defined for every operator of ops.h's
// FUSEDAMP_STEP_ALGORITHMS.
template <typename Op>
bool step(const Op& a, StepOf<Op>& step, RowsChecked rows = RowsChecked::kByTheOp);

// ---- a caller that checks a step's rows itself -----------------------------------------------
// The engine reads every parameter and gradient of a step in its gradient walk anyway: it
// checks each row there, as the op would (these functions are the op's own checks, with its
// messages), and calls the kernel on the rows it checked (kernel_entry.h
// run_step_on_checked_rows), where the op would read every tensor's metadata a second time.

// The list checks of `lists` but the grads' (lengths, dtypes, weight store), given the grads'
// dtype: what every row is checked against. n > 0.
StepFacts step_facts(const StepLists& lists, c10::ScalarType grad_dtype);
// Before the rows: rows.rows sized for `lists` (n of them), against `facts`.
void begin_rows(const StepLists& lists, const StepFacts& facts, StepRows& rows);
// Row i (params[i], grad, and lists' other tensors at i) checked as the op checks it, its
// addresses into rows.rows[i] and its tensors' dispatch keys into rows.keys.
void step_row(const StepLists& lists, size_t i, const at::Tensor& grad, StepRows& rows);
// step_row's work in one read of row i's tensors (clean_step_row.cpp), where that read shows
// every check of the row passing: true, with the row and its keys taken. False where it does
// not (nothing is written then): step_row decides such a row, with the op's messages.
bool clean_step_row(const StepLists& lists, size_t i, const at::Tensor& grad, StepRows& rows);
// Starts loading row i's state tensors' metadata (their storages': with storages).
void prefetch_row(const StepLists& lists, size_t i, bool storages);

}  // namespace fusedamp::checks
