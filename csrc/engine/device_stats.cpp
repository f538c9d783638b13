// fusedamp::optim::detail::DeviceStats (see device_stats.h).
#include "device_stats.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <fusedamp/ops.h>

#include "small_writes.h"

namespace fusedamp::optim::detail {

size_t DeviceStats::slot_of(const c10::Device& device) {
  for (size_t i = 0; i < devices_.size(); ++i) {
    if (devices_[i].device == device) {
      return i;
    }
  }
  PerDevice d;
  d.device = device;
  d.stats = at::zeros({2}, at::TensorOptions().dtype(at::kFloat).device(device));
  d.found_inf = d.stats.narrow(0, 0, 1);
  d.sum_sq = d.stats.narrow(0, 1, 1);
  devices_.push_back(std::move(d));
  return devices_.size() - 1;
}

void DeviceStats::clear_params() {
  for (auto& d : devices_) {
    d.checked.clear();
    d.grads.clear();
    d.params.clear();
  }
}

void DeviceStats::release_grads() {
  for (auto& d : devices_) {
    d.checked.clear();
    for (auto& g : d.grads) {
      g.reset();
    }
  }
}

size_t DeviceStats::add_params(size_t slot, const std::vector<at::Tensor>& params) {
  auto& d = devices_[slot];
  const size_t first = d.params.size();
  d.params.insert(d.params.end(), params.begin(), params.end());
  d.grads.resize(d.params.size());
  return first;
}

void DeviceStats::seed(const at::Tensor& seed_found_inf) {
  // A 0-dim or [1] flag (the scaler's are 0-dim, as torch.amp's) broadcasts into found_inf
  // as it is: no reshape op on every step.
  const at::Tensor seed = !seed_found_inf.defined() || seed_found_inf.dim() <= 1
                              ? seed_found_inf
                              : seed_found_inf.reshape({1});
  for (size_t i = 0; i < devices_.size(); ++i) {
    fusedamp::detail::zero_small(sum_sq(i));
    if (seed.defined()) {
      fusedamp::detail::copy_small(found_inf(i), seed);
    } else {
      fusedamp::detail::zero_small(found_inf(i));
    }
  }
  valid_ = true;
  from_pass_ = false;
}

void DeviceStats::run_pass(const at::Tensor& seed_found_inf, GradTelemetrySink* sink) {
  seed(seed_found_inf);
  // Straight to the backend kernels: grad_stats_ reads the grads and writes only the engine's
  // own found_inf and sum_sq (and the sink's record): no autograd checks or version counters.
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  for (size_t i = 0; i < devices_.size(); ++i) {
    auto& d = devices_[i];
    if (d.grads.empty()) {
      continue;
    }
    if (!d.checked.empty()) {
      // The gradients of rows checked this step, read through the rows (checked_rows.h).
      const auto pass = [&](const std::optional<at::Tensor>& telemetry) {
        RECORD_FUNCTION(ops::GradStats::kName, std::vector<c10::IValue>());
        cpu::grad_stats_on_checked_rows({at::TensorList(), found_inf(i), sum_sq(i), std::nullopt,
                                         telemetry},
                                        d.checked);
      };
      if (sink != nullptr) {
        sink->grad_stats_by(d.params, d.grads, found_inf(i), sum_sq(i), pass);
      } else {
        pass(std::nullopt);
      }
    } else if (sink != nullptr) {
      sink->grad_stats(d.params, d.grads, found_inf(i), sum_sq(i));
    } else {
      ops::grad_stats_({d.grads, found_inf(i), sum_sq(i)});
    }
  }
  combine();
  from_pass_ = true;
}

void DeviceStats::combine() {
  if (devices_.size() < 2) {
    return;
  }
  auto& primary = devices_.front();
  for (size_t i = 1; i < devices_.size(); ++i) {
    primary.stats.add_(devices_[i].stats.to(primary.device, /*non_blocking=*/true));
  }
  broadcast_primary();
}

void DeviceStats::broadcast_primary() {
  for (size_t i = 1; i < devices_.size(); ++i) {
    devices_[i].stats.copy_(devices_.front().stats, /*non_blocking=*/true);
  }
}

}  // namespace fusedamp::optim::detail
