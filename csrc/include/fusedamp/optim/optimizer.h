#pragma once
// fusedamp::optim::Optimizer — the one orchestration of a mixed-precision optimizer step,
// shared by AdamW/Adam and SGD, by the C++ API, the Python package (which wraps it) and the
// ZeRO-1 sharded optimizer (which puts its collectives between the phases).
//
// It is a torch::optim::Optimizer (param groups with their own options, zero_grad(), the C++
// LR schedulers work through get_lr/set_lr), but a step is a handful of operator calls, in
// named phases:
//   1. gather_grads()        validate options and grads; (re)plan the buckets only when the set
//                            of parameters with gradients changed; collect this step's grads
//   2. compute_grad_stats()  fusedamp::grad_stats_ once per device: found_inf and the sum of
//                            squares (global norm for clipping), combined over devices
//   3. apply_update()        fusedamp::adam_step_ / sgd_step_ once per bucket, with the inverse
//                            loss scale, the clip coefficient and found_inf read on the device;
//                            then the accounting (last_step_applied, skipped_steps)
// A bucket is (param group, device, param dtype, grad dtype). Nothing in a step reads a device
// value on the host, so a step never synchronises.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <fusedamp/telemetry.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fusedamp/optim/options.h>
#include <fusedamp/optim/param_state.h>

namespace fusedamp::optim {

namespace detail {
class BucketPlan;
class DeviceStats;
class ParamStateStore;
struct Bucket;
}  // namespace detail
}  // namespace fusedamp::optim

namespace fusedamp {
struct StepLists;  // the lists a step op walks (csrc/ops/step_lists.h)
namespace ops {
struct StepShared;  // the arguments both step ops take (fusedamp/ops.h)
}  // namespace ops
}  // namespace fusedamp

namespace fusedamp::optim {

class Optimizer : public torch::optim::Optimizer {
 public:
  using StateDict = optim::StateDict;

  // A step without loss scaling. With clipping or non-finite protection it runs the statistics
  // pass first; a gradient holding inf/NaN then skips the whole step (nothing changes).
  // `closure`, when given, is called (with grad enabled) first and its loss returned.
  at::Tensor step(LossClosure closure = nullptr) override;

  // A step under torch's AMP protocol: what torch.amp.GradScaler and fusedamp::GradScaler hand
  // to an optimizer that unscales and skips inside its step (_step_supports_amp_scaling).
  //   grad_scale  the loss scale the gradients still carry (one element, any float dtype and
  //               device); undefined when they were unscaled already (unscale_).
  //   found_inf   the overflow flag found so far (one FP32 element); undefined: none yet.
  // The step checks the gradients itself (always, when they are still scaled), ORs what it
  // finds into found_inf, and changes nothing when the flag is set. Never syncs.
  //   telemetry   where its gradient pass reports (a fusedamp::GradScaler's record); optional.
  void step_amp(const at::Tensor& grad_scale, const at::Tensor& found_inf,
                GradTelemetrySink* telemetry = nullptr);

  // The step of one parameter, `param`, for gradient release (a step inside backward, each
  // parameter's once its gradient is accumulated, the gradient freed after): step_amp's step,
  // except that the skip is decided by this gradient alone, so a parameter stepped earlier in
  // the iteration stands and one stepped later is not held back. The call's flag (1 when it
  // skipped) is added into `found_inf_sum` (a loss scaler's flag of the iteration: it backs off
  // when any call skipped), and the unscaled gradient is not written back (it is about to be
  // freed). grad_scale undefined: an unscaled step, checked as step() checks (skip_nonfinite);
  // found_inf_sum may be undefined. Groups with max_grad_norm clip by this gradient's norm.
  // Throws, changing nothing, unless `param` is the one parameter holding a gradient (another
  // one's would be taken again by every later call). Never syncs.
  void step_released(const at::Tensor& param, const at::Tensor& grad_scale,
                     const at::Tensor& found_inf_sum, GradTelemetrySink* telemetry = nullptr);

