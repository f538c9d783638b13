// The conversion of one parameter's optimizer state between master-weight modes and state
// formats (ParamStateStore::convert, param_state_store.h), and its public form
// (fusedamp/optim/state_conversion.h): a state dict may hold what another mode or format
// keeps, and a group's options may change between steps; the next bucket build converts.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <fusedamp/optim/state_conversion.h>

#include "master_weights.h"
#include "param_state_store.h"
#include "quantized_moments.h"

namespace fusedamp::optim::detail {
namespace {

// An FP32 copy of the weight, with its shape and strides on its device.
at::Tensor fp32_copy(const at::Tensor& param) {
  auto t = at::empty_like(param, param.options().dtype(at::kFloat));
  t.copy_(param.detach());
  return t;
}

// s's weight store as `mode` keeps it for `param`, from whichever store s holds (a checkpoint
// or the group's mode may differ); the others are dropped. FP32 parameters keep nothing.
void convert_weight_store(const at::Tensor& param, MasterWeights mode, ParamState& s) {
  const MasterModeInfo& store =
      param.scalar_type() == at::kFloat ? master_mode_info(MasterModes::kOff) : mode.info();
  const bool bf16 = param.scalar_type() == at::kBFloat16;
  const bool have_remainder = s.param_remainder.defined() && bf16;
  const bool have_compensation = s.kahan_compensation.defined() &&
                                 s.kahan_compensation.scalar_type() == param.scalar_type();
  // The FP32 value the current store holds; undefined if none.
  const auto held_fp32 = [&]() -> at::Tensor {
    if (s.master_param.defined()) {
      return s.master_param;
    }
    if (have_remainder) {
      return fp32_from_split(param, s.param_remainder);
    }
    if (have_compensation) {
      return fp32_from_kahan(param, s.kahan_compensation);
    }
    return at::Tensor();
  };
  // Beside an FP32 master or a Kahan compensation the weight is the value's rounding to nearest
  // even, as their steps store it. Where a value rebuilt from a pair lies exactly halfway and
  // the old weight is the other neighbour ("split" rounds ties away from zero; a compensation
  // may be half an ulp), the weight moves by that ulp and the value stays: a compensation
  // reckoned from the even neighbour beside the odd one would be an ulp off, and the next step
  // would take the odd weight for an edit and drop the master's half ulp.
  const auto round_weight_to = [&](const at::Tensor& value) {
    at::NoGradGuard no_grad;
    param.detach().copy_(value.to(param.scalar_type()));
  };
  at::Tensor master, remainder, compensation;
  switch (store.kept) {
    case MasterKept::kFp32Master:
      master = held_fp32();
      if (!master.defined()) {
        master = fp32_copy(param);
      } else if (!s.master_param.defined()) {
        round_weight_to(master);  // rebuilt exactly from a split or Kahan pair
      }
      break;
    case MasterKept::kRemainder: {
      const auto dtype = store.kept_dtype;
      if (have_remainder && s.param_remainder.scalar_type() == dtype) {
        remainder = s.param_remainder;
      } else if (const auto held = held_fp32(); held.defined()) {
        // The weight may move by one BF16 ulp where the master lies exactly halfway
        // (math/split_math.h): the pair must be the master exactly (an int8 remainder: the
        // master rounded to 24 bits).
        auto split = split_from_fp32(param, held, dtype);
        at::NoGradGuard no_grad;
        param.detach().copy_(split.weight);
        remainder = std::move(split.remainder);
      } else {
        remainder = at::zeros_like(param, param.options().dtype(dtype));
      }
      break;
    }
    case MasterKept::kCompensation:
      if (have_compensation) {
        compensation = s.kahan_compensation;
      } else if (const auto held = held_fp32(); held.defined()) {
        // A held master's weight is its rounding already, or an edit the step keeps.
        if (!s.master_param.defined()) {
          round_weight_to(held);  // rebuilt exactly from a split pair
        }
        compensation = kahan_from_fp32(param, held);
      } else {
        compensation = at::zeros_like(param);
      }
      break;
    case MasterKept::kNothing:
      break;
  }
  s.master_param = master;
  s.param_remainder = remainder;
  s.kahan_compensation = compensation;
}

// Adam's moments in the format a step needs: 8-bit codes with their scales where `codes`,
// quantized from the values held (zeros where none); FP32 values otherwise, dequantized from
// codes held (the caller casts them to state_dtype).
void convert_moment_format(const at::Tensor& param, bool codes, ParamState& s) {
  const bool held_codes = s.exp_avg.defined() && s.exp_avg.scalar_type() == at::kChar;
  if (codes) {
    if (held_codes) {
      return;  // from_dict checked that codes come with uint8 exp_avg_sq and their scales
    }
    QuantizedMoments q;
    if (!s.exp_avg.defined() && !s.exp_avg_sq.defined()) {
      q = zero_quantized_moments(param);
    } else {
      const auto zeros = at::zeros_like(param, param.options().dtype(at::kFloat));
      q = quantize_moments(param, s.exp_avg.defined() ? s.exp_avg : zeros,
                           s.exp_avg_sq.defined() ? s.exp_avg_sq : zeros);
    }
    s.exp_avg = std::move(q.exp_avg);
    s.exp_avg_sq = std::move(q.exp_avg_sq);
    s.moment_scales = std::move(q.scales);
    return;
  }
  if (held_codes) {
    std::tie(s.exp_avg, s.exp_avg_sq) =
        dequantize_moments(param, {s.exp_avg, s.exp_avg_sq, s.moment_scales});
  }
  s.moment_scales = at::Tensor();
}

// SGD's momentum buffer in the format a step needs: int8 codes with their scales where
// `codes`, quantized from the values held (zeros where none: a first step overwrites them);
// FP32 values otherwise, dequantized from codes held (the caller casts them to state_dtype).
void convert_buffer_format(const at::Tensor& param, bool codes, ParamState& s) {
  const bool held_codes =
      s.momentum_buffer.defined() && s.momentum_buffer.scalar_type() == at::kChar;
  if (codes) {
    if (held_codes) {
      return;  // from_dict checked that codes come with their scales
    }
    QuantizedMoments q =
        s.momentum_buffer.defined()
            ? quantize_moments(param, s.momentum_buffer, /*exp_avg_sq=*/at::Tensor())
            : zero_quantized_moments(param, /*with_exp_avg_sq=*/false);
    s.momentum_buffer = std::move(q.exp_avg);
    s.momentum_scales = std::move(q.scales);
    return;
  }
  if (held_codes) {
    s.momentum_buffer =
        dequantize_moments(param, {s.momentum_buffer, at::Tensor(), s.momentum_scales}).first;
  }
  s.momentum_scales = at::Tensor();
}

}  // namespace

void ParamStateStore::convert(const at::Tensor& param, MasterWeights mode,
                              at::ScalarType state_dtype, StateSlots slots, ParamState& s) {
  if (!s.step.defined()) {
    s.step = at::zeros({}, param.options().dtype(at::kFloat));
  }
  convert_weight_store(param, mode, s);
  const bool codes = state_dtype == at::kChar;
  if (slots.has(StateSlot::kExpAvg) || s.moment_scales.defined()) {
    convert_moment_format(param, codes, s);
  }
  if (slots.has(StateSlot::kMomentumBuffer) || s.momentum_scales.defined()) {
    convert_buffer_format(param, codes, s);
  }
  for (const auto& info : kStateSlots) {
    // The scales come and go with their codes' format (convert_moment_format and
    // convert_buffer_format).
    if (is_weight_store_slot(info.slot) || !slots.has(info.slot) ||
        is_block_scales_slot(info.slot)) {
      continue;
    }
    if (codes) {
      // The codes and their scales are in place; no other state has an 8-bit format.
      TORCH_CHECK_VALUE(info.slot == StateSlot::kExpAvg || info.slot == StateSlot::kExpAvgSq ||
                            info.slot == StateSlot::kMomentumBuffer,
                        "fusedamp::optim: state_dtype int8 is for Adam's moments and SGD's "
                        "momentum buffer, not '", info.name, "'");
      continue;
    }
    at::Tensor& t = s.*info.member;
    if (!t.defined()) {
      t = at::zeros_like(param, param.options().dtype(state_dtype));
    } else if (t.scalar_type() != state_dtype) {
      auto converted = at::empty_like(param, param.options().dtype(state_dtype));
      converted.copy_(t);
      t = std::move(converted);
    }
  }
}

}  // namespace fusedamp::optim::detail

