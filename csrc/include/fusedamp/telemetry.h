#pragma once
// What a loss scaler records of each iteration, to show why a run went wrong: the scale, whether
// the gradients overflowed (and which parameter first), their norm, their largest finite
// magnitude and how much of them underflowed. Gathered on the device by the gradient passes the
// step makes anyway (grad_stats_'s telemetry) and kept there in a ring buffer; read with one
// synchronisation.
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/FunctionRef.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace fusedamp {

// Where a gradient pass reports (a loss scaler's record of the current iteration). A pass
// calls grad_stats() instead of the bare op: same found_inf and sum_sq, plus the telemetry.
class GradTelemetrySink {
 public:
  virtual ~GradTelemetrySink() = default;
  // fusedamp::grad_stats_(grads, found_inf, sum_sq) over `grads`, the gradients of `params`
  // (same order), adding what it sees to this iteration's record.
  virtual void grad_stats(at::TensorList params, at::TensorList grads,
                          const at::Tensor& found_inf, const at::Tensor& sum_sq) = 0;
  // grad_stats() where the caller runs the pass itself: pass(telemetry) writes found_inf,
  // sum_sq and (given a telemetry tensor) its slots as grad_stats_ over `grads` would. A sink
  // that records nothing of its own may leave it to grad_stats().
  virtual void grad_stats_by(at::TensorList params, at::TensorList grads,
                             const at::Tensor& found_inf, const at::Tensor& sum_sq,
                             c10::function_ref<void(const std::optional<at::Tensor>&)> pass) {
    (void)pass;
    grad_stats(params, grads, found_inf, sum_sq);
  }
  // fusedamp::unscale_and_check_(grads, found_inf, inv_scale), recording the gradients as they
  // were before unscaling, in the same pass.
  virtual void unscale_and_check(at::TensorList params, at::TensorList grads,
                                 const at::Tensor& found_inf, const at::Tensor& inv_scale) = 0;
  // A pass whose statistics were gathered without this sink and reduced across the processes
  // that hold the other shards (ShardedGradStats): `slots` is grad_stats_'s telemetry tensor
  // (FP64[4]; the first non-finite position counted in `params`), `sum_sq` its sum of squares
  // (FP32[1]), `elements` the gradient elements of all processes' shards. `grads` give only
  // their dtypes.
  virtual void add_pass(at::TensorList params, at::TensorList grads, const at::Tensor& slots,
                        const at::Tensor& sum_sq, double elements) = 0;
};

// The recorded iterations, oldest first (at most the capacity).
struct TelemetryLog {
  std::vector<int64_t> step;          // iteration number (update() calls since construction)
  std::vector<double> scale;          // the loss scale the iteration's gradients carried
  std::vector<bool> found_inf;        // a gradient held inf/NaN (the step was skipped)
  std::vector<double> grad_norm;      // global L2 norm of the unscaled gradients
  std::vector<double> amax;           // largest finite |gradient| of the scaled gradients
  std::vector<double> underflow_fraction;  // elements that are zero or subnormal in their dtype
  std::vector<double> subnormal_fraction;  // of them, the subnormal ones (nonzero: certainly
                                           // lost precision; zeros may also be structural)
  std::vector<at::Tensor> first_nonfinite;  // the parameter whose gradient overflowed first,
                                            // undefined where none did (or it no longer exists)
  std::vector<double> dtype_max;  // largest finite value of the narrowest gradient dtype the
                                  // iteration walked (65504 for FP16), NaN where none
};

}  // namespace fusedamp
