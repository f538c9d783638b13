// The step orchestration of fusedamp's optimizers (see include/fusedamp/optim/optimizer.h).
#include <fusedamp/optim/optimizer.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <cmath>
#include <string>

namespace fusedamp::optim {

namespace detail {

void check_engine_options(const char* who, const EngineGroupOptions& e, size_t group) {
  if (e.max_grad_norm) {
    TORCH_CHECK(std::isfinite(*e.max_grad_norm) && *e.max_grad_norm > 0.0, who,
                ": invalid max_grad_norm ", *e.max_grad_norm, " in param group ", group,
                " (must be finite and > 0, or unset)");
  }
  if (e.lr_tensor.defined()) {
    const auto& t = e.lr_tensor;
    TORCH_CHECK(t.layout() == at::kStrided && t.numel() == 1 && t.scalar_type() == at::kFloat,
                who, ": lr_tensor of param group ", group,
                " must be a dense float32 tensor with one element, got ", t.scalar_type(),
                " with ", t.numel(), " elements");
  }
}

std::optional<double> norm_option(double v) {
  if (std::isnan(v) || v <= 0.0) {
    return std::nullopt;
  }
  return v;
}

}  // namespace detail

namespace {

bool is_float_kind(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

int64_t device_code(const c10::Device& d) {
  return static_cast<int64_t>(d.type()) * 1024 + d.index();
}

// An FP32 tensor with p's shape and strides on p's device holding `src`'s values.
at::Tensor state_like(const at::Tensor& p, const at::Tensor& src) {
  auto t = at::empty_like(p, p.options().dtype(at::kFloat));
  t.copy_(src);
  return t;
}

}  // namespace

Optimizer::Optimizer(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                     std::unique_ptr<torch::optim::OptimizerOptions> defaults)
    : torch::optim::Optimizer(groups, std::move(defaults)) {}

void Optimizer::check_all_options() const {
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    TORCH_CHECK(param_groups_[i].has_options(), "fusedamp::optim::", kind(), ": param group ",
                i, " has no options");
    check_options(param_groups_[i].options(), i);
  }
}

void Optimizer::check_grad(const at::Tensor& p, const at::Tensor& g, size_t group,
                           size_t index) const {
  const auto where = [&] {
    return std::string(" (param group ") + std::to_string(group) + ", parameter " +
           std::to_string(index) + ")";
  };
  TORCH_CHECK(p.layout() == at::kStrided && p.is_non_overlapping_and_dense(),
              "fusedamp::optim::", kind(), ": parameters must be dense tensors without gaps or "
              "overlap (e.g. contiguous)", where());
  TORCH_CHECK(is_float_kind(p.scalar_type()), "fusedamp::optim::", kind(),
              ": parameter dtype ", p.scalar_type(),
              " is not supported (float32, float16, bfloat16)", where());
  TORCH_CHECK(g.layout() == at::kStrided, "fusedamp::optim::", kind(),
              ": sparse gradients are not supported", where());
  TORCH_CHECK(g.device() == p.device(), "fusedamp::optim::", kind(), ": gradient is on ",
              g.device(), " but the parameter is on ", p.device(), where());
  TORCH_CHECK(g.sizes() == p.sizes(), "fusedamp::optim::", kind(), ": gradient shape ",
              g.sizes(), " differs from the parameter's ", p.sizes(), where());
  TORCH_CHECK(g.scalar_type() == p.scalar_type() || g.scalar_type() == at::kFloat,
              "fusedamp::optim::", kind(), ": gradient dtype ", g.scalar_type(),
              " must be the parameter's (", p.scalar_type(), ") or float32", where());
  TORCH_CHECK(p.numel() <= 1 || g.strides() == p.strides(), "fusedamp::optim::", kind(),
              ": gradient strides ", g.strides(), " differ from the parameter's ", p.strides(),
              where());
}

size_t Optimizer::device_index(const c10::Device& d) {
  for (size_t i = 0; i < devices_.size(); ++i) {
    if (devices_[i].device == d) {
      return i;
    }
  }
  DeviceStats s;
  s.device = d;
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(d);
  s.found_inf = at::zeros({1}, f32);
  s.sum_sq = at::zeros({1}, f32);
  devices_.push_back(std::move(s));
  return devices_.size() - 1;
}

Optimizer::ParamState* Optimizer::find_state(const at::Tensor& p) {
  auto it = pstate_.find(p.unsafeGetTensorImpl());
  return it == pstate_.end() ? nullptr : &it->second;
}

const Optimizer::ParamState* Optimizer::find_state(const at::Tensor& p) const {
  auto it = pstate_.find(p.unsafeGetTensorImpl());
  return it == pstate_.end() ? nullptr : &it->second;
}

void Optimizer::ensure_state(const at::Tensor& p, bool want_master, int slots) {
  auto& s = pstate_[p.unsafeGetTensorImpl()];
  const auto f32 = p.options().dtype(at::kFloat);
  if (!s.step.defined()) {
    s.step = at::zeros({}, f32);
  }
  if (want_master && !s.master.defined()) {
    s.master = state_like(p, p.detach());
  } else if (!want_master) {
    s.master = at::Tensor();
  }
  if (slots >= 1 && !s.a.defined()) {
    s.a = at::zeros_like(p, f32);
  }
  if (slots >= 2 && !s.b.defined()) {
    s.b = at::zeros_like(p, f32);
  }
}

bool Optimizer::prepare() {
  check_all_options();
  std::vector<SigEntry> sig;
  sig.reserve(signature_.size());
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    const auto& o = param_groups_[gi].options();
    const auto e = engine_options(o);
    sig.push_back({nullptr, static_cast<int64_t>(gi), e.master_weights ? 1 : 0,
                   slots_needed(o)});
    const auto& params = param_groups_[gi].params();
    for (size_t j = 0; j < params.size(); ++j) {
      const auto& p = params[j];
      const auto& g = p.grad();
      if (!g.defined()) {
        continue;
      }
      check_grad(p, g, gi, j);
      sig.push_back({p.unsafeGetTensorImpl(), static_cast<int64_t>(p.scalar_type()),
                     static_cast<int64_t>(g.scalar_type()), device_code(p.device())});
    }
  }
  if (!buckets_valid_ || !(sig == signature_)) {
    signature_ = std::move(sig);
    build_buckets();
    buckets_valid_ = true;
  }
  collect_grads();
  return !buckets_.empty();
}

