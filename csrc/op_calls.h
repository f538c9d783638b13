#pragma once
// The step ops as the engine calls them: like fusedamp::ops::adam_step_ / sgd_step_, or, given
// the dispatch keys of the call, straight to their kernel. The dispatcher's own call reads the
// dispatch keys of every tensor of every list to find the kernel, one cache miss per tensor
// where thousands of small tensors are stepped; the engine knows them for most of its lists
// (its own state tensors: engine/step_dispatch.h).
#include <c10/core/DispatchKeySet.h>
#include <fusedamp/ops.h>

#include <optional>

namespace fusedamp::ops::detail {

// `keys`: nullopt for the dispatcher's call; else the key set the call is redispatched with.
void adam_step_to(std::optional<c10::DispatchKeySet> keys, TensorList params,
                  TensorList master_params, TensorList grads, TensorList exp_avgs,
                  TensorList exp_avg_sqs, TensorList steps, const AdamArgs& args,
                  const StepScalars& scalars, const StepModes& modes,
                  TensorList max_exp_avg_sqs);

void sgd_step_to(std::optional<c10::DispatchKeySet> keys, TensorList params,
                 TensorList master_params, TensorList grads, TensorList momentum_buffers,
                 TensorList steps, const SgdArgs& args, const StepScalars& scalars,
                 const StepModes& modes);

}  // namespace fusedamp::ops::detail