namespace fusedamp::optim {

std::vector<int64_t> moment_scales_shape(const at::Tensor& param) {
  return detail::block_scales_shape(param, 2);
}

std::vector<int64_t> momentum_scales_shape(const at::Tensor& param) {
  return detail::block_scales_shape(param, 1);
}

ConvertedParamState convert_param_state(const at::Tensor& weight,
                                        const StateDict& state, MasterWeights mode,
                                        at::ScalarType state_dtype, size_t index) {
  TORCH_CHECK_VALUE(state_dtype == at::kFloat || state_dtype == at::kBFloat16 ||
                        state_dtype == at::kChar,
                    "fusedamp::optim::convert_param_state: state_dtype must be float32, "
                    "bfloat16 or int8, got ", state_dtype);
  TORCH_CHECK_VALUE(mode.fits(weight.scalar_type()), "fusedamp::optim::convert_param_state: "
                    "master_weights=", mode.name(), " keeps ", master_mode_dtypes(mode.info()),
                    " weights, but parameter ", index, " is ", weight.scalar_type());
  at::NoGradGuard no_grad;
  ConvertedParamState out;
  out.weight = weight.detach().clone(at::MemoryFormat::Preserve);
  // Every slot is known here: a state of any optimizer kind converts (its moments kept).
  StateSlots present;
  for (const auto& info : kStateSlots) {
    present = present.with(info.slot);
  }
  ParamState s = detail::ParamStateStore::from_dict("convert_param_state", out.weight, index,
                                                    state, present, /*copy=*/true);
  StateSlots moments;
  for (const auto& info : kStateSlots) {
    if (!is_weight_store_slot(info.slot) && (s.*info.member).defined()) {
      moments = moments.with(info.slot);
    }
  }
  detail::ParamStateStore::convert(out.weight, mode, state_dtype, moments, s);
  out.state = detail::ParamStateStore::to_dict(s);
  return out;
}


}  // namespace fusedamp::optim