void Optimizer::build_buckets() {
  ++bucket_builds_;
  buckets_.clear();
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    const auto& o = param_groups_[gi].options();
    const auto e = engine_options(o);
    const int slots = slots_needed(o);
    const size_t first = buckets_.size();
    for (const auto& p : param_groups_[gi].params()) {
      const auto& g = p.grad();
      if (!g.defined()) {
        continue;
      }
      const bool want_master = e.master_weights && p.scalar_type() != at::kFloat;
      ensure_state(p, want_master, slots);
      const auto& s = pstate_.at(p.unsafeGetTensorImpl());
      Bucket* b = nullptr;
      for (size_t k = first; k < buckets_.size(); ++k) {
        auto& c = buckets_[k];
        if (c.device == p.device() && c.param_dtype == p.scalar_type() &&
            c.grads.front().scalar_type() == g.scalar_type()) {
          b = &c;
          break;
        }
      }
      if (b == nullptr) {
        buckets_.emplace_back();
        b = &buckets_.back();
        b->group = gi;
        b->device = p.device();
        b->dev = device_index(p.device());
        b->param_dtype = p.scalar_type();
      }
      b->params.push_back(p);
      b->grads.push_back(g);  // only as the bucket's grad dtype key; refreshed every step
      if (want_master) {
        b->masters.push_back(s.master);
      }
      b->steps.push_back(s.step);
      if (slots >= 1) {
        b->a.push_back(s.a);
      }
      if (slots >= 2) {
        b->b.push_back(s.b);
      }
    }
  }
  if (!buckets_.empty() && !last_step_applied_.defined()) {
    const auto d = devices_.front().device;
    last_step_applied_ = at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(d));
    skipped_steps_ = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(d));
  }
}

