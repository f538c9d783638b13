// The scaler's gradient passes (see scaler_grads.h).
#include "scaler_grads.h"

#include <ATen/ATen.h>
#include <fusedamp/ops.h>

#include <algorithm>
#include <vector>

namespace fusedamp::detail {
namespace {

// What unscale_and_check_ and grad_stats_ take: strided FP32/FP16/BF16/FP64 tensors, dense or
// not (the ops pass FP64 and non-dense ones to their own per-tensor path).
bool fused_ops_take(const at::Tensor& g) {
  const auto t = g.scalar_type();
  return g.layout() == at::kStrided &&
         (t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble);
}

struct DeviceGrads {
  c10::Device device;
  std::vector<at::Tensor> fused;  // for one fused op
  std::vector<at::Tensor> fused_params;  // whose grads `fused` are
  std::vector<at::Tensor> other;  // one at a time
};

// The parameters' gradients grouped by device (in order); sparse ones as their values.
std::vector<DeviceGrads> grads_by_device(at::TensorList params) {
  std::vector<DeviceGrads> out;
  for (const auto& p : params) {
    at::Tensor g = p.grad();
    if (g.is_sparse()) {
      if (g.scalar_type() == at::kHalf) {
        const_cast<at::Tensor&>(p).mutable_grad() = g.coalesce();
        g = p.grad();
      }
      g = g._values();
    }
    auto it = std::find_if(out.begin(), out.end(),
                           [&](const DeviceGrads& d) { return d.device == g.device(); });
    if (it == out.end()) {
      out.push_back(DeviceGrads{g.device(), {}, {}, {}});
      it = out.end() - 1;
    }
    if (fused_ops_take(g)) {
      it->fused.push_back(g);
      it->fused_params.push_back(p);
    } else {
      it->other.push_back(g);
    }
  }
  return out;
}

// Runs `pass(grads of one device, that device's flag)` per device; returns the flags summed on
// `target`. 0-dim, as torch.amp's: torch's fused optimizers combine them with 0-dim step counts.
template <typename Pass>
at::Tensor flag_over_devices(at::TensorList params, const c10::Device& target,
                             const Pass& pass) {
  auto total = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(target));
  for (auto& grads : grads_by_device(params)) {
    auto flag = grads.device == target
                    ? total
                    : at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(grads.device));
    pass(grads, flag);
    if (grads.device != target) {
      total.add_(flag.to(target, /*non_blocking=*/true));
    }
  }
  return total;
}

// flag += 1 where g holds an inf or NaN (device ops, no sync).
void flag_nonfinite(const at::Tensor& g, at::Tensor& flag) {
  flag.add_(at::logical_not(at::isfinite(g)).any());
}

}  // namespace

at::Tensor unscale_grads(at::TensorList params, const at::Tensor& inv_scale,
                         const c10::Device& target, GradTelemetrySink* telemetry) {
  return flag_over_devices(params, target, [&](DeviceGrads& grads, at::Tensor& flag) {
    const auto inv = inv_scale.device() == grads.device
                         ? inv_scale
                         : inv_scale.to(grads.device, /*non_blocking=*/true);
    if (!grads.fused.empty() && telemetry != nullptr) {
      telemetry->unscale_and_check(grads.fused_params, grads.fused, flag, inv.reshape({1}));
    } else if (!grads.fused.empty()) {
      ops::unscale_and_check_({grads.fused, flag, inv.reshape({1})});
    }
    for (auto& g : grads.other) {
      flag_nonfinite(g, flag);
      g.mul_(inv.to(g.scalar_type()));
    }
  });
}

at::Tensor check_grads(at::TensorList params, const c10::Device& target,
                       GradTelemetrySink* telemetry) {
  return flag_over_devices(params, target, [&](DeviceGrads& grads, at::Tensor& flag) {
    if (telemetry != nullptr && !grads.fused.empty()) {
      // The norm goes to the record only.
      telemetry->grad_stats(grads.fused_params, grads.fused, flag, at::zeros({1}, flag.options()));
    } else if (!grads.fused.empty()) {
      ops::grad_stats_({grads.fused, flag, at::zeros_like(flag)});
    }
    for (const auto& g : grads.other) {
      flag_nonfinite(g, flag);
    }
  });
}

}  // namespace fusedamp::detail
