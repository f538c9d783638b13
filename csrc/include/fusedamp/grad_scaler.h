#pragma once
// fusedamp::GradScaler — dynamic loss scaling with the state on the device.
//
// The scale, growth tracker and hysteresis tracker are one-element device tensors; update()
// is the update_scale_ op. No call syncs with the host except get_scale(), save(), and the
// step of an optimizer that knows nothing of loss scaling (which, as in torch.amp, has to read
// found_inf to decide whether to run it). With hysteresis 1 and no bounds the scale sequence
// equals torch.amp.GradScaler's.
//
// One iteration:
//   auto loss = scaler.scale(compute_loss());   // loss * scale
//   loss.backward();
//   scaler.unscale_(opt);                       // optional: grads become true gradients
//   scaler.step(opt);                           // skipped (nothing changes) on inf/NaN
//   scaler.update();
//
// Scaler and optimizer speak torch's AMP protocol: an optimizer that unscales and skips inside
// its step receives the scale its gradients carry (grad_scale; undefined after unscale_) and a
// found_inf flag, and ORs its own check into that flag. fusedamp's optimizers check their
// gradients in the pass that also gives the clipping norm, so the scaler adds no pass for them;
// for other such optimizers (torch's fused ones) it checks the gradients first, read-only.
// Several optimizers, of any kind, may be stepped in one iteration; update() combines them.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>
#include <torch/arg.h>

#include <fusedamp/sharded_grad_stats.h>
#include <fusedamp/telemetry.h>

#include <cstdint>
#include <memory>
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
namespace detail {
class ScalerTelemetry;
}

// How update() moves the scale (math/scale_math.h). kTorch: torch.amp's rule (back off on
// overflow, grow after growth_interval clean steps). kAmax: to the largest power of two that
// keeps this step's largest finite |scaled gradient| under amax_target, at once.
enum class ScalePolicy { kTorch, kAmax };

