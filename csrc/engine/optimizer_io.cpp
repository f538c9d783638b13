// The optimizer's state seen from outside: per-parameter state dicts (the tensors themselves)
// and serialisation through torch's archives. Every load is checked completely before anything
// is replaced.
#include <fusedamp/optim/optimizer.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <string>

#include "bucket_plan.h"
#include "device_stats.h"
#include "master_weights.h"
#include "param_state_store.h"

namespace fusedamp::optim {
namespace {

std::string group_key(size_t i) {
  return "param_group_" + std::to_string(i);
}

}  // namespace

std::vector<at::Tensor> Optimizer::all_params() const {
  std::vector<at::Tensor> out;
  for (const auto& g : param_groups_) {
    out.insert(out.end(), g.params().begin(), g.params().end());
  }
  return out;
}

Optimizer::StateDict Optimizer::param_state(const at::Tensor& param) const {
  const ParamState* s = states_->find(param);
  return s == nullptr ? StateDict() : detail::ParamStateStore::to_dict(*s);
}

at::Tensor Optimizer::master_weight(const at::Tensor& param) const {
  const ParamState* s = states_->find(param);
  if (s == nullptr) {
    return at::Tensor();
  }
  if (s->master_param.defined()) {
    return s->master_param;
  }
  at::NoGradGuard no_grad;
  if (s->param_remainder.defined() && param.scalar_type() == at::kBFloat16) {
    return detail::fp32_from_split(param, s->param_remainder);
  }
  if (s->kahan_compensation.defined()) {
    return detail::fp32_from_kahan(param, s->kahan_compensation);
  }
  return at::Tensor();
}

void Optimizer::set_param_state(const at::Tensor& param, const StateDict& state, bool copy) {
  at::NoGradGuard no_grad;
  const auto params = all_params();
  size_t index = 0;
  while (index < params.size() &&
         params[index].unsafeGetTensorImpl() != param.unsafeGetTensorImpl()) {
    ++index;
  }
  TORCH_CHECK(index < params.size(), "fusedamp::optim::", kind(),
              ": set_param_state: the tensor is not a parameter of this optimizer");
  states_->set(param, detail::ParamStateStore::from_dict(kind(), param, index, state,
                                                         known_slots(), copy));
  plan_->invalidate();
}

void Optimizer::load_param_states(const std::vector<at::Tensor>& params,
                                  const std::vector<StateDict>& states) {
  TORCH_CHECK(params.size() == states.size(), "fusedamp::optim::", kind(),
              ": load_param_states got ", params.size(), " parameters and ", states.size(),
              " states");
  at::NoGradGuard no_grad;
  std::unordered_map<const c10::TensorImpl*, size_t> index_of;
  for (const auto& p : all_params()) {
    index_of.emplace(p.unsafeGetTensorImpl(), index_of.size());
  }
  std::unordered_map<const c10::TensorImpl*, ParamState> fresh;
  for (size_t k = 0; k < params.size(); ++k) {
    const auto it = index_of.find(params[k].unsafeGetTensorImpl());
    TORCH_CHECK(it != index_of.end(), "fusedamp::optim::", kind(),
                ": load_param_states: entry ", k, " is not a parameter of this optimizer");
    fresh[params[k].unsafeGetTensorImpl()] = detail::ParamStateStore::from_dict(
        kind(), params[k], it->second, states[k], known_slots(), /*copy=*/true);
  }
  states_->replace_all(std::move(fresh));  // everything is checked: commit
  plan_->invalidate();
}

void Optimizer::set_skipped_steps(const at::Tensor& count) {
  TORCH_CHECK(count.numel() == 1 && !count.is_floating_point() && !count.is_complex(),
              "fusedamp::optim::", kind(), ": skipped_steps must be one integer, got ",
              count.scalar_type(), " with ", count.numel(), " elements");
  const auto params = all_params();
  TORCH_CHECK(!params.empty(), "fusedamp::optim::", kind(), ": no parameters");
  const auto device = params.front().device();
  skipped_steps_ = count.to(device, at::kLong).reshape({1}).clone();
  last_step_applied_ = at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(device));
}

