#pragma once
// What every bucket's step op call has besides its algorithm's hyper-parameters, how it goes
// into either step operator's declaration (fusedamp/ops.h), and how the engine makes the call.
#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <fusedamp/ops.h>

#include <optional>

#include "../cpu/checked_rows.h"
#include "../ops/handles.h"
#include "bucket_plan.h"

namespace fusedamp::optim::detail {

// b's lists, the options every algorithm has (o: its group's) and the arguments both step ops
// take (`in`: one value, passed on whole) into Args (a step operator's declaration); the caller
// adds its algorithm's own.
template <typename Args, typename Options>
void fill_step(Args& a, const Bucket& b, const Options& o, const ops::StepShared& in) {
  a.lr = o.lr();
  a.weight_decay = o.weight_decay();
  a.maximize = o.maximize();
  a.params = b.params;
  a.master_params = b.state(StateSlot::kMasterParam);
  a.grads = b.grads;
  a.steps = b.steps;
  a.shared = in;
  if (!b.rounding_seeds.empty()) {
    a.rounding_seeds = b.rounding_seeds;
  }
}

// Whether the CPU kernel is what the dispatcher would run for a call over tensors with these
// keys (dense CPU tensors; autograd's and autocast's keys change nothing for the step ops,
// which the engine runs below autograd) on a thread with no dispatch key of its own (a
// __torch_dispatch__ mode, functionalization).
inline bool plain_cpu_call(c10::DispatchKeySet keys) {
  static const c10::DispatchKeySet kPlainCpu{c10::DispatchKey::CPU,
                                             c10::DispatchKey::ADInplaceOrView,
                                             c10::DispatchKey::AutogradCPU,
                                             c10::DispatchKey::AutocastCPU};
  return kPlainCpu.isSupersetOf(keys) &&
         (c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty();
}

// The step op of bucket b. Where this step's walk checked b's rows (a CPU bucket, within a
// whole step) and the call would reach the CPU kernel, the kernel runs on those rows (under the
// op's name for the profiler): the op's own walk would read every tensor's metadata again.
// Otherwise, the operator through the dispatcher.
template <typename Args>
void call_step(const Args& a, const Bucket& b) {
  if (b.rows_checked && plain_cpu_call(b.rows.keys)) {
    RECORD_FUNCTION(Args::kName, std::vector<c10::IValue>());
    cpu::step_on_checked_rows(a, b.rows);
  } else {
    ops::call(a);
  }
}

}  // namespace fusedamp::optim::detail
