#pragma once
// How the engine's step op call of a bucket finds its kernel (ops::detail::*_step_to).
#include <c10/core/DispatchKeySet.h>

#include <optional>

#include "bucket_plan.h"

namespace fusedamp::optim::detail {

// The CPU kernel's key set, where the call would reach it through the dispatcher anyway and
// that is known without reading every tensor's keys: a CPU bucket whose own tensors (masters,
// state, step counts) were checked by an earlier step (held rows) and are plain CPU tensors,
// whose params and grads are too (their keys as BucketPlan::update read them this step), with
// no dispatch key added to this thread's included set
// (a __torch_dispatch__ mode, functionalization: those get the dispatcher's call). Autocast
// adds none (it lifts an exclusion) and the step ops have no autocast kernel: the CPU kernel
// either way. nullopt otherwise: the dispatcher's call.
std::optional<c10::DispatchKeySet> direct_step_keys(const Bucket& b);

}  // namespace fusedamp::optim::detail
