#pragma once
// Phase 2 of a step, per device: found_inf and the sum of squares of the gradients on each
// device the optimizer's parameters live on, combined so that every device's fused update
// (and a caller, through the primary device's tensor) sees the global values.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <fusedamp/telemetry.h>

#include <vector>

#include "../cpu/checked_rows.h"

namespace fusedamp::optim::detail {

class DeviceStats {
 public:
  // The slot of `device`, created on first use. Slot 0 is the primary device.
  size_t slot_of(const c10::Device& device);
  bool empty() const { return devices_.empty(); }
  const c10::Device& primary_device() const { return devices_.front().device; }

  // The parameters whose gradients each device's pass reads (laid out by the bucket plan when
  // it is rebuilt) and, by position, this step's gradients of them (refreshed every step).
  void clear_params();
  // Appends `params` to the slot's list; returns the position of the first.
  size_t add_params(size_t slot, const std::vector<at::Tensor>& params);
  void set_grad(size_t slot, size_t position, const at::Tensor& grad) {
    devices_[slot].grads[position] = grad;
  }
  // `count` of the slot's gradient handles from `position` on (valid until the next
  // clear_params/add_params).
  at::TensorList grads(size_t slot, size_t position, size_t count) const {
    return at::TensorList(devices_[slot].grads).slice(position, count);
  }
  // Drops this step's gradient handles (see BucketPlan::release_grads).
  void release_grads();
  // The slot's gradients as this step's checked rows give them, in the slot's order (set by
  // the bucket plan where every gradient of the slot is in such rows; emptied with the
  // handles): run_pass then reads them there instead of through their metadata.
  std::vector<cpu::GradSpan>& checked_grads(size_t slot) { return devices_[slot].checked; }

  // found_inf = seed (or 0) and sum_sq = 0 everywhere, without a pass (the flag is known).
  void seed(const at::Tensor& seed_found_inf);
  // seed(), then grad_stats_ over every device's gradients (through `sink` when given: a
  // loss scaler's telemetry), then combine().
  void run_pass(const at::Tensor& seed_found_inf, GradTelemetrySink* sink = nullptr);
  // The values are this step's (seed or run_pass since the last invalidate()), and whether a
  // pass over the gradients produced them.
  bool valid() const { return valid_; }
  bool from_pass() const { return from_pass_; }
  void invalidate() { valid_ = from_pass_ = false; }
  // Copies the primary device's values to the others (after a caller changed them in place).
  void broadcast_primary();

  // [found_inf, sum_sq] of the primary device (FP32[2]) and the views of any device's.
  const at::Tensor& primary() const { return devices_.front().stats; }
  const at::Tensor& found_inf(size_t slot) const { return devices_[slot].found_inf; }
  const at::Tensor& sum_sq(size_t slot) const { return devices_[slot].sum_sq; }

 private:
  struct PerDevice {
    c10::Device device = c10::Device(c10::kCPU);
    at::Tensor stats;  // FP32[2]: found_inf, sum of squares
    // Views of stats[0] and stats[1], made once: a step uses them several times, and each
    // narrow() is an ATen call (a fixed host cost of every step).
    at::Tensor found_inf, sum_sq;
    std::vector<at::Tensor> grads;
    std::vector<at::Tensor> params;  // of grads, same order (what a sink records)
    std::vector<cpu::GradSpan> checked;
  };
  void combine();

  std::vector<PerDevice> devices_;
  bool valid_ = false;
  bool from_pass_ = false;
};

}  // namespace fusedamp::optim::detail
