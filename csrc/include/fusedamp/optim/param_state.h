#pragma once
// The per-parameter state of fusedamp's optimizers, slot by slot, under the names torch.optim
// uses in its state dicts (a checkpoint moves between torch.optim and fusedamp.optim).
//
// A parameter's state is created at the first step that sees a gradient for it: FP32, on the
// parameter's device, with the parameter's strides, so that every list a fused op walks is
// dense in the same element order as the parameter itself.
#include <ATen/core/Tensor.h>

#include <array>

namespace fusedamp::optim {

inline constexpr const char* kStep = "step";
inline constexpr const char* kMasterParam = "master_param";
inline constexpr const char* kExpAvg = "exp_avg";
inline constexpr const char* kExpAvgSq = "exp_avg_sq";
inline constexpr const char* kMaxExpAvgSq = "max_exp_avg_sq";
inline constexpr const char* kMomentumBuffer = "momentum_buffer";

struct ParamState {
  at::Tensor step;             // 0-dim count of applied steps (FP32, as torch's fused optimizers)
  at::Tensor master_param;     // FP32 master copy of an FP16/BF16 parameter
  at::Tensor exp_avg;          // Adam: first moment
  at::Tensor exp_avg_sq;       // Adam: second moment
  at::Tensor max_exp_avg_sq;   // Adam with amsgrad: running maximum of exp_avg_sq
  at::Tensor momentum_buffer;  // SGD with momentum
};

// The tensor slots beside `step`. An optimizer kind says which of them it uses; the state
// dict names and the members are tied together here, once.
enum class StateSlot { kMasterParam, kExpAvg, kExpAvgSq, kMomentumBuffer, kMaxExpAvgSq };

struct StateSlotInfo {
  StateSlot slot;
  const char* name;
  at::Tensor ParamState::*member;
};

inline constexpr std::array<StateSlotInfo, 5> kStateSlots = {{
    {StateSlot::kMasterParam, kMasterParam, &ParamState::master_param},
    {StateSlot::kExpAvg, kExpAvg, &ParamState::exp_avg},
    {StateSlot::kExpAvgSq, kExpAvgSq, &ParamState::exp_avg_sq},
    {StateSlot::kMomentumBuffer, kMomentumBuffer, &ParamState::momentum_buffer},
    {StateSlot::kMaxExpAvgSq, kMaxExpAvgSq, &ParamState::max_exp_avg_sq},
}};

inline const StateSlotInfo& slot_info(StateSlot slot) {
  return kStateSlots[static_cast<size_t>(slot)];
}

// A set of slots (bit i: kStateSlots[i]).
class StateSlots {
 public:
  constexpr StateSlots() = default;
  constexpr StateSlots(std::initializer_list<StateSlot> slots) {
    for (auto s : slots) {
      bits_ |= bit(s);
    }
  }
  constexpr bool has(StateSlot s) const { return (bits_ & bit(s)) != 0; }
  constexpr StateSlots with(StateSlot s) const { return StateSlots(bits_ | bit(s)); }
  constexpr bool operator==(const StateSlots& o) const { return bits_ == o.bits_; }

 private:
  constexpr explicit StateSlots(unsigned bits) : bits_(bits) {}
  static constexpr unsigned bit(StateSlot s) { return 1u << static_cast<unsigned>(s); }
  unsigned bits_ = 0;
};

}  // namespace fusedamp::optim
