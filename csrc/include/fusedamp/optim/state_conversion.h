#pragma once
// Converting one parameter's optimizer state between master-weight modes and moment dtypes,
// outside an optimizer: for front ends that lay the state out themselves (the ZeRO-1 shards
// of fusedamp.distributed) and for exporting the FP32 model from a checkpoint. An optimizer
// does the same conversion itself at the first step after a load (param_state.h).
#include <fusedamp/optim/optimizer.h>

namespace fusedamp::optim {

struct ConvertedParamState {
  // The weight the state belongs beside: `weight` itself, except that "split" moves a weight
  // by one BF16 ulp where its master lies exactly halfway (math/split_math.h), so that the
  // pair is the master exactly.
  at::Tensor weight;
  Optimizer::StateDict state;
};

// `state` (a state-dict entry of any mode: master_param, param_remainder, kahan_compensation
// or none; moments FP32 or BF16; "step" required) as `mode` keeps it beside `weight`: the
// mode's weight store, rebuilt from the store `state` holds (exactly between FP32 masters and
// split pairs) or from the weight where it holds none; the moments and buffers it holds in
// `state_dtype`. Every tensor is new, with the weight's shape, strides and device; nothing
// given is changed. Throws (naming `index`, the parameter's index) for a state that does not
// belong beside `weight`.
ConvertedParamState convert_param_state(const at::Tensor& weight,
                                        const Optimizer::StateDict& state, MasterWeights mode,
                                        at::ScalarType state_dtype, size_t index = 0);

}  // namespace fusedamp::optim
