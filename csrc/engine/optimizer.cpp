// The step of fusedamp's optimizers, in its phases (see include/fusedamp/optim/optimizer.h),
// and the access to the groups' hyper-parameters.
#include <fusedamp/optim/optimizer.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <fusedamp/ops.h>

#include <algorithm>

#include "../ops/tensor_prefetch.h"
#include "bucket_plan.h"
#include "device_stats.h"
#include "inverse_scale.h"
#include "param_state_store.h"
#include "step_call.h"

namespace fusedamp::optim {
namespace {

// The engine's own op calls go straight to the backend kernels: the Autograd and
// ADInplaceOrView kernels would check and bump every list (masters, moments, steps: the
// engine's own tensors). What a user can observe keeps torch's in-place semantics: the params
// (and grads written back) get their version counters bumped, as torch's fused optimizer ops
// do, skipped step or not.
//
// Each bump is TensorImpl's inline bump_version (what torch::autograd::impl::bump_version calls;
// it raises torch's error for an inference tensor outside InferenceMode), with each counter read
// kImplAhead positions ahead: with thousands of parameters the counters, an allocation each,
// are so many cache misses one after another otherwise (perf: 6% of a whole AMP step over
// 10,000 one-element tensors). Reading the counter's address needs the TensorImpl's line that
// holds it, asked for kImplAhead positions before that.
void bump_versions(at::TensorList tensors) {
  const size_t n = tensors.size();
  for (size_t i = 0; i < n; ++i) {
    if (i + 2 * kImplAhead < n) {
      __builtin_prefetch(&tensors[i + 2 * kImplAhead].unsafeGetTensorImpl()->version_counter());
    }
    if (i + kImplAhead < n) {
      load_version_counter(tensors[i + kImplAhead]);
    }
    tensors[i].unsafeGetTensorImpl()->bump_version();
  }
}

void bump_observable(const detail::Bucket& b, const ops::StepShared& in) {
  bump_versions(b.params);
  if (in.write_back_grads) {
    bump_versions(b.grads);
  }
}

at::Tensor on_device(const at::Tensor& t, const c10::Device& d) {
  return t.device() == d ? t : t.to(d, /*non_blocking=*/true);
}

bool needs_stats(const EngineGroupOptions& e) {
  return e.skip_nonfinite || e.max_grad_norm.has_value();
}

bool clips(const EngineGroupOptions& e) {
  return e.max_grad_norm.has_value();
}

}  // namespace

Optimizer::Optimizer(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                     std::unique_ptr<torch::optim::OptimizerOptions> defaults)
    : torch::optim::Optimizer(groups, std::move(defaults)),
      states_(std::make_unique<detail::ParamStateStore>()),
      plan_(std::make_unique<detail::BucketPlan>()),
      stats_(std::make_unique<detail::DeviceStats>()) {}

Optimizer::~Optimizer() = default;

// ---- phases ---------------------------------------------------------------------------------

bool Optimizer::gather_grads() {
  return gather(/*within_step=*/false);
}

bool Optimizer::gather(bool within_step) {
  check_options();
  std::vector<detail::BucketPlan::Group> groups;
  groups.reserve(param_groups_.size());
  for (const auto& g : param_groups_) {
    const auto e = engine_options(g.options());
    groups.push_back({&g.params(), e.master_weights, e.state_dtype, e.rounding_seed,
                      slots_needed(g.options())});
  }
  const auto lists = [this](const detail::Bucket& b) {
    return row_lists(b, param_groups_[b.group].options());
  };
  plan_->update(kind(), groups, *states_, *stats_,
                within_step ? std::optional<detail::BucketPlan::RowLists>(lists) : std::nullopt);
  stats_->invalidate();
  norm_this_step_ = false;
  return !plan_->buckets().empty();
}

at::Tensor Optimizer::compute_grad_stats(const at::Tensor& seed_found_inf,
                                         GradTelemetrySink* telemetry) {
  TORCH_CHECK(!stats_->empty(), "fusedamp::optim::", kind(),
              ": compute_grad_stats needs gather_grads() to have found gradients first");
  at::NoGradGuard no_grad;
  stats_->run_pass(seed_found_inf, telemetry);
  return stats_->primary();
}

void Optimizer::apply_update(const at::Tensor& grad_scale, const at::Tensor& found_inf_out,
                             bool scaled) {
  at::NoGradGuard no_grad;
  const auto& buckets = plan_->buckets();
  if (buckets.empty()) {
    return;
  }
  const bool have_stats = stats_->valid();
  if (have_stats) {
    stats_->broadcast_primary();  // a caller may have reduced the primary's values in place
  }
  // The inverse scale per device, as torch computes it.
  std::vector<at::Tensor> inv_scale;
  if (grad_scale.defined()) {
    const auto inv = fusedamp::detail::inverse_scale_reusing(grad_scale, inv_scale_);
    for (const auto& b : buckets) {
      if (inv_scale.size() <= b.device_slot) {
        inv_scale.resize(b.device_slot + 1);
      }
      if (!inv_scale[b.device_slot].defined()) {
        inv_scale[b.device_slot] = on_device(inv, b.device);
      }
    }
  }
  bool checked = false;
  for (const auto& b : buckets) {
    const auto& o = param_groups_[b.group].options();
    const auto e = engine_options(o);
    ops::StepShared in;
    if (grad_scale.defined()) {
      in.inv_scale = inv_scale[b.device_slot];
    }
    if (have_stats && (scaled || e.skip_nonfinite)) {
      in.found_inf = stats_->found_inf(b.device_slot);
      checked = true;
    }
    if (e.max_grad_norm) {
      TORCH_CHECK(stats_->from_pass(), "fusedamp::optim::", kind(),
                  ": clipping needs the statistics pass (compute_grad_stats) before the update");
      in.grad_sum_sq = stats_->sum_sq(b.device_slot);
      in.max_grad_norm = e.max_grad_norm;
    }
    if (e.lr_tensor.defined()) {
      in.lr_tensor = on_device(e.lr_tensor, b.device);
    }
    in.adopt_param_edits = e.adopt_param_edits;
    // Unscaled and unclipped, the multiplier is 1: the grads already hold what the update used.
    in.write_back_grads =
        !releasing_ && e.write_back_grads && (in.inv_scale || in.max_grad_norm);
    {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      run_bucket(b, o, in);
    }
    bump_observable(b, in);
  }
  account(have_stats ? stats_->found_inf(0) : at::Tensor(), checked, found_inf_out,
          grad_scale.defined() ? inv_scale[0] : at::Tensor());
  stats_->invalidate();
  plan_->release_grads(*stats_);
}

void Optimizer::account(const at::Tensor& found_inf, bool checked,
                        const at::Tensor& found_inf_out, const at::Tensor& inv_scale) {
  const auto d = stats_->primary_device();
  if (!last_step_applied_.defined() || last_step_applied_.device() != d) {
    // First step, or the counters were restored onto another device than the step's flags.
    last_step_applied_ = at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(d));
    skipped_steps_ = skipped_steps_.defined()
                         ? skipped_steps_.to(d).clone()
                         : at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(d));
  }
  // The norm of this step's statistics pass, where there was one.
  std::optional<at::Tensor> sum_sq, norm;
  if (stats_->from_pass()) {
    sum_sq = stats_->sum_sq(0);
    if (!grad_norm_.defined() || grad_norm_.device() != d) {
      grad_norm_ = at::empty({1}, at::TensorOptions().dtype(at::kFloat).device(d));
    }
    norm = grad_norm_;
  }
  // The loss scaler's flag gets the step's through the op where it lives on the same device.
  const bool flag_here =
      checked && found_inf_out.defined() && found_inf_out.device() == found_inf.device();
  // One op (one kernel launch on a GPU) for what the step records.
  ops::AccountStep a;
  a.step_applied = last_step_applied_;
  a.skipped_steps = skipped_steps_;
  if (checked) {
    a.found_inf = found_inf;
  }
  if (flag_here) {
    a.found_inf_out = found_inf_out;
  }
  a.grad_sum_sq = sum_sq;
  if (norm && inv_scale.defined()) {
    a.inv_scale = inv_scale;
  }
  a.grad_norm = norm;
  ops::account_step_(a);
  if (found_inf.defined() && found_inf_out.defined() && !flag_here) {
    found_inf_out.copy_(found_inf.reshape(found_inf_out.sizes()), /*non_blocking=*/true);
  }
  norm_this_step_ = norm.has_value();
}

