#pragma once
// fusedamp::GradScaler — dynamic loss scaling with the state on the device.
//
// The scale, growth tracker and hysteresis tracker are one-element device tensors; update()
// is the update_scale_ op; with a fusedamp optimizer, step() hands the device-side inverse
// scale and found_inf to the fused step. No call syncs with the host except get_scale() and
// save(). With hysteresis 1 and no bounds the scale sequence equals torch.amp.GradScaler's.
//
// One iteration:
//   auto loss = scaler.scale(compute_loss());   // loss * scale
//   loss.backward();
//   scaler.unscale_(opt);                       // optional: grads become true gradients
//   scaler.step(opt);                           // skipped (nothing changes) on inf/NaN
//   scaler.update();
// It also drives any torch::optim optimizer, like torch.amp (that path reads found_inf on the
// host before stepping).
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <unordered_map>

namespace torch::optim {
class Optimizer;
}
namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace fusedamp {
namespace optim {
class Optimizer;
}

struct GradScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;
  TORCH_ARG(bool, enabled) = true;
  // Back off only after this many overflowing steps in a row (1: at every overflow, as torch).
  TORCH_ARG(int64_t, hysteresis) = 1;
  TORCH_ARG(std::optional<double>, min_scale) = std::nullopt;
  TORCH_ARG(std::optional<double>, max_scale) = std::nullopt;
  // Where the state lives; unset: the device of the first loss (or optimizer) it sees.
  TORCH_ARG(std::optional<c10::Device>, device) = std::nullopt;
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  // loss * scale (the scale cast to the loss's dtype by type promotion: an FP16 loss gives an
  // FP32 result, as torch does). `loss` must hold one element. Disabled: returns `loss`.
  at::Tensor scale(const at::Tensor& loss);

  // Unscales the optimizer's grads in place (they are then true gradients, e.g. for manual
  // clipping) and records inf/NaN. At most once per optimizer between two update() calls.
  void unscale_(optim::Optimizer& optimizer);
  void unscale_(torch::optim::Optimizer& optimizer);

  // The fused path: one grad_stats_ pass (unless unscale_ already checked) and the fused step
  // with inv_scale and found_inf on the device; no sync. Skipped steps change nothing.
  void step(optim::Optimizer& optimizer);
  // Any torch::optim optimizer: unscale_ if needed, then step() only if no inf/NaN was found
  // (this reads found_inf on the host, as torch.amp does).
  void step(torch::optim::Optimizer& optimizer);

  // The loss-scale state machine over this iteration's found_inf; starts a new iteration.
  void update();
  // Sets the scale to `new_scale` instead (trackers unchanged), like torch's update(new_scale).
  void update(double new_scale);

  // Reading the scale syncs with the host: the caller's choice. 1.0 when disabled.
  double get_scale() const;
  // The device tensors themselves (no copies, no sync). Undefined before the state exists.
  const at::Tensor& scale_tensor() const { return scale_; }
  const at::Tensor& inv_scale_tensor() const { return inv_scale_; }
  const at::Tensor& growth_tracker() const { return growth_tracker_; }
  const at::Tensor& hysteresis_tracker() const { return hysteresis_tracker_; }
  // found_inf of the last update() (sum over the optimizers stepped; nonzero: overflow).
  const at::Tensor& found_inf() const { return found_inf_; }

  bool is_enabled() const { return opts_.enabled(); }
  const GradScalerOptions& options() const { return opts_; }
  // torch.amp's setters; validated like the constructor's arguments.
  void set_growth_factor(double v);
  void set_backoff_factor(double v);
  void set_growth_interval(int64_t v);

  // Every counter and the options (scale, growth and hysteresis trackers as tensors).
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);
  // The Python wrapper's state_dict path: replaces the state (validated first).
  void load_state(double scale, int64_t growth_tracker, int64_t hysteresis_tracker);

 private:
  enum class Stage { Ready, Unscaled, Stepped };
  struct PerOptimizer {
    Stage stage = Stage::Ready;
    at::Tensor found_inf;  // this optimizer's found_inf (on its primary device)
  };

  void ensure_state(const c10::Device& device);
  // Called by unscale_/step: makes sure this iteration's inverse scale is computed.
  void begin_iteration(const c10::Device& fallback);
  PerOptimizer& record(const void* optimizer);
  // record() for an unscale_: refuses a second unscale_ or one after step().
  PerOptimizer& record_unscale(const void* optimizer);
  static void validate(const GradScalerOptions& o);
  static void check_state(double scale, int64_t growth_tracker, int64_t hysteresis_tracker);

  GradScalerOptions opts_;
  at::Tensor scale_, growth_tracker_, hysteresis_tracker_, found_inf_, inv_scale_;
  bool inv_scale_fresh_ = false;
  bool bound_ = false;  // state tensors are on their training device
  std::unordered_map<const void*, PerOptimizer> per_optimizer_;
};

}  // namespace fusedamp
