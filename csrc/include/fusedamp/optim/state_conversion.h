#pragma once
// Converting one parameter's optimizer state between master-weight modes and moment dtypes,
// outside an optimizer: for front ends that lay the state out themselves (the ZeRO-1 shards
// of fusedamp.distributed) and for exporting the FP32 model from a checkpoint. An optimizer
// does the same conversion itself at the first step after a load (param_state.h).
#include <fusedamp/optim/options.h>
#include <fusedamp/optim/param_state.h>

#include <vector>

namespace fusedamp::optim {

struct ConvertedParamState {
  // The weight the state belongs beside: `weight` itself, except where the value lies exactly
  // halfway between two BF16 weights and the new mode rounds it to the other one ("split"
  // rounds ties away from zero, math/split_math.h; True and "kahan" keep the rounding to
  // nearest even beside a value rebuilt from a pair): the weight moves by one ulp, so that the
  // new store holds the value exactly.
  at::Tensor weight;
  StateDict state;
};

// `state` (a state-dict entry of any mode: master_param, param_remainder, kahan_compensation
// or none; moments FP32 or BF16; "step" required) as `mode` keeps it beside `weight`: the
// mode's weight store, rebuilt from the store `state` holds (exactly between FP32 masters and
// split pairs) or from the weight where it holds none; the moments and buffers it holds in
// `state_dtype`. Every tensor is new, with the weight's shape, strides and device; nothing
// given is changed. Throws (naming `index`, the parameter's index) for a state that does not
// belong beside `weight`.
ConvertedParamState convert_param_state(const at::Tensor& weight,
                                        const StateDict& state, MasterWeights mode,
                                        at::ScalarType state_dtype, size_t index = 0);

// The shape of param's 'moment_scales' under state_dtype int8: [size(0), R / 32, 2] for a
// contiguous parameter of two or more dimensions whose rows (R elements each) are whole blocks
// of 32 (a range of rows then has that range of the scales: FSDP2's dim-0 shards lay them out
// as they lay out the parameter), [ceil(numel / 32), 2] otherwise.
std::vector<int64_t> moment_scales_shape(const at::Tensor& param);

// The shape of param's 'momentum_scales' (SGD) under state_dtype int8: moment_scales_shape's
// rows with one column.
std::vector<int64_t> momentum_scales_shape(const at::Tensor& param);

}  // namespace fusedamp::optim
