#pragma once
// The CPU step kernels for a caller that has checked the step's rows itself, this step, with
// checks::step_row (ops/kernel_entry.h run_step_on_checked_rows): the engine's call for a CPU
// bucket, whose gradient walk reads every row's tensors anyway. Not operators: the profiler
// and dispatch modes see them only through their caller.
#include <fusedamp/ops.h>

#include "../ops/step_lists.h"

namespace fusedamp::cpu {

// Defined for every operator of ops.h's FUSEDAMP_STEP_ALGORITHMS.
template <typename Op>
void step_on_checked_rows(const Op& args, StepRows& rows);

}  // namespace fusedamp::cpu