  // ---- the phases of a step, in order (see the top of this file) ----------------------------
  // Front ends that put collectives between the phases call them one by one.
  // 1. False when no parameter has a gradient (nothing to do; phases 2 and 3 must not run).
  bool gather_grads();
  // 2. Returns [found_inf, sum of squares] (FP32[2] on the primary device, the device of the
  //    first stepped parameter), found_inf seeded with `seed_found_inf` (undefined: 0). The
  //    tensor is the optimizer's own: a caller may reduce it across processes in place before
  //    phase 3.
  at::Tensor compute_grad_stats(const at::Tensor& seed_found_inf = {},
                                GradTelemetrySink* telemetry = nullptr);
  // 3. The fused update with the statistics of phase 2: grads divided by `grad_scale` (when
  //    defined) and clipped where max_grad_norm is set; skipped on the device when found_inf is
  //    set and a check is in force — for every group when `scaled` (a loss scaler's step), else
  //    for groups with skip_nonfinite. `found_inf_out`, when defined, receives the final flag.
  //    Ends the step: the handles to the gradients phase 1 collected are dropped (the next step
  //    starts with gather_grads again), so zero_grad(set_to_none) frees them.
  void apply_update(const at::Tensor& grad_scale, const at::Tensor& found_inf_out, bool scaled);

  // ---- results of the last step, on the primary device (no sync) ----------------------------
  // 1.0 when the last step was applied, 0.0 when it was skipped. Undefined before a step.
  const at::Tensor& last_step_applied() const { return last_step_applied_; }
  // int64 counter of skipped steps. Undefined before a step.
  const at::Tensor& skipped_steps() const { return skipped_steps_; }
  // Restores the counter (from a checkpoint); last_step_applied becomes 1.
  void set_skipped_steps(const at::Tensor& count);
  // found_inf and sum of squares of the last statistics pass (FP32[1] views of phase 2's
  // tensor). Undefined before one.
  at::Tensor found_inf() const;
  at::Tensor grad_sum_sq() const;
  // The global norm of the unscaled gradients of this step's statistics pass (FP32[1], a
  // tensor of its own), or undefined when this step ran none (e.g. after unscale_ without
  // clipping). The step's accounting op writes it (account_step_): no op of its own. A run's
  // norms, step by step, are a fusedamp::GradScaler's telemetry().grad_norm.
  at::Tensor grad_norm() const;

  // ---- hyper-parameters ---------------------------------------------------------------------
  // Sets a hyper-parameter of group i by name: the names of torch.optim's param groups ("lr",
  // "weight_decay", "eps", "momentum", "dampening", "nesterov", "maximize"), "beta1"/"beta2",
  // and the engine's ("max_grad_norm", "master_weights", "skip_nonfinite"); bools
  // as 0/1. Cheap (one field write); values are validated by check_options(), which every
  // step runs before anything is modified. Throws for a name this optimizer does not have.
  void set_group_option(size_t group, const std::string& name, double value);
  // The same, returning false instead of throwing for an unknown name (front ends whose param
  // groups carry extra keys, e.g. a scheduler's "initial_lr").
  bool try_set_group_option(size_t group, const std::string& name, double value);
  double group_option(size_t group, const std::string& name) const;
  bool has_group_option(size_t group, const std::string& name) const;
  void set_group_lr(size_t group, double lr);
  double group_lr(size_t group) const;
  // Sets an option that may be none (max_grad_norm: no clipping) to none; throws for a name
  // this optimizer does not have or whose option cannot be none.
  void clear_group_option(size_t group, const std::string& name);
  // Clipping of group i by the global gradient norm; nullopt: no clipping.
  void set_group_max_grad_norm(size_t group, std::optional<double> max_norm);
  // A device-side learning rate (one element) for group i; overrides the numeric lr.
  // Undefined tensor: back to the numeric lr.
  void set_group_lr_tensor(size_t group, const at::Tensor& lr);
  size_t num_groups() const { return param_groups_.size(); }
  // Every option a param group of this kind takes (the ones every kind shares, then its
  // algorithm's), in the order archives hold them, with its value in this optimizer's
  // defaults: what fusedamp.optim's constructors are held to.
  std::vector<OptionValue> default_option_values() const;
  // Throws c10::ValueError naming the group and the value for any invalid hyper-parameter.
  void check_options() const;
  // How often the buckets were (re)built: once, plus once per change of the set of params
  // with grads (or of their dtypes/devices, or of the state a group needs).
  int64_t bucket_builds() const;

