#pragma once
// fusedamp::optim::Optimizer — the step orchestration shared by AdamW/Adam and SGD.
//
// It is a torch::optim::Optimizer (param groups with their own options, zero_grad(), the C++
// LR schedulers work through get_lr/set_lr), but a step is a handful of operator calls:
//   [once per device]  found_inf = sum_sq = 0; fusedamp::grad_stats_(all grads on the device)
//                      (only when a loss scale, clipping or non-finite protection needs it)
//   [once per bucket]  fusedamp::adam_step_ / sgd_step_ on the bucket's lists
// A bucket is (param group, device, param dtype, grad dtype). Buckets and their state lists are
// built once and rebuilt only when the set of parameters that have a gradient changes; only
// the gradient handles are collected again each step. Nothing in a step reads a device value
// on the host, so a step never synchronises.
//
// Per-parameter state (FP32, on the parameter's device, same strides as the parameter):
//   step (0-dim), master_param (FP16/BF16 params with master_weights), exp_avg, exp_avg_sq
//   (Adam) or momentum_buffer (SGD with momentum). It is created at the first step that sees a
//   gradient for the parameter. param_state()/set_param_state() expose it without copies.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <fusedamp/ops.h>

namespace fusedamp {
class GradScaler;
}

namespace fusedamp::optim {

// The engine settings every options struct carries (read per group).
struct EngineGroupOptions {
  bool master_weights = true;
  std::optional<double> max_grad_norm;
  bool skip_nonfinite = true;
  at::Tensor lr_tensor;  // undefined: use the numeric lr
};

// State names used by param_state()/set_param_state() and by save()/load().
inline constexpr const char* kStep = "step";
inline constexpr const char* kMasterParam = "master_param";
inline constexpr const char* kExpAvg = "exp_avg";
inline constexpr const char* kExpAvgSq = "exp_avg_sq";
inline constexpr const char* kMomentumBuffer = "momentum_buffer";

class Optimizer : public torch::optim::Optimizer {
 public:
  using StateDict = std::unordered_map<std::string, at::Tensor>;

  // A step without loss scaling. With clipping or non-finite protection it runs grad_stats_
  // first; a gradient holding inf/NaN then skips the whole step (nothing changes).
  // `closure`, when given, is called (with grad enabled) first and its loss returned.
  at::Tensor step(LossClosure closure = nullptr) override;

  // ---- results of the last step, on the device of the first parameter (no sync) ----------
  // 1.0 when the last step was applied, 0.0 when it was skipped. Undefined before a step.
  const at::Tensor& last_step_applied() const { return last_step_applied_; }
  // int64 counter of skipped steps. Undefined before a step.
  const at::Tensor& skipped_steps() const { return skipped_steps_; }
  // found_inf and sum of squares of the last grad_stats_ pass (FP32[1], first param's device).
  at::Tensor found_inf() const;
  at::Tensor grad_sum_sq() const;

  // ---- per-step hook for front ends (Python param groups, LR schedulers) ------------------
  // Sets a hyper-parameter of group i by name, e.g. "lr", "weight_decay", "eps", "beta1",
  // "beta2", "momentum", "dampening", "max_grad_norm" (<= 0 or NaN: off). Cheap: writes one
  // field; values are validated at the next step, before anything is modified.
  virtual void set_group_option(size_t group, const std::string& name, double value) = 0;
  virtual double group_option(size_t group, const std::string& name) const = 0;
  void set_group_lr(size_t group, double lr);
  double group_lr(size_t group) const;
  // A device-side learning rate (FP32, 1 element) for group i; overrides the numeric lr.
  // Undefined tensor: back to the numeric lr.
  virtual void set_group_lr_tensor(size_t group, const at::Tensor& lr) = 0;
  size_t num_groups() const { return param_groups_.size(); }
  // How often the buckets were (re)built: once, plus once per change of the set of params
  // with grads (or of their dtypes/devices, or of master_weights/momentum being on).
  int64_t bucket_builds() const { return bucket_builds_; }

  // ---- per-parameter state: the tensors themselves, no copies -----------------------------
  // Empty map for a parameter that has not been stepped yet.
  StateDict param_state(const at::Tensor& param) const;
  // Replaces the state of `param` with copies of `state` cast to FP32 on the param's device
  // (keys as above; "step" required). Checked completely before anything is replaced.
  void set_param_state(const at::Tensor& param, const StateDict& state);
  // All parameters, in param-group order (the index used by save()/load()).
  std::vector<at::Tensor> all_params() const;

