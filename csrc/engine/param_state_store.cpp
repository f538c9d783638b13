// fusedamp::optim::detail::ParamStateStore (see param_state_store.h); the conversion of a
// state between modes and formats (ParamStateStore::convert) is state_conversion.cpp.
#include "param_state_store.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "quantized_moments.h"

#include <string>
#include <vector>

namespace fusedamp::optim::detail {
namespace {

// A tensor of `dtype` with p's shape and strides on p's device holding `src`'s values.
at::Tensor copy_like(const at::Tensor& p, const at::Tensor& src, at::ScalarType dtype) {
  auto t = at::empty_like(p, p.options().dtype(dtype));
  t.copy_(src);
  return t;
}

// The dtype a state tensor is kept in when copied from a state dict: the remainder int16, the
// compensation the weight's dtype, moments and buffers their own if FP32 or BF16 (the next
// step converts them to the group's state_dtype), everything else FP32.
at::ScalarType kept_dtype(const std::string& name, const at::Tensor& p, const at::Tensor& t) {
  if (name == kParamRemainder) {  // of a mode keeping remainders of t's dtype; else int16
    const MasterModeInfo* mode = master_mode_keeping(t.scalar_type(), at::kBFloat16);
    return mode != nullptr && mode->kept == MasterKept::kRemainder ? t.scalar_type()
                                                                   : at::kShort;
  }
  // 8-bit codes stay codes (their moment_scales / momentum_scales FP32, below).
  if (((name == kExpAvg || name == kMomentumBuffer) && t.scalar_type() == at::kChar) ||
      (name == kExpAvgSq && t.scalar_type() == at::kByte)) {
    return t.scalar_type();
  }
  if (name == kKahanCompensation) {
    return p.scalar_type();
  }
  if (name != kMasterParam && t.scalar_type() == at::kBFloat16) {
    return at::kBFloat16;
  }
  return at::kFloat;
}

// The remainders the modes keep, for messages: "int16 ("split") beside a bfloat16 parameter
// or ...".
std::string remainder_formats() {
  std::vector<std::string> formats;
  for (const auto& info : kMasterModes) {
    if (info.spelling != nullptr && info.kept == MasterKept::kRemainder) {
      formats.push_back(c10::getDtypeNames(info.kept_dtype).first + " (" + info.spelling +
                        ") beside a " + master_mode_dtypes(info) + " parameter");
    }
  }
  return one_of(formats);
}

const StateSlotInfo* slot_named(const std::string& name) {
  for (const auto& info : kStateSlots) {
    if (name == info.name) {
      return &info;
    }
  }
  return nullptr;
}

}  // namespace

ParamState* ParamStateStore::find(const at::Tensor& param) {
  auto it = by_param_.find(param.unsafeGetTensorImpl());
  return it == by_param_.end() ? nullptr : &it->second;
}

const ParamState* ParamStateStore::find(const at::Tensor& param) const {
  auto it = by_param_.find(param.unsafeGetTensorImpl());
  return it == by_param_.end() ? nullptr : &it->second;
}


namespace {

// ---- the state of a small parameter in one block of memory -----------------------------------
// Each state tensor of its own is an allocation of its own: for a parameter of a few elements,
// the step's walk then reads one cache line per state tensor (four for AdamW with FP32
// masters: the step count, the master, two moments) where one would hold them all. With
// thousands of small parameters (biases, norms' weights) those lines were a fifth of a whole
// AMP step's host time (perf). So the state a parameter's first step creates is moved into
// one block when the parameter is small: the tensors become views of it (same values, dtypes,
// shapes and strides; each its own bytes, 16-byte aligned for vector loads), which is all a
// user sees of the change: their `untyped_storage()` is the block (a state dict saved with
// torch.save and loaded again holds tensors of their own). State loaded by copy (a resumed
// run) is packed the same way, so a resumed run walks what an uninterrupted one does. A state
// tensor replaced later (a conversion of its dtype) is a tensor of its own again. Larger
// parameters keep one allocation per tensor: their lines are their elements, and moving them
// would briefly hold their state twice.
constexpr int64_t kPackedMaxNumel = 4096;
constexpr int64_t kPackedAlignBytes = 16;

int64_t packed_bytes(const at::Tensor& t) {
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  return (bytes + kPackedAlignBytes - 1) / kPackedAlignBytes * kPackedAlignBytes;
}

void pack_small_state(const at::Tensor& param, ParamState& s) {
  if (param.numel() > kPackedMaxNumel) {
    return;
  }
  std::vector<at::Tensor*> parts{&s.step};
  for (const auto& info : kStateSlots) {
    if ((s.*info.member).defined()) {
      parts.push_back(&(s.*info.member));
    }
  }
  int64_t total = 0;
  for (const at::Tensor* t : parts) {
    if (t->device() != param.device() || t->layout() != at::kStrided ||
        !t->is_non_overlapping_and_dense()) {
      return;
    }
    total += packed_bytes(*t);
  }
  const auto block = at::empty({total}, param.options().dtype(at::kByte));
  int64_t offset = 0;
  for (at::Tensor* t : parts) {
    auto view = at::empty({0}, t->options());
    view.set_(block.storage(), offset / static_cast<int64_t>(t->element_size()), t->sizes(),
              t->strides());
    view.copy_(*t);
    offset += packed_bytes(*t);
    *t = std::move(view);
  }
}

}  // namespace

ParamState& ParamStateStore::ensure(const at::Tensor& param, MasterWeights mode,
                                    at::ScalarType state_dtype, StateSlots slots) {
  auto& s = by_param_[param.unsafeGetTensorImpl()];
  const bool first = !s.step.defined();
  convert(param, mode, state_dtype, slots, s);
  if (first) {
    pack_small_state(param, s);
  }
  return s;
}

StateDict ParamStateStore::to_dict(const ParamState& state) {
  StateDict d;
  d.emplace(kStep, state.step);
  for (const auto& info : kStateSlots) {
    if ((state.*info.member).defined()) {
      d.emplace(info.name, state.*info.member);
    }
  }
  return d;
}

ParamState ParamStateStore::from_dict(const char* who, const at::Tensor& p, size_t index,
                                      const StateDict& dict, StateSlots known, bool copy) {
  for (const auto& [name, t] : dict) {
    const StateSlotInfo* info = slot_named(name);
    // Every kind keeps a weight store (its slot is the mode's, converted at the next step).
    TORCH_CHECK(name == kStep || (info != nullptr && (known.has(info->slot) ||
                                                      is_weight_store_slot(info->slot))),
                "fusedamp::optim::", who, ": unknown state '", name, "' for parameter ", index);
    if (name == kParamRemainder) {
      const MasterModeInfo* mode =
          t.defined() ? master_mode_keeping(t.scalar_type(), p.scalar_type()) : nullptr;
      TORCH_CHECK(mode != nullptr && t.layout() == at::kStrided &&
                      mode->kept == MasterKept::kRemainder &&
                      master_mode_fits(*mode, p.scalar_type()),
                  "fusedamp::optim::", who, ": state '", name, "' of parameter ", index,
                  " must be a dense tensor: ", remainder_formats());
    } else if (name == kMomentumBuffer && t.defined() && t.scalar_type() == at::kChar) {
      // An 8-bit momentum buffer: codes with their scales.
      TORCH_CHECK(t.layout() == at::kStrided && dict.count(kMomentumScales) == 1,
                  "fusedamp::optim::", who, ": state 'momentum_buffer' of parameter ", index,
                  " is 8-bit codes; state_dtype int8 keeps them with their 'momentum_scales'");
    } else if (name == kMomentumScales) {
      const auto b = dict.find(kMomentumBuffer);
      TORCH_CHECK(t.defined() && t.layout() == at::kStrided && t.scalar_type() == at::kFloat &&
                      has_block_scale_shape(p, t, 1) && b != dict.end() &&
                      b->second.scalar_type() == at::kChar,
                  "fusedamp::optim::", who, ": state 'momentum_scales' of parameter ", index,
                  " must be a float32 tensor of shape ", at::IntArrayRef(block_scales_shape(p, 1)),
                  " beside int8 'momentum_buffer' codes, got ", t.scalar_type(), " of shape ",
                  t.sizes());
    } else if (t.defined() && (kept_dtype(name, p, t) == at::kChar ||
                               kept_dtype(name, p, t) == at::kByte)) {
      // 8-bit moments: the codes of exp_avg and exp_avg_sq and their scales, together.
      const auto sq = dict.find(kExpAvgSq);
      const auto m = dict.find(kExpAvg);
      const auto scales = dict.find(kMomentScales);
      TORCH_CHECK(t.layout() == at::kStrided && m != dict.end() && sq != dict.end() &&
                      m->second.scalar_type() == at::kChar &&
                      sq->second.scalar_type() == at::kByte && scales != dict.end(),
                  "fusedamp::optim::", who, ": state '", name, "' of parameter ", index,
                  " is 8-bit codes; state_dtype int8 keeps int8 'exp_avg', uint8 'exp_avg_sq' "
                  "and their 'moment_scales' together");
    } else if (name == kMomentScales) {
      const auto m = dict.find(kExpAvg);
      TORCH_CHECK(t.defined() && t.layout() == at::kStrided && t.scalar_type() == at::kFloat &&
                      has_block_scale_shape(p, t) && m != dict.end() &&
                      m->second.scalar_type() == at::kChar,
                  "fusedamp::optim::", who, ": state 'moment_scales' of parameter ", index,
                  " must be a float32 tensor of shape ", at::IntArrayRef(block_scales_shape(p)),
                  " beside int8 'exp_avg' codes, got ", t.scalar_type(), " of shape ",
                  t.sizes());
    } else {
      TORCH_CHECK(t.defined() && t.layout() == at::kStrided && t.is_floating_point(),
                  "fusedamp::optim::", who, ": state '", name, "' of parameter ", index,
                  " must be a dense floating-point tensor");
    }
    if (name == kKahanCompensation) {
      TORCH_CHECK(p.scalar_type() == at::kHalf || p.scalar_type() == at::kBFloat16,
                  "fusedamp::optim::", who, ": state '", name, "' of parameter ", index,
                  " belongs beside a float16 or bfloat16 parameter, not ", p.scalar_type());
    }
    if (name == kStep) {
      TORCH_CHECK(t.numel() == 1, "fusedamp::optim::", who, ": state 'step' of parameter ",
                  index, " must have one element, got ", t.numel());
    } else if (name == kMomentScales || name == kMomentumScales) {
      TORCH_CHECK(copy || t.is_contiguous(), "fusedamp::optim::", who, ": state '", name,
                  "' of parameter ", index,
                  " cannot be kept without a copy: it must be contiguous");
    } else {
      TORCH_CHECK(t.sizes() == p.sizes(), "fusedamp::optim::", who, ": state '", name,
                  "' of parameter ", index, " has shape ", t.sizes(),
                  " but the parameter has ", p.sizes());
    }
    if (!copy) {
      // Kept as they are, so they must already be what a fused op walks beside `p`.
      TORCH_CHECK(t.scalar_type() == kept_dtype(name, p, t) && t.device() == p.device() &&
                      (name == kStep || name == kMomentScales || name == kMomentumScales ||
                       p.numel() <= 1 ||
                       t.strides() == p.strides()),
                  "fusedamp::optim::", who, ": state '", name, "' of parameter ", index,
                  " cannot be kept without a copy: it must be ", kept_dtype(name, p, t),
                  " on ", p.device(), " with the parameter's strides");
    }
  }
  TORCH_CHECK(dict.count(kStep) == 1, "fusedamp::optim::", who, ": state of parameter ",
              index, " has no 'step'");
  ParamState s;
  for (const auto& [name, t] : dict) {
    if (name == kStep) {
      if (copy) {
        s.step = at::empty({}, p.options().dtype(at::kFloat));
        s.step.copy_(t.reshape({}));
      } else {
        s.step = t.reshape({});
      }
    } else if (name == kMomentScales || name == kMomentumScales) {
      // Kept in the parameter's own shape of scales (the same blocks either way).
      const bool moments = name == kMomentScales;
      (moments ? s.moment_scales : s.momentum_scales) =
          (copy ? t.to(p.device(), at::kFloat, /*non_blocking=*/false, /*copy=*/true)
                      .contiguous()
                : t)
              .view(block_scales_shape(p, moments ? 2 : 1));
    } else {
      s.*(slot_named(name)->member) = copy ? copy_like(p, t, kept_dtype(name, p, t)) : t;
    }
  }
  if (copy) {
    pack_small_state(p, s);  // the copies are the store's own: laid out as a first step's
  }
  return s;
}

void ParamStateStore::set(const at::Tensor& param, ParamState state) {
  by_param_[param.unsafeGetTensorImpl()] = std::move(state);
}

void ParamStateStore::replace_all(std::unordered_map<const c10::TensorImpl*, ParamState> states) {
  by_param_ = std::move(states);
}

}  // namespace fusedamp::optim::detail

