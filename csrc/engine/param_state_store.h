#pragma once
// The optimizer's per-parameter state (param_state.h), keyed by the parameter: creation at a
// parameter's first step, the state-dict view of it, and building it from a state dict with
// every check done before anything is committed.
#include <fusedamp/optim/options.h>
#include <fusedamp/optim/param_state.h>

#include <unordered_map>

namespace fusedamp::optim::detail {

class ParamStateStore {
 public:
  ParamState* find(const at::Tensor& param);
  const ParamState* find(const at::Tensor& param) const;

  // Creates what a step needs and is missing: the step count, what `mode` keeps of the weight
  // (converted from what the state holds, e.g. a checkpoint of another mode; the rest is
  // dropped) and `slots` (zeros of state_dtype; existing ones converted to it).
  ParamState& ensure(const at::Tensor& param, MasterWeights mode, at::ScalarType state_dtype,
                     StateSlots slots);
  // What ensure() does to a state it holds, on any state: `s` converted in place to what
  // `mode` keeps beside `param` (which "split" may move by one ulp) and `slots` in state_dtype.
  static void convert(const at::Tensor& param, MasterWeights mode, at::ScalarType state_dtype,
                      StateSlots slots, ParamState& s);

  // The defined tensors of `state`, by name (the tensors themselves).
  static StateDict to_dict(const ParamState& state);

  // Checks `dict` against `param` (names among `known`, "step" present, shapes, floating
  // dtypes; with copy=false also FP32, device and strides) and builds the state. `who` and
  // `index` name the optimizer and the parameter in messages. Commits nothing.
  static ParamState from_dict(const char* who, const at::Tensor& param, size_t index,
                              const StateDict& dict, StateSlots known, bool copy);

  void set(const at::Tensor& param, ParamState state);
  void replace_all(std::unordered_map<const c10::TensorImpl*, ParamState> states);

 private:
  std::unordered_map<const c10::TensorImpl*, ParamState> by_param_;
};

}  // namespace fusedamp::optim::detail