void Optimizer::save(torch::serialize::OutputArchive& archive) const {
  archive.write("fusedamp_optimizer", c10::IValue(std::string(kind())));
  archive.write("num_param_groups", c10::IValue(static_cast<int64_t>(param_groups_.size())));
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    torch::serialize::OutputArchive g(archive.compilation_unit());
    param_groups_[i].options().serialize(g);
    g.write("num_params", c10::IValue(static_cast<int64_t>(param_groups_[i].params().size())));
    archive.write(group_key(i), g);
  }
  torch::serialize::OutputArchive st(archive.compilation_unit());
  size_t k = 0;
  for (const auto& p : all_params()) {
    const StateDict d = param_state(p);
    if (!d.empty()) {
      torch::serialize::OutputArchive ps(archive.compilation_unit());
      for (const auto& [name, t] : d) {
        // Each its own storage: a small parameter's state tensors are views of one block
        // (param_state_store.cpp), and the archive writes a shared storage once, in the dtype
        // of the first tensor it meets, so a loaded int16 remainder or int8 code came back as
        // float.
        ps.write(name, t.to(at::kCPU).clone(), /*is_buffer=*/true);
      }
      st.write(std::to_string(k), ps);
    }
    ++k;
  }
  archive.write("state", st);
  if (skipped_steps_.defined()) {
    archive.write("skipped_steps", skipped_steps_.to(at::kCPU), /*is_buffer=*/true);
    archive.write("last_step_applied", last_step_applied_.to(at::kCPU), /*is_buffer=*/true);
  }
}

void Optimizer::load(torch::serialize::InputArchive& archive) {
  at::NoGradGuard no_grad;
  c10::IValue v;
  TORCH_CHECK(archive.try_read("fusedamp_optimizer", v), "fusedamp::optim::", kind(),
              ": load: the archive holds no fusedamp optimizer state");
  TORCH_CHECK(v.toStringRef() == kind(), "fusedamp::optim::", kind(),
              ": load: the archive holds the state of a ", v.toStringRef(), " optimizer");
  archive.read("num_param_groups", v);
  TORCH_CHECK(v.toInt() == static_cast<int64_t>(param_groups_.size()), "fusedamp::optim::",
              kind(), ": load: the archive has ", v.toInt(), " param groups, this optimizer ",
              param_groups_.size());
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options;
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    torch::serialize::InputArchive g;
    archive.read(group_key(i), g);
    auto o = make_options();
    o->serialize(g);
    g.read("num_params", v);
    TORCH_CHECK(v.toInt() == static_cast<int64_t>(param_groups_[i].params().size()),
                "fusedamp::optim::", kind(), ": load: param group ", i, " has ", v.toInt(),
                " parameters in the archive but ", param_groups_[i].params().size(), " here");
    check_group(*o, i);
    options.push_back(std::move(o));
  }
  torch::serialize::InputArchive st;
  archive.read("state", st);
  std::unordered_map<const c10::TensorImpl*, ParamState> fresh;
  const auto params = all_params();
  for (size_t k = 0; k < params.size(); ++k) {
    torch::serialize::InputArchive ps;
    if (!st.try_read(std::to_string(k), ps)) {
      continue;
    }
    StateDict d;
    const auto take = [&](const char* name) {
      at::Tensor t;  // a fresh handle each time: try_read set_()s a defined tensor in place
      if (ps.try_read(name, t, /*is_buffer=*/true)) {
        d.emplace(name, t);
      }
    };
    take(kStep);
    for (const auto& info : kStateSlots) {
      take(info.name);
    }
    fresh[params[k].unsafeGetTensorImpl()] = detail::ParamStateStore::from_dict(
        kind(), params[k], k, d, known_slots(), /*copy=*/true);
  }
  at::Tensor skipped, applied;
  const bool has_counters = archive.try_read("skipped_steps", skipped, true) &&
                            archive.try_read("last_step_applied", applied, true);
  // Everything is checked: commit.
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    param_groups_[i].set_options(std::move(options[i]));
  }
  states_->replace_all(std::move(fresh));
  if (has_counters && !params.empty()) {
    const auto d = params.front().device();
    skipped_steps_ = skipped.to(d, at::kLong).clone();
    last_step_applied_ = applied.to(d, at::kFloat).clone();
  }
  stats_->invalidate();
  plan_->invalidate();
}

}  // namespace fusedamp::optim