void Optimizer::collect_grads() {
  for (auto& d : devices_) {
    d.grads.clear();
  }
  for (auto& b : buckets_) {
    b.grads.clear();
    auto& dg = devices_[b.dev].grads;
    for (const auto& p : b.params) {
      b.grads.push_back(p.grad());
      dg.push_back(b.grads.back());
    }
  }
}

void Optimizer::combine_stats(bool found, bool sum_sq) {
  if (devices_.size() < 2) {
    return;
  }
  auto& primary = devices_.front();
  for (size_t i = 1; i < devices_.size(); ++i) {
    if (found) {
      primary.found_inf.add_(devices_[i].found_inf.to(primary.device));
    }
    if (sum_sq) {
      primary.sum_sq.add_(devices_[i].sum_sq.to(primary.device));
    }
  }
  for (size_t i = 1; i < devices_.size(); ++i) {
    if (found) {
      devices_[i].found_inf.copy_(primary.found_inf);
    }
    if (sum_sq) {
      devices_[i].sum_sq.copy_(primary.sum_sq);
    }
  }
}

void Optimizer::run_grad_stats(bool reset_found_inf) {
  for (auto& d : devices_) {
    if (reset_found_inf) {
      d.found_inf.zero_();
    }
    d.sum_sq.zero_();
    if (!d.grads.empty()) {
      ops::grad_stats_(d.grads, d.found_inf, d.sum_sq);
    }
  }
  combine_stats(true, true);
  found_valid_ = true;
  sumsq_valid_ = true;
}

at::Tensor Optimizer::on_device(const at::Tensor& t, const c10::Device& d) const {
  return t.device() == d ? t : t.to(d, /*non_blocking=*/true);
}

void Optimizer::run_buckets(const std::optional<at::Tensor>& inv_scale, bool scaled) {
  std::vector<at::Tensor> inv(devices_.size());
  bool checked = false;
  for (const auto& b : buckets_) {
    const auto& o = param_groups_[b.group].options();
    const auto e = engine_options(o);
    ops::StepScalars s;
    if (inv_scale && inv_scale->defined()) {
      if (!inv[b.dev].defined()) {
        inv[b.dev] = on_device(*inv_scale, b.device);
      }
      s.inv_scale = inv[b.dev];
    }
    if (found_valid_ && (scaled || e.skip_nonfinite)) {
      s.found_inf = devices_[b.dev].found_inf;
      checked = true;
    }
    if (e.max_grad_norm) {
      TORCH_INTERNAL_ASSERT(sumsq_valid_, "clipping without a grad_stats_ pass");
      s.grad_sum_sq = devices_[b.dev].sum_sq;
      s.max_grad_norm = e.max_grad_norm;
    }
    if (e.lr_tensor.defined()) {
      s.lr_tensor = on_device(e.lr_tensor, b.device);
    }
    run_step(b, o, s);
  }
  if (checked) {
    const auto skipped = devices_.front().found_inf.ne(0);
    skipped_steps_.add_(skipped);
    last_step_applied_.copy_(skipped.logical_not());
  } else {
    last_step_applied_.fill_(1);
  }
  found_valid_ = false;
  sumsq_valid_ = false;
}

at::Tensor Optimizer::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  if (!prepare()) {
    return loss;
  }
  bool need_stats = false;
  for (const auto& g : param_groups_) {
    const auto e = engine_options(g.options());
    need_stats = need_stats || e.skip_nonfinite || e.max_grad_norm.has_value();
  }
  found_valid_ = false;
  sumsq_valid_ = false;
  if (need_stats) {
    run_grad_stats(true);
  }
  run_buckets(std::nullopt, /*scaled=*/false);
  return loss;
}