// ---- whole steps ----------------------------------------------------------------------------

bool Optimizer::any_group(bool (*pred)(const EngineGroupOptions&)) const {
  for (const auto& g : param_groups_) {
    if (pred(engine_options(g.options()))) {
      return true;
    }
  }
  return false;
}

at::Tensor Optimizer::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  if (!gather(/*within_step=*/true)) {
    return loss;
  }
  if (any_group(needs_stats)) {
    compute_grad_stats();
  }
  apply_update(at::Tensor(), at::Tensor(), /*scaled=*/false);
  return loss;
}

void Optimizer::step_amp(const at::Tensor& grad_scale, const at::Tensor& found_inf,
                         GradTelemetrySink* telemetry) {
  at::NoGradGuard no_grad;
  if (!gather(/*within_step=*/true)) {
    return;
  }
  if (grad_scale.defined() || !found_inf.defined() || any_group(clips)) {
    // Scaled gradients are checked here, in the pass that also gives the clipping norm. It
    // records for the scaler's telemetry only while they are scaled: unscale_ recorded them
    // before unscaling them, and a second record would count them twice.
    compute_grad_stats(found_inf, grad_scale.defined() ? telemetry : nullptr);
  } else {
    stats_->seed(found_inf);  // unscaled and already checked by the caller: no pass needed
  }
  apply_update(grad_scale, found_inf, /*scaled=*/true);
}

