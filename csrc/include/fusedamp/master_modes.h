#pragma once
// The master-weight modes: how a step keeps the bits that rounding to FP16/BF16 drops. One row
// of FUSEDAMP_MASTER_MODES per mode, and every layer reads the list (kMasterModes) rather than
// naming modes: the option's names, codes and messages (optim/options.h MasterWeights), the
// operators' checks of master_params and the kernels' compile-time switch
// (ops/static_switch.h), the conversions of a parameter's state between modes
// (engine/state_conversion.cpp). A new mode is a row here plus its loads and stores in the
// kernels (cpu/vec_io.h, cuda/step_weights.cuh) and its element math (math/).
#include <c10/core/ScalarType.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fusedamp {

// What a mode keeps beside each weight: the step operators' master_params and one slot of the
// optimizer's state (optim/param_state.h).
enum class MasterKept : uint8_t {
  kNothing,       // master_params empty
  kFp32Master,    // master_param: the FP32 master
  kRemainder,     // param_remainder: the master's bits below the BF16 weight
  kCompensation,  // kahan_compensation, of the weight's dtype
};

// The modes, one row each, in code order. The codes are what archives and set_group_option
// carry: a row keeps its code for good.
//   kOff         the weight alone, updated in FP32 and rounded to nearest (updates below half
//                an ulp are lost)
//   kFp32        an FP32 master copy (+4 B/param); the weight is its rounding
//   kSplit       BF16 only: an int16 remainder (+2 B/param); weight + remainder is exactly the
//                FP32 master of kFp32 (math/split_math.h; the weight differs from kFp32's only
//                where the master lies exactly halfway between two BF16 values)
//   kKahan       a compensation buffer of the weight's dtype (+2 B/param) carrying what
//                rounding dropped (math/kahan_math.h)
//   kStochastic  BF16 only: no extra state; the weight is rounded stochastically, reproducibly
//                from the options' rounding_seed (math/stochastic_rounding_math.h)
//   kSplit8      BF16 only: an int8 remainder (+1 B/param); weight + remainder is a 24-bit
//                master (16 significant bits): the FP32 result of each step rounded to nearest
//                24 bits (math/split_math.h)
//   kMasterAdoptingEdits  no value of the option (no spelling): how the kernels run kFp32 with
//                adopt_param_edits (where a weight is not its master's rounding, the step
//                starts from the weight)
// X(enumerator, code, spelling, name, other name, about, kept, kept dtype, fits float32,
//   fits float16, fits bfloat16, seeded): the fields of MasterModeInfo below.
#define FUSEDAMP_MASTER_MODES(X)                                                               \
  X(kOff, 0, "False", "off", nullptr, "none", kNothing, Undefined, true, true, true, false)    \
  X(kFp32, 1, "True", "fp32", "float32", "an FP32 master copy", kFp32Master, Float, true,      \
    true, true, false)                                                                         \
  X(kSplit, 2, "\"split\"", "split", nullptr,                                                  \
    "BF16 weight + int16 remainder = the FP32 master exactly", kRemainder, Short, false, false, \
    true, false)                                                                               \
  X(kKahan, 3, "\"kahan\"", "kahan", nullptr, "a 16-bit compensation buffer", kCompensation,   \
    Undefined, false, true, true, false)                                                       \
  X(kStochastic, 4, "\"stochastic\"", "stochastic", nullptr, "BF16 stochastic rounding",       \
    kNothing, Undefined, false, false, true, true)                                             \
  X(kSplit8, 5, "\"split8\"", "split8", nullptr, "BF16 weight + int8 remainder = a 24-bit master", \
    kRemainder, Char, false, false, true, false)                                               \
  X(kMasterAdoptingEdits, 6, nullptr, nullptr, nullptr, "an FP32 master copy", kFp32Master,    \
    Float, true, true, true, false)

// The enumerators sit in a struct so that optim::MasterWeights, which derives from it, spells
// them as its own (MasterWeights::kSplit).
struct MasterModes {
#define FUSEDAMP_MASTER_MODE_ENUMERATOR(mode, code, ...) mode = code,
  enum Mode : uint8_t {
    FUSEDAMP_MASTER_MODES(FUSEDAMP_MASTER_MODE_ENUMERATOR)
  };
#undef FUSEDAMP_MASTER_MODE_ENUMERATOR
};
using MasterMode = MasterModes::Mode;

