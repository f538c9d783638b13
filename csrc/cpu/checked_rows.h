#pragma once
// The CPU step kernels for a caller that has checked the step's rows itself, this step, with
// checks::step_row (ops/kernel_entry.h run_step_on_checked_rows): the engine's call for a CPU
// bucket, whose gradient walk reads every row's tensors anyway. Not operators: the profiler
// and dispatch modes see them only through their caller.
#include <fusedamp/ops.h>

#include <vector>

#include "../ops/step_lists.h"

namespace fusedamp::cpu {

// Defined for every operator of ops.h's FUSEDAMP_STEP_ALGORITHMS.
template <typename Op>
void step_on_checked_rows(const Op& args, StepRows& rows);

// A gradient of checked rows as a statistics pass reads it: its elements (StepRow::grad and
// numel) and their dtype.
struct GradSpan {
  const void* data;
  int64_t numel;
  at::ScalarType dtype;  // FP32, FP16 or BF16
};

// grad_stats_ over gradients of rows checked this step (the engine's statistics pass, which
// would otherwise read every gradient's metadata again), in `grads`' order: op's other
// arguments checked as the op checks them (its grads list is empty), then the same pass, with
// the same results, as the op's over those gradients.
void grad_stats_on_checked_rows(const ops::GradStats& op, const std::vector<GradSpan>& grads);

}  // namespace fusedamp::cpu