  // ---- per-parameter state: the tensors themselves, no copies -------------------------------
  // Empty map for a parameter that has not been stepped yet.
  StateDict param_state(const at::Tensor& param) const;
  // Replaces the state of `param` (keys as in param_state.h; "step" required), checked
  // completely before anything is replaced. copy=true: FP32 copies on the param's device with
  // its strides; copy=false: the tensors themselves are kept (they must already be FP32 on the
  // param's device with its shape and strides — e.g. views into a caller's flat buffers).
  void set_param_state(const at::Tensor& param, const StateDict& state, bool copy = true);
  // Replaces the whole per-parameter state (a checkpoint's load): the listed parameters get
  // copies of theirs, every other parameter none. Every entry is checked before any is set.
  void load_param_states(const std::vector<at::Tensor>& params,
                         const std::vector<StateDict>& states);
  // The FP32 value `param`'s weight store holds: its FP32 master, the split pair (exact) or
  // weight + Kahan compensation; undefined where the mode keeps none (or before a step).
  at::Tensor master_weight(const at::Tensor& param) const;
  // All parameters, in param-group order (the index used by save()/load()).
  std::vector<at::Tensor> all_params() const;

  // ---- serialisation: options of every group, every state tensor, skip counters -----------
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  ~Optimizer() override;

 protected:
  Optimizer(const std::vector<torch::optim::OptimizerParamGroup>& groups,
            std::unique_ptr<torch::optim::OptimizerOptions> defaults);

  // ---- what a concrete optimizer provides (OptimizerOf implements all but run_bucket) ------
  virtual const char* kind() const = 0;  // "Adam" | "SGD": in messages, checked on load
  virtual EngineGroupOptions engine_options(const torch::optim::OptimizerOptions& o) const = 0;
  // Throws c10::ValueError for invalid hyper-parameters of group `group`.
  virtual void check_group(const torch::optim::OptimizerOptions& o, size_t group) const = 0;
  // The slots a state dict of this kind may hold, and those a step needs under `o`
  // (master_param is added by the engine where the parameter dtype asks for it).
  virtual StateSlots known_slots() const = 0;
  virtual StateSlots slots_needed(const torch::optim::OptimizerOptions& o) const = 0;
  virtual bool set_own_option(torch::optim::OptimizerOptions& o, const std::string& name,
                              double value) const = 0;
  virtual std::optional<double> own_option(const torch::optim::OptimizerOptions& o,
                                           const std::string& name) const = 0;
  virtual std::vector<OptionValue> option_values(
      const torch::optim::OptimizerOptions& o) const = 0;
  virtual void set_lr_tensor(torch::optim::OptimizerOptions& o, const at::Tensor& lr) const = 0;
  virtual bool clear_own_option(torch::optim::OptimizerOptions& o,
                                const std::string& name) const = 0;
  virtual std::unique_ptr<torch::optim::OptimizerOptions> make_options() const = 0;
  // The fused op of this kind over one bucket, and the lists it walks there.
  virtual void run_bucket(const detail::Bucket& b, const torch::optim::OptimizerOptions& o,
                          const ops::StepShared& in) const = 0;
  virtual StepLists row_lists(const detail::Bucket& b,
                              const torch::optim::OptimizerOptions& o) const = 0;

  torch::optim::OptimizerOptions& checked_group(size_t group);
  const torch::optim::OptimizerOptions& checked_group(size_t group) const;

 private:
  // gather_grads(); within_step: called by step()/step_amp(), which run the step ops right
  // after it, so the walk may check their rows (BucketPlan::update).
  bool gather(bool within_step);
  bool any_group(bool (*pred)(const EngineGroupOptions&)) const;
  void account(const at::Tensor& found_inf, bool checked, const at::Tensor& found_inf_out,
               const at::Tensor& inv_scale);

  std::unique_ptr<detail::ParamStateStore> states_;
  std::unique_ptr<detail::BucketPlan> plan_;
  std::unique_ptr<detail::DeviceStats> stats_;
  at::Tensor grad_norm_;  // FP32[1] on the primary device, written by account_step_
  bool norm_this_step_ = false;  // grad_norm_ holds this step's norm
  at::Tensor inv_scale_;  // a CPU step's inverse scale (detail::inverse_scale_reusing)
  at::Tensor last_step_applied_;
  at::Tensor skipped_steps_;
  bool releasing_ = false;  // within step_released: no gradient write-back
};

}  // namespace fusedamp::optim