struct MasterModeInfo {
  MasterMode mode;
  // How master_weights names it in Python and in messages (True, False, "split", ...);
  // nullptr for a kernel variant, which is no value of the option.
  const char* spelling;
  // The strings MasterWeights::from_name takes for it (nullptr: none further).
  std::array<const char*, 2> names;
  const char* about;  // what it keeps, for messages
  MasterKept kept;
  // master_params' dtype where the mode keeps an FP32 master or a remainder; Undefined
  // otherwise (a compensation has the params' dtype).
  c10::ScalarType kept_dtype;
  // The param dtypes its kernels serve. An optimizer runs FP32 parameters as kOff in every
  // mode (they are their own masters).
  bool fits_float;
  bool fits_half;
  bool fits_bfloat16;
  bool seeded;  // rounding_seeds: one seed per tensor
};

#define FUSEDAMP_MASTER_MODE_ROW(mode, code, spelling, name, other_name, about, kept, dtype,   \
                                 fits_float, fits_half, fits_bfloat16, seeded)                \
  MasterModeInfo{MasterModes::mode, spelling, {{name, other_name}}, about, MasterKept::kept,  \
                 c10::ScalarType::dtype, fits_float, fits_half, fits_bfloat16, seeded},
#define FUSEDAMP_MASTER_MODE_COUNT(...) +1
inline constexpr std::array<MasterModeInfo, 0 FUSEDAMP_MASTER_MODES(FUSEDAMP_MASTER_MODE_COUNT)>
    kMasterModes = {{FUSEDAMP_MASTER_MODES(FUSEDAMP_MASTER_MODE_ROW)}};
#undef FUSEDAMP_MASTER_MODE_ROW
#undef FUSEDAMP_MASTER_MODE_COUNT

constexpr const MasterModeInfo& master_mode_info(MasterMode mode) {
  return kMasterModes[static_cast<size_t>(mode)];
}

namespace detail {
constexpr bool master_modes_in_code_order() {
  for (size_t i = 0; i < kMasterModes.size(); ++i) {
    if (static_cast<size_t>(kMasterModes[i].mode) != i) {
      return false;
    }
  }
  return true;
}
}  // namespace detail
static_assert(detail::master_modes_in_code_order(), "kMasterModes[code] must be that code's mode");

// Whether `info`'s kernels serve params of `dtype`.
constexpr bool master_mode_fits(const MasterModeInfo& info, c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float:
      return info.fits_float;
    case c10::ScalarType::Half:
      return info.fits_half;
    case c10::ScalarType::BFloat16:
      return info.fits_bfloat16;
    default:
      return false;
  }
}

// "a, b or c", for messages.
inline std::string one_of(const std::vector<std::string>& choices) {
  std::string out;
  for (size_t i = 0; i < choices.size(); ++i) {
    out += i == 0 ? "" : (i + 1 == choices.size() ? " or " : ", ");
    out += choices[i];
  }
  return out;
}

// The param dtypes `info`'s kernels serve, for messages ("float16 or bfloat16").
inline std::string master_mode_dtypes(const MasterModeInfo& info) {
  std::vector<std::string> served;
  for (const auto& [fits, name] : {std::pair<bool, const char*>{info.fits_float, "float32"},
                                   {info.fits_half, "float16"},
                                   {info.fits_bfloat16, "bfloat16"}}) {
    if (fits) {
      served.emplace_back(name);
    }
  }
  return one_of(served);
}

// The mode whose master_params beside params of `param_dtype` have `master_dtype` (FP32
// masters, remainders, compensations); nullptr where no mode keeps such tensors.
constexpr const MasterModeInfo* master_mode_keeping(c10::ScalarType master_dtype,
                                                    c10::ScalarType param_dtype) {
  for (const auto& info : kMasterModes) {
    const bool holds = info.kept == MasterKept::kCompensation
                           ? master_dtype == param_dtype
                           : info.kept != MasterKept::kNothing && info.kept_dtype == master_dtype;
    if (info.spelling != nullptr && holds) {
      return &info;
    }
  }
  return nullptr;
}

// The mode a step runs, from what it is given: its kept master_params' dtype (none: kOff), its
// seeds, whether masters adopt edited weights.
inline MasterMode master_mode_of_step(bool has_master_params, c10::ScalarType master_dtype,
                                      c10::ScalarType param_dtype, bool seeded,
                                      bool adopt_param_edits) {
  if (seeded) {
    for (const auto& info : kMasterModes) {
      if (info.seeded) {
        return info.mode;
      }
    }
  }
  if (!has_master_params) {
    return MasterModes::kOff;
  }
  const MasterModeInfo* info = master_mode_keeping(master_dtype, param_dtype);
  const MasterMode mode = info != nullptr ? info->mode : MasterModes::kOff;
  return mode == MasterModes::kFp32 && adopt_param_edits ? MasterModes::kMasterAdoptingEdits
                                                         : mode;
}

}  // namespace fusedamp
