// fusedamp::optim::detail::ParamStateStore (see param_state_store.h).
#include "param_state_store.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace fusedamp::optim::detail {
namespace {

// An FP32 tensor with p's shape and strides on p's device holding `src`'s values.
at::Tensor fp32_like(const at::Tensor& p, const at::Tensor& src) {
  auto t = at::empty_like(p, p.options().dtype(at::kFloat));
  t.copy_(src);
  return t;
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

ParamState& ParamStateStore::ensure(const at::Tensor& param, bool want_master,
                                    StateSlots slots) {
  auto& s = by_param_[param.unsafeGetTensorImpl()];
  if (!s.step.defined()) {
    s.step = at::zeros({}, param.options().dtype(at::kFloat));
  }
  if (want_master && !s.master_param.defined()) {
    s.master_param = fp32_like(param, param.detach());
  } else if (!want_master) {
    s.master_param = at::Tensor();
  }
  for (const auto& info : kStateSlots) {
    if (info.slot != StateSlot::kMasterParam && slots.has(info.slot) &&
        !(s.*info.member).defined()) {
      s.*info.member = at::zeros_like(param, param.options().dtype(at::kFloat));
    }
  }
  return s;
}

Optimizer::StateDict ParamStateStore::to_dict(const ParamState& state) {
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
    TORCH_CHECK(name == kStep || (info != nullptr && known.has(info->slot)),
                "fusedamp::optim::", who, ": unknown state '", name, "' for parameter ", index);
    TORCH_CHECK(t.defined() && t.layout() == at::kStrided && t.is_floating_point(),
                "fusedamp::optim::", who, ": state '", name, "' of parameter ", index,
                " must be a dense floating-point tensor");
    if (name == kStep) {
      TORCH_CHECK(t.numel() == 1, "fusedamp::optim::", who, ": state 'step' of parameter ",
                  index, " must have one element, got ", t.numel());
    } else {
      TORCH_CHECK(t.sizes() == p.sizes(), "fusedamp::optim::", who, ": state '", name,
                  "' of parameter ", index, " has shape ", t.sizes(),
                  " but the parameter has ", p.sizes());
    }
    if (!copy) {
      // Kept as they are, so they must already be what a fused op walks beside `p`.
      TORCH_CHECK(t.scalar_type() == at::kFloat && t.device() == p.device() &&
                      (name == kStep || p.numel() <= 1 || t.strides() == p.strides()),
                  "fusedamp::optim::", who, ": state '", name, "' of parameter ", index,
                  " cannot be kept without a copy: it must be float32 on ", p.device(),
                  " with the parameter's strides");
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
    } else {
      s.*(slot_named(name)->member) = copy ? fp32_like(p, t) : t;
    }
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
