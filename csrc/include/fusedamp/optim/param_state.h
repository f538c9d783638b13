#pragma once
// The per-parameter state of fusedamp's optimizers, slot by slot, under the names torch.optim
// uses in its state dicts (a checkpoint moves between torch.optim and fusedamp.optim).
//
// A parameter's state is created at the first step that sees a gradient for it, on the
// parameter's device, with the parameter's strides, so that every list a fused op walks is
// dense in the same element order as the parameter itself. The moments and momentum buffers
// are FP32 or BF16 (state_dtype), or 8-bit codes with block scales (int8: Adam's moments,
// SGD's momentum buffer);
// what keeps the weight's lower bits depends on master_weights (fusedamp/master_modes.h
// MasterKept): master_param (FP32), param_remainder (int16 or int8, below a BF16 weight),
// kahan_compensation (the weight's dtype), or nothing. A state dict may hold any of them: the
// next step converts it to what the group's mode keeps (exactly, between FP32 and split).
#include <ATen/core/Tensor.h>

#include <array>
#include <string>
#include <unordered_map>

namespace fusedamp::optim {

// One parameter's state by name, as state dicts hold it (the tensors themselves).
using StateDict = std::unordered_map<std::string, at::Tensor>;

inline constexpr const char* kStep = "step";
inline constexpr const char* kMasterParam = "master_param";
inline constexpr const char* kExpAvg = "exp_avg";
inline constexpr const char* kExpAvgSq = "exp_avg_sq";
inline constexpr const char* kMaxExpAvgSq = "max_exp_avg_sq";
inline constexpr const char* kMomentumBuffer = "momentum_buffer";
inline constexpr const char* kParamRemainder = "param_remainder";
inline constexpr const char* kKahanCompensation = "kahan_compensation";
inline constexpr const char* kMomentScales = "moment_scales";
inline constexpr const char* kMomentumScales = "momentum_scales";

struct ParamState {
  at::Tensor step;             // 0-dim count of applied steps (FP32, as torch's fused optimizers)
  at::Tensor master_param;     // FP32 master copy of an FP16/BF16 parameter
  at::Tensor exp_avg;          // Adam: first moment
  at::Tensor exp_avg_sq;       // Adam: second moment
  at::Tensor max_exp_avg_sq;   // Adam with amsgrad: running maximum of exp_avg_sq
  at::Tensor momentum_buffer;  // SGD with momentum
  at::Tensor param_remainder;  // BF16 weight + remainder = the master (int16: FP32; int8: 24
                               // bits)
  at::Tensor kahan_compensation;  // the weight's dtype: what rounding dropped
  // state_dtype int8: exp_avg holds int8 codes, exp_avg_sq uint8 codes, and this FP32
  // [ceil(numel / 32), 2] tensor each block's two scales (math/quantized_moments_math.h).
  at::Tensor moment_scales;
  // state_dtype int8 for SGD: momentum_buffer holds int8 codes (exp_avg's format), and this
  // FP32 [ceil(numel / 32), 1] tensor each block's scale.
  at::Tensor momentum_scales;
};

// The tensor slots beside `step`. An optimizer kind says which of them it uses; the state
// dict names and the members are tied together here, once.
enum class StateSlot {
  kMasterParam,
  kExpAvg,
  kExpAvgSq,
  kMomentumBuffer,
  kMaxExpAvgSq,
  kParamRemainder,
  kKahanCompensation,
  kMomentScales,
  kMomentumScales
};

struct StateSlotInfo {
  StateSlot slot;
  const char* name;
  at::Tensor ParamState::*member;
};

inline constexpr std::array<StateSlotInfo, 9> kStateSlots = {{
    {StateSlot::kMasterParam, kMasterParam, &ParamState::master_param},
    {StateSlot::kExpAvg, kExpAvg, &ParamState::exp_avg},
    {StateSlot::kExpAvgSq, kExpAvgSq, &ParamState::exp_avg_sq},
    {StateSlot::kMomentumBuffer, kMomentumBuffer, &ParamState::momentum_buffer},
    {StateSlot::kMaxExpAvgSq, kMaxExpAvgSq, &ParamState::max_exp_avg_sq},
    {StateSlot::kParamRemainder, kParamRemainder, &ParamState::param_remainder},
    {StateSlot::kKahanCompensation, kKahanCompensation, &ParamState::kahan_compensation},
    {StateSlot::kMomentScales, kMomentScales, &ParamState::moment_scales},
    {StateSlot::kMomentumScales, kMomentumScales, &ParamState::momentum_scales},
}};

// The slots of block scales, which come and go with their codes' format.
inline constexpr bool is_block_scales_slot(StateSlot slot) {
  return slot == StateSlot::kMomentScales || slot == StateSlot::kMomentumScales;
}

// The slots that keep a weight's lower bits (one at most is defined); the engine adds them.
inline constexpr bool is_weight_store_slot(StateSlot slot) {
  return slot == StateSlot::kMasterParam || slot == StateSlot::kParamRemainder ||
         slot == StateSlot::kKahanCompensation;
}

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