void Optimizer::step_released(const at::Tensor& param, const at::Tensor& grad_scale,
                              const at::Tensor& found_inf_sum, GradTelemetrySink* telemetry) {
  TORCH_CHECK(param.defined() && param.grad().defined(), "fusedamp::optim::", kind(),
              ": step_released: the parameter has no gradient");
  bool member = false;
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    const auto& params = param_groups_[gi].params();
    for (size_t j = 0; j < params.size(); ++j) {
      const bool same = params[j].is_same(param);
      member = member || same;
      TORCH_CHECK(same || !params[j].grad().defined(), "fusedamp::optim::", kind(),
                  ": step_released: parameter ", j, " of param group ", gi,
                  " holds a gradient besides the one being stepped (released gradients are "
                  "freed by their own step: clear it with zero_grad(set_to_none=True))");
    }
  }
  TORCH_CHECK(member, "fusedamp::optim::", kind(),
              ": step_released: the parameter is not one of this optimizer's");
  at::NoGradGuard no_grad;
  if (!gather(/*within_step=*/true)) {
    return;
  }
  const bool scaled = grad_scale.defined();
  if (scaled || any_group(needs_stats)) {
    // No seed: an overflow of a parameter stepped earlier in the iteration is in found_inf_sum,
    // not in this call's flag, so it does not hold these parameters back.
    compute_grad_stats(at::Tensor(), scaled ? telemetry : nullptr);
  }
  const at::Tensor flag = stats_->valid() ? stats_->found_inf(0) : at::Tensor();
  releasing_ = true;
  try {
    apply_update(grad_scale, at::Tensor(), scaled);
  } catch (...) {
    releasing_ = false;
    throw;
  }
  releasing_ = false;
  if (found_inf_sum.defined() && flag.defined()) {
    found_inf_sum.add_(on_device(flag, found_inf_sum.device()).reshape(found_inf_sum.sizes()));
  }
}

at::Tensor Optimizer::found_inf() const {
  return stats_->empty() ? at::Tensor() : stats_->found_inf(0);
}

at::Tensor Optimizer::grad_norm() const {
  // A copy: the next step writes grad_norm_ again.
  return norm_this_step_ ? grad_norm_.clone() : at::Tensor();
}

at::Tensor Optimizer::grad_sum_sq() const {
  return stats_->empty() ? at::Tensor() : stats_->sum_sq(0);
}

int64_t Optimizer::bucket_builds() const {
  return plan_->builds();
}

// ---- hyper-parameters -----------------------------------------------------------------------

torch::optim::OptimizerOptions& Optimizer::checked_group(size_t group) {
  TORCH_CHECK(group < param_groups_.size(), "fusedamp::optim::", kind(), ": param group ",
              group, " does not exist (", param_groups_.size(), " groups)");
  TORCH_CHECK(param_groups_[group].has_options(), "fusedamp::optim::", kind(),
              ": param group ", group, " has no options");
  return param_groups_[group].options();
}

const torch::optim::OptimizerOptions& Optimizer::checked_group(size_t group) const {
  return const_cast<Optimizer*>(this)->checked_group(group);
}

void Optimizer::check_options() const {
  for (size_t i = 0; i < param_groups_.size(); ++i) {
    check_group(checked_group(i), i);
  }
}

bool Optimizer::try_set_group_option(size_t group, const std::string& name, double value) {
  return set_own_option(checked_group(group), name, value);
}

void Optimizer::set_group_option(size_t group, const std::string& name, double value) {
  TORCH_CHECK(try_set_group_option(group, name, value), "fusedamp::optim::", kind(),
              ": unknown option '", name, "'");
}

double Optimizer::group_option(size_t group, const std::string& name) const {
  const auto v = own_option(checked_group(group), name);
  TORCH_CHECK(v.has_value(), "fusedamp::optim::", kind(), ": unknown option '", name, "'");
  return *v;
}

bool Optimizer::has_group_option(size_t group, const std::string& name) const {
  return own_option(checked_group(group), name).has_value();
}

std::vector<OptionValue> Optimizer::default_option_values() const {
  return option_values(defaults());
}

void Optimizer::set_group_lr(size_t group, double lr) {
  checked_group(group).set_lr(lr);
}

double Optimizer::group_lr(size_t group) const {
  return checked_group(group).get_lr();
}

void Optimizer::clear_group_option(size_t group, const std::string& name) {
  TORCH_CHECK(clear_own_option(checked_group(group), name), "fusedamp::optim::", kind(),
              ": unknown option '", name, "'");
}

void Optimizer::set_group_max_grad_norm(size_t group, std::optional<double> max_norm) {
  if (max_norm) {
    set_group_option(group, "max_grad_norm", *max_norm);
  } else {
    clear_group_option(group, "max_grad_norm");
  }
}

void Optimizer::set_group_lr_tensor(size_t group, const at::Tensor& lr) {
  set_lr_tensor(checked_group(group), lr);
}

}  // namespace fusedamp::optim
