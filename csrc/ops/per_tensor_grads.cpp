// unscale_and_check_ and grad_stats_ for grads the fused kernels do not walk (see
// kernel_entry.h): those grads go to ATen ops, with the same contract.
#include <ATen/ATen.h>
#include <fusedamp/math/telemetry_math.h>

#include <limits>
#include <vector>

#include "kernel_entry.h"

namespace fusedamp::kernels {

using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;
namespace {

// The smallest normal number of a per-tensor grad's own dtype (FP64 included).
double smallest_normal_of(c10::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble:
      return std::numeric_limits<double>::min();
    case at::kHalf:
      return math::smallest_normal<c10::Half>();
    default:
      return math::smallest_normal<float>();
  }
}

// telemetry (math::TelemetrySlot) combined with one grad's values, as ATen ops on the device.
void add_telemetry(const Tensor& telemetry, const Tensor& g, const Tensor& nonfinite,
                   int64_t position) {
  if (g.numel() > 0) {
    const Tensor magnitude = g.abs().to(at::kDouble);
    const Tensor finite_magnitude = at::where(at::isfinite(magnitude), magnitude, 0.0);
    Tensor amax = telemetry.narrow(0, math::kAmax, 1);
    amax.copy_(at::maximum(amax, finite_magnitude.max().reshape({1})));
    const Tensor small = (magnitude < smallest_normal_of(g.scalar_type())).sum();
    const Tensor zero = (magnitude == 0.0).sum();
    telemetry.narrow(0, math::kSubnormal, 1).add_(small - zero);
    telemetry.narrow(0, math::kZero, 1).add_(zero);
  }
  Tensor first = telemetry.narrow(0, math::kFirstNonfinite, 1);
  first.copy_(at::where(nonfinite.to(at::kBool),
                        at::minimum(first, at::full_like(first, static_cast<double>(position))),
                        first));
}

}  // namespace

void grad_stats_split(void (*fused_stats)(const ops::GradStats&), const ops::GradStats& op) {
  const TensorList grads = op.grads;
  const Tensor& found_inf = op.found_inf;
  const Tensor& sum_sq = op.sum_sq;
  const OptTensor& tensor_flags = op.tensor_flags;
  const OptTensor& telemetry = op.telemetry;
  const bool want_flags = tensor_flags.has_value() && tensor_flags->defined();
  const bool want_telemetry = telemetry.has_value() && telemetry->defined();
  std::vector<Tensor> fused;
  std::vector<int64_t> fused_positions;
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor& g = grads[i];
    if (!checks::per_tensor_grad(g)) {
      fused.push_back(g);
      fused_positions.push_back(static_cast<int64_t>(i));
      continue;
    }
    // 1 where g holds inf/NaN, 0-dim FP32: OR-ed in, never reset, into one-element tensors
    // of either shape (found_inf may be 0-dim or [1]; a 0-dim value broadcasts into both).
    const Tensor nonfinite = at::isfinite(g).logical_not().any().to(at::kFloat);
    found_inf.copy_(at::maximum(found_inf, nonfinite));
    sum_sq.add_(g.to(at::kDouble).square().sum().to(at::kFloat));
    if (want_flags) {
      Tensor flag = tensor_flags->narrow(0, static_cast<int64_t>(i), 1);
      flag.copy_(at::maximum(flag, nonfinite));
    }
    if (want_telemetry) {
      add_telemetry(*telemetry, g, nonfinite, static_cast<int64_t>(i));
    }
  }
  if (fused.empty()) {
    return;
  }
  if (!want_flags && !want_telemetry) {
    fused_stats(ops::GradStats{fused, found_inf, sum_sq});
    return;
  }
  // The kernel flags and counts by list position: give it lists of its own, then merge each
  // flag back in place (one small op per grad, but no host-to-device copy of positions, which
  // would sync). Its first non-finite position is recovered from its flags the same way.
  const Tensor fused_flags = at::zeros({static_cast<int64_t>(fused.size())},
                                       found_inf.options());
  OptTensor fused_telemetry;
  if (want_telemetry) {
    fused_telemetry = at::zeros({math::kTelemetrySlots}, telemetry->options());
  }
  fused_stats(ops::GradStats{fused, found_inf, sum_sq, fused_flags, fused_telemetry});
  if (want_telemetry) {
    Tensor amax = telemetry->narrow(0, math::kAmax, 1);
    amax.copy_(at::maximum(amax, fused_telemetry->narrow(0, math::kAmax, 1)));
    telemetry->narrow(0, math::kSubnormal, 2).add_(fused_telemetry->narrow(0, math::kSubnormal, 2));
  }
  for (size_t k = 0; k < fused.size(); ++k) {
    const Tensor fused_flag = fused_flags.narrow(0, static_cast<int64_t>(k), 1);
    if (want_flags) {
      Tensor flag = tensor_flags->narrow(0, fused_positions[k], 1);
      flag.copy_(at::maximum(flag, fused_flag));
    }
    if (want_telemetry) {
      Tensor first = telemetry->narrow(0, math::kFirstNonfinite, 1);
      first.copy_(at::where(fused_flag.to(at::kBool),
                            at::minimum(first, at::full_like(first, static_cast<double>(
                                                                       fused_positions[k]))),
                            first));
    }
  }
}

// With statistics and such grads (a rare mix), grad_stats_'s own path reads them all first, then
// the plain unscale: the fused grads by the backend, the others by torch's own kernel (which
// torch's op also uses for them).
void unscale_and_check_split(void (*fused_unscale)(const ops::UnscaleAndCheck&),
                             void (*fused_stats)(const ops::GradStats&),
                             const ops::UnscaleAndCheck& op) {
  if (op.sum_sq && op.sum_sq->defined()) {
    grad_stats_split(fused_stats, ops::GradStats{op.grads, op.found_inf, *op.sum_sq,
                                                 std::nullopt, op.telemetry});
  }
  std::vector<Tensor> fused, per_tensor;
  for (const auto& g : op.grads) {
    (checks::per_tensor_grad(g) ? per_tensor : fused).push_back(g);
  }
  fused_unscale(ops::UnscaleAndCheck{fused, op.found_inf, op.inv_scale});
  Tensor found_inf = op.found_inf;  // the same tensor; torch's signature takes Tensor&
  at::_amp_foreach_non_finite_check_and_unscale_(per_tensor, found_inf, op.inv_scale);
}

}  // namespace fusedamp::kernels