at::Tensor Optimizer::unscale_grads_(const at::Tensor& inv_scale) {
  at::NoGradGuard no_grad;
  found_valid_ = false;
  sumsq_valid_ = false;
  if (!prepare()) {
    return at::Tensor();
  }
  for (auto& d : devices_) {
    d.found_inf.zero_();
    if (!d.grads.empty()) {
      ops::unscale_and_check_(d.grads, d.found_inf, on_device(inv_scale, d.device));
    }
  }
  combine_stats(true, false);
  found_valid_ = true;
  return devices_.front().found_inf;
}

at::Tensor Optimizer::step_scaled(const at::Tensor& inv_scale, bool grads_unscaled) {
  at::NoGradGuard no_grad;
  const bool unscaled_here = grads_unscaled && found_valid_;
  TORCH_CHECK(!grads_unscaled || found_valid_, "fusedamp::optim::", kind(),
              ": step_scaled(grads_unscaled=true) needs unscale_grads_() first in this step");
  if (!prepare()) {
    found_valid_ = false;
    return at::Tensor();
  }
  bool clip = false;
  for (const auto& g : param_groups_) {
    clip = clip || engine_options(g.options()).max_grad_norm.has_value();
  }
  if (!unscaled_here) {
    run_grad_stats(true);
  } else if (clip) {
    run_grad_stats(false);  // sum of squares of the unscaled grads; found_inf accumulates
  }
  run_buckets(unscaled_here ? std::nullopt : std::optional<at::Tensor>(inv_scale),
              /*scaled=*/true);
  return devices_.front().found_inf;
}

at::Tensor Optimizer::found_inf() const {
  return devices_.empty() ? at::Tensor() : devices_.front().found_inf;
}

at::Tensor Optimizer::grad_sum_sq() const {
  return devices_.empty() ? at::Tensor() : devices_.front().sum_sq;
}

void Optimizer::set_group_lr(size_t group, double lr) {
  TORCH_CHECK(group < param_groups_.size(), "fusedamp::optim::", kind(), ": param group ",
              group, " does not exist (", param_groups_.size(), " groups)");
  param_groups_[group].options().set_lr(lr);
}

double Optimizer::group_lr(size_t group) const {
  TORCH_CHECK(group < param_groups_.size(), "fusedamp::optim::", kind(), ": param group ",
              group, " does not exist (", param_groups_.size(), " groups)");
  return param_groups_[group].options().get_lr();
}

std::vector<at::Tensor> Optimizer::all_params() const {
  std::vector<at::Tensor> out;
  for (const auto& g : param_groups_) {
    out.insert(out.end(), g.params().begin(), g.params().end());
  }
  return out;
}

Optimizer::StateDict Optimizer::param_state(const at::Tensor& param) const {
  StateDict d;
  const ParamState* s = find_state(param);
  if (s == nullptr) {
    return d;
  }
  const auto names = slot_names();
  d.emplace(kStep, s->step);
  if (s->master.defined()) {
    d.emplace(kMasterParam, s->master);
  }
  if (s->a.defined() && names.first != nullptr) {
    d.emplace(names.first, s->a);
  }
  if (s->b.defined() && names.second != nullptr) {
    d.emplace(names.second, s->b);
  }
  return d;
}