// The amax policy's default target, 2^-8 of FP16's largest value (65504 / 256 = 255.875). The
// policy sets the next step's scale from this step's parameter-gradient amax, so the target
// must leave room for the next step's largest FP16 gradient anywhere in the backward pass:
// measured on the demo's models over 200 steps, at most 21.6x this step's parameter amax (p99
// 9.1x; all of it the amax growing from one step to the next: within a step no FP16 activation
// gradient exceeded the parameter gradients) — benchmarks/results/amax_margin.md. 256x leaves
// 12x more for models with larger activation gradients or spikes, while amax still sits 2^22
// above FP16's smallest normal.
constexpr double kDefaultAmaxTarget = 65504.0 / 256.0;

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
  TORCH_ARG(ScalePolicy, policy) = ScalePolicy::kTorch;
  TORCH_ARG(double, amax_target) = kDefaultAmaxTarget;  // the amax policy's
  // Record each iteration (telemetry()); its gradient passes gather it (the amax policy needs
  // it). unscale_ then reads the gradients once more before unscaling them.
  TORCH_ARG(bool, telemetry) = true;
  TORCH_ARG(int64_t, telemetry_capacity) = 4096;  // iterations kept
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});
  ~GradScaler();
  GradScaler(GradScaler&&) noexcept;
  GradScaler& operator=(GradScaler&&) noexcept;

  // outputs * scale, with torch.amp's type promotion (the scale is a 0-dim FP32 tensor: a scalar
  // FP16 loss gives an FP32 result, a tensor of FP16 outputs stays FP16). Disabled: `outputs`.
  // FP16 outputs first hold the scale at 2^15 or below (on the device): the scale is the
  // gradient that reaches them, and FP16 cannot carry 2^16.
  at::Tensor scale(const at::Tensor& outputs);

  // ---- the iteration, for C++ optimizers --------------------------------------------------
  // Unscales the optimizer's grads in place (they are then true gradients, e.g. for manual
  // clipping) and records inf/NaN. At most once per optimizer between two update() calls.
  void unscale_(optim::Optimizer& optimizer);
  void unscale_(torch::optim::Optimizer& optimizer);
  // fusedamp's optimizers: the fused step under the AMP protocol (no sync). Any other
  // torch::optim optimizer: unscale_ if needed, then step() only if no inf/NaN was found.
  void step(optim::Optimizer& optimizer);
  void step(torch::optim::Optimizer& optimizer);
  // The loss-scale state machine over this iteration's found_inf; starts a new iteration.
  void update();
  // Sets the scale to `new_scale` instead (trackers unchanged), like torch's update(new_scale).
  void update(double new_scale);
  // The same from a one-element floating-point tensor on the scale's kind of device, copied on
  // the device: no synchronisation, so its value is not checked (as in torch's update).
  void update(const at::Tensor& new_scale);

  // ---- the same stages for front ends that own the optimizer objects (the Python package) ---
  // `key` identifies an optimizer within an iteration; `params` are its parameters that have a
  // gradient (their .grad is read and, for unscale_, written).
  using OptimizerKey = const void*;
  void unscale_(OptimizerKey key, at::TensorList params);
  // The same over this process's shards of parameters sharded across processes (FSDP2): the
  // pass goes through `shards` (made on telemetry_sink()), which the caller reduces across the
  // processes and finishes; that makes this optimizer's found_inf, and the record, global.
  void unscale_(OptimizerKey key, at::TensorList params, ShardedGradStats& shards);
  // What torch's protocol hands to an optimizer that unscales and skips in its step.
  struct AmpHandover {
    at::Tensor grad_scale;  // undefined when unscale_ ran for this optimizer
    at::Tensor found_inf;   // this optimizer's flag; its step ORs its own check into it
  };
  // `params_to_check`: empty when the optimizer checks its gradients itself, else they are
  // checked here first (one read-only pass).
  AmpHandover begin_amp_step(OptimizerKey key, at::TensorList params_to_check);
  // For an optimizer that knows nothing of scaling: unscale_ (unless done) and whether its step
  // may run. Reads found_inf on the host, as torch.amp does.
  bool begin_plain_step(OptimizerKey key, at::TensorList params);
  // Ends the optimizer's step of this iteration (run or skipped).
  void end_step(OptimizerKey key);
  // Where an optimizer's own gradient pass reports this iteration (nullptr: no telemetry).
  GradTelemetrySink* telemetry_sink();

  // ---- telemetry ------------------------------------------------------------------------------
  // The recorded iterations, oldest first; one synchronisation. Empty without telemetry. It
  // is the run's one per-step record: for each update(), the scale the iteration's gradients
  // carried (the one before it), whether they overflowed, their unscaled norm, and the rest.
  TelemetryLog telemetry() const;

  // ---- state --------------------------------------------------------------------------------
  // Reading the scale syncs with the host: the caller's choice. 1.0 when disabled.
  double get_scale() const;
  // The device tensors themselves (no copies, no sync). Undefined before the state exists.
  const at::Tensor& scale_tensor() const { return scale_; }
  // 1 / scale (FP32, as torch.amp rounds it), brought up to date when read.
  const at::Tensor& inv_scale_tensor() const;
  const at::Tensor& growth_tracker() const { return growth_tracker_; }
  const at::Tensor& hysteresis_tracker() const { return hysteresis_tracker_; }
  // found_inf of the last update() (FP32, 0-dim: the sum over the optimizers stepped;
  // nonzero: overflow).
  const at::Tensor& found_inf() const { return found_inf_; }
  // Whether any optimizer has been unscaled or stepped since the last update().
  bool in_iteration() const { return !per_optimizer_.empty(); }

  bool is_enabled() const { return opts_.enabled(); }
  const GradScalerOptions& options() const { return opts_; }
  // torch.amp's setters; validated like the constructor's arguments.
  void set_growth_factor(double v);
  void set_backoff_factor(double v);
  void set_growth_interval(int64_t v);

  // Every counter and the options (scale, growth and hysteresis trackers as tensors).
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);
  // The Python wrapper's state_dict path: replaces the counters (validated first).
  void load_state(double scale, int64_t growth_tracker, int64_t hysteresis_tracker);
  // The same with new options, all validated before anything is replaced.
  void load_state(const GradScalerOptions& options, double scale, int64_t growth_tracker,
                  int64_t hysteresis_tracker);

 private:
  // The name every error of the scaler starts with.
  static constexpr const char* kWho = "fusedamp::GradScaler";

  enum class Stage { kReady, kUnscaled, kStepped };
  struct PerOptimizer {
    Stage stage = Stage::kReady;
    at::Tensor found_inf;  // this optimizer's flag, on the scaler's device
  };

  void ensure_state(const c10::Device& device);
  // Makes sure this iteration's inverse scale is computed.
  void begin_iteration(const c10::Device& fallback);
  PerOptimizer& record_unscale(OptimizerKey key);
  // unscale_ with the pass through `sink` (the record, a sharded pass, or nullptr).
  void unscale_through(OptimizerKey key, at::TensorList params, GradTelemetrySink* sink);
  PerOptimizer& record_step(OptimizerKey key);
  at::Tensor zero_flag() const;
  void end_iteration();  // the per-iteration records are dropped
  static void validate(const GradScalerOptions& o);
  static void check_positive_finite(const char* name, double v);
  static void check_state(double scale, int64_t growth_tracker, int64_t hysteresis_tracker);

  GradScalerOptions opts_;
  at::Tensor scale_, growth_tracker_, hysteresis_tracker_, found_inf_, inv_scale_;
  at::Tensor scale_0d_;  // scale_ as the 0-dim view begin_amp_step hands over
  bool iteration_begun_ = false;            // begin_iteration() ran since the last update()
  mutable bool inv_scale_current_ = false;  // inv_scale_ is 1 / scale_ (a cache)
  bool bound_ = false;  // state tensors are on their training device
  std::unordered_map<OptimizerKey, PerOptimizer> per_optimizer_;
  std::unique_ptr<detail::ScalerTelemetry> telemetry_;  // null without telemetry
};

}  // namespace fusedamp
