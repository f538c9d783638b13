#pragma once
// The CPU step kernels for a caller that has checked the step's rows itself, this step, with
// checks::step_row (ops/kernel_entry.h run_step_on_checked_rows): the engine's call for a CPU
// bucket, whose gradient walk reads every row's tensors anyway. Not operators: the profiler
// and dispatch modes see them only through their caller.
#include <fusedamp/ops.h>

#include "../ops/step_lists.h"

namespace fusedamp::cpu {

void adam_step_on_checked_rows(const ops::AdamStep& args, StepRows& rows);
void sgd_step_on_checked_rows(const ops::SgdStep& args, StepRows& rows);

}  // namespace fusedamp::cpu