namespace {

// Checks `state` against parameter p and builds the FP32 copies (nothing is committed here).
template <typename ParamStateT>
ParamStateT make_state(const char* kind, const at::Tensor& p, size_t k,
                       const std::unordered_map<std::string, at::Tensor>& state,
                       std::pair<const char*, const char*> names) {
  ParamStateT s;
  for (const auto& kv : state) {
    const auto& name = kv.first;
    const auto& t = kv.second;
    const bool known = name == kStep || name == kMasterParam ||
                       (names.first && name == names.first) ||
                       (names.second && name == names.second);
    TORCH_CHECK(known, "fusedamp::optim::", kind, ": unknown state '", name, "' for parameter ",
                k);
    TORCH_CHECK(t.defined() && t.layout() == at::kStrided && t.is_floating_point(),
                "fusedamp::optim::", kind, ": state '", name, "' of parameter ", k,
                " must be a dense floating-point tensor");
    if (name == kStep) {
      TORCH_CHECK(t.numel() == 1, "fusedamp::optim::", kind, ": state 'step' of parameter ", k,
                  " must have one element, got ", t.numel());
    } else {
      TORCH_CHECK(t.sizes() == p.sizes(), "fusedamp::optim::", kind, ": state '", name,
                  "' of parameter ", k, " has shape ", t.sizes(), " but the parameter has ",
                  p.sizes());
    }
  }
  TORCH_CHECK(state.count(kStep) == 1, "fusedamp::optim::", kind,
              ": state of parameter ", k, " has no 'step'");
  for (const auto& kv : state) {
    const auto& name = kv.first;
    if (name == kStep) {
      s.step = at::empty({}, p.options().dtype(at::kFloat));
      s.step.copy_(kv.second.reshape({}));
    } else if (name == kMasterParam) {
      s.master = state_like(p, kv.second);
    } else if (names.first && name == names.first) {
      s.a = state_like(p, kv.second);
    } else {
      s.b = state_like(p, kv.second);
    }
  }
  return s;
}

std::string group_key(size_t i) {
  return "param_group_" + std::to_string(i);
}

}  // namespace

void Optimizer::set_param_state(const at::Tensor& param, const StateDict& state) {
  at::NoGradGuard no_grad;
  size_t k = 0;
  bool found = false;
  for (const auto& g : param_groups_) {
    for (const auto& p : g.params()) {
      if (p.unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) {
        found = true;
        break;
      }
      ++k;
    }
    if (found) {
      break;
    }
  }
  TORCH_CHECK(found, "fusedamp::optim::", kind(),
              ": set_param_state: the tensor is not a parameter of this optimizer");
  auto s = make_state<ParamState>(kind(), param, k, state, slot_names());
  pstate_[param.unsafeGetTensorImpl()] = std::move(s);
  invalidate();
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
      for (const auto& kv : d) {
        ps.write(kv.first, kv.second.to(at::kCPU), /*is_buffer=*/true);
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
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> opts;
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    torch::serialize::InputArchive g;
    archive.read(group_key(i), g);
    auto o = make_options();
    o->serialize(g);
    g.read("num_params", v);
    TORCH_CHECK(v.toInt() == static_cast<int64_t>(param_groups_[i].params().size()),
                "fusedamp::optim::", kind(), ": load: param group ", i, " has ", v.toInt(),
                " parameters in the archive but ", param_groups_[i].params().size(), " here");
    check_options(*o, i);
    opts.push_back(std::move(o));
  }
  torch::serialize::InputArchive st;
  archive.read("state", st);
  std::unordered_map<const c10::TensorImpl*, ParamState> fresh;
  const auto params = all_params();
  const auto names = slot_names();
  for (size_t k = 0; k < params.size(); ++k) {
    torch::serialize::InputArchive ps;
    if (!st.try_read(std::to_string(k), ps)) {
      continue;
    }
    StateDict d;
    for (const char* name : {kStep, kMasterParam, names.first, names.second}) {
      at::Tensor t;
      if (name != nullptr && ps.try_read(name, t, /*is_buffer=*/true)) {
        d.emplace(name, t);
      }
    }
    fresh[params[k].unsafeGetTensorImpl()] = make_state<ParamState>(kind(), params[k], k, d, names);
  }
  at::Tensor skipped, applied;
  const bool has_counters = archive.try_read("skipped_steps", skipped, true) &&
                            archive.try_read("last_step_applied", applied, true);
  // Everything is checked: commit.
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    param_groups_[i].set_options(std::move(opts[i]));
  }
  pstate_ = std::move(fresh);
  if (has_counters && !params.empty()) {
    const auto d = params.front().device();
    skipped_steps_ = skipped.to(d, at::kLong).clone();
    last_step_applied_ = applied.to(d, at::kFloat).clone();
  }
  found_valid_ = false;
  sumsq_valid_ = false;
  invalidate();
}

}  // namespace fusedamp::optim