  // ---- serialisation: options of every group, every state tensor, skip counters -----------
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // ---- used by fusedamp::GradScaler (and front ends that drive the phases themselves) -----
  // Multiplies the grads in place by inv_scale (any device; copied where needed) and records
  // non-finite values in found_inf(). Grads are then true gradients (torch.amp's unscale_).
  at::Tensor unscale_grads_(const at::Tensor& inv_scale);
  // The scaled step: grads are multiplied by inv_scale inside the fused step, unless
  // `grads_unscaled` (after unscale_grads_). Always skips on non-finite. Returns found_inf().
  at::Tensor step_scaled(const at::Tensor& inv_scale, bool grads_unscaled);

  ~Optimizer() override = default;

 protected:
  struct ParamState {
    at::Tensor step;
    at::Tensor master;
    at::Tensor a;  // exp_avg | momentum_buffer
    at::Tensor b;  // exp_avg_sq
  };

  struct Bucket {
    size_t group = 0;
    size_t dev = 0;  // index into devices_
    c10::Device device = c10::Device(c10::kCPU);
    at::ScalarType param_dtype = at::kFloat;
    std::vector<at::Tensor> params, masters, grads, a, b, steps;
  };

  Optimizer(const std::vector<torch::optim::OptimizerParamGroup>& groups,
            std::unique_ptr<torch::optim::OptimizerOptions> defaults);

  // ---- what a concrete optimizer provides --------------------------------------------------
  virtual const char* kind() const = 0;  // "Adam" | "SGD": in messages, checked on load
  virtual EngineGroupOptions engine_options(const torch::optim::OptimizerOptions& o) const = 0;
  // Throws c10::Error for invalid hyper-parameters of group `group`.
  virtual void check_options(const torch::optim::OptimizerOptions& o, size_t group) const = 0;
  // The state names of ParamState::a and ::b (nullptr: unused) and how many of them the
  // step needs under the given options (a first).
  virtual std::pair<const char*, const char*> slot_names() const = 0;
  virtual int slots_needed(const torch::optim::OptimizerOptions& o) const = 0;
  virtual void run_step(const Bucket& b, const torch::optim::OptimizerOptions& o,
                        const ops::StepScalars& s) = 0;
  // Fresh options object of the concrete type (for load()).
  virtual std::unique_ptr<torch::optim::OptimizerOptions> make_options() const = 0;

  void check_all_options() const;
  void invalidate() { buckets_valid_ = false; }

 private:
  struct DeviceStats {
    c10::Device device = c10::Device(c10::kCPU);
    at::Tensor found_inf;  // FP32[1]
    at::Tensor sum_sq;     // FP32[1]
    std::vector<at::Tensor> grads;
  };

  // Validates options and grads, (re)builds buckets if needed, collects this step's grads.
  // Returns false when no parameter has a gradient.
  bool prepare();
  void build_buckets();
  void collect_grads();
  void ensure_state(const at::Tensor& p, bool want_master, int slots);
  void check_grad(const at::Tensor& p, const at::Tensor& g, size_t group, size_t index) const;
  size_t device_index(const c10::Device& d);
  // Pass 1 over every device; `reset_found_inf` false keeps an earlier unscale's flags.
  void run_grad_stats(bool reset_found_inf);
  // found_inf/sum_sq of all devices combined and handed back to each device.
  void combine_stats(bool found, bool sum_sq);
  void run_buckets(const std::optional<at::Tensor>& inv_scale, bool scaled);
  at::Tensor on_device(const at::Tensor& t, const c10::Device& d) const;
  ParamState* find_state(const at::Tensor& p);
  const ParamState* find_state(const at::Tensor& p) const;

  std::unordered_map<const c10::TensorImpl*, ParamState> pstate_;
  std::vector<Bucket> buckets_;
  std::vector<DeviceStats> devices_;  // devices_[0] is the primary device
  struct SigEntry {
    const void* impl;
    int64_t a, b, c;
    bool operator==(const SigEntry& o) const {
      return impl == o.impl && a == o.a && b == o.b && c == o.c;
    }
  };
  std::vector<SigEntry> signature_;
  bool buckets_valid_ = false;
  int64_t bucket_builds_ = 0;
  bool found_valid_ = false;  // found_inf holds this step's result
  bool sumsq_valid_ = false;  // sum_sq holds this step's result
  at::Tensor last_step_applied_;
  at::Tensor skipped_steps_;
};

// Shared helpers for the options structs (validation messages name the optimizer).
namespace detail {
void check_engine_options(const char* who, const EngineGroupOptions& e, size_t group);
std::optional<double> norm_option(double v);  // <= 0 or NaN: no clipping

}  // namespace detail

}  // namespace fusedamp::optim
