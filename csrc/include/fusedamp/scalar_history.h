#pragma once
// The last `capacity` values of a per-step device scalar (a gradient norm, a loss scale), kept
// on the device in a ring that the op computing each value writes into (account_step_,
// update_scale_): the slot is chosen on the host, so recording costs no op of its own and no
// synchronisation. Read oldest first, as a tensor of its own.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

namespace fusedamp {

class ScalarHistory {
 public:
  explicit ScalarHistory(int64_t capacity) : capacity_(capacity) {
    TORCH_CHECK(capacity > 0, "fusedamp: a history needs a capacity >= 1, got ", capacity);
  }

  int64_t capacity() const { return capacity_; }

  // The ring for the next value, on `device`: allocated there when first asked for (or when
  // the values move to another device: the history starts again there). Not filled: only
  // recorded slots are ever read, and on the CPU the pages of a ring nobody has written yet
  // are not resident (a short run's peak memory stays its own).
  const at::Tensor& ring_on(const c10::Device& device) {
    if (!ring_.defined() || ring_.device() != device) {
      ring_ = at::empty({capacity_}, at::TensorOptions().dtype(at::kFloat).device(device));
      recorded_ = 0;
    }
    return ring_;
  }
  // Where the next value goes in ring_on()'s ring; record() once it was written there.
  int64_t next_slot() const { return recorded_ % capacity_; }
  void record() { ++recorded_; }

  // The last recorded value (FP32[1], a tensor of its own); undefined before one.
  at::Tensor last() const {
    if (recorded_ == 0) {
      return at::Tensor();
    }
    return ring_.narrow(0, (recorded_ - 1) % capacity_, 1).clone();
  }

  // The recorded values, oldest first (FP32, on the ring's device; empty before one).
  at::Tensor values() const {
    if (recorded_ == 0) {
      return at::empty({0}, at::TensorOptions().dtype(at::kFloat));
    }
    if (recorded_ <= capacity_) {
      return ring_.narrow(0, 0, recorded_).clone();
    }
    const int64_t oldest = recorded_ % capacity_;
    return at::cat({ring_.narrow(0, oldest, capacity_ - oldest), ring_.narrow(0, 0, oldest)});
  }

  // Replaces the values (oldest first; the last `capacity` kept), e.g. carried over to a
  // rebuilt owner. Checked before anything changes.
  void assign(const at::Tensor& values, const char* who) {
    TORCH_CHECK(values.dim() == 1 && values.is_floating_point(), who,
                ": a history is a 1-D floating-point tensor, got ", values.scalar_type(),
                " of shape ", values.sizes());
    const int64_t kept = std::min<int64_t>(values.numel(), capacity_);
    at::Tensor ring;  // none until a value is recorded where there is nothing to keep
    if (kept > 0) {
      ring = at::empty({capacity_}, values.options().dtype(at::kFloat));
      ring.narrow(0, 0, kept).copy_(values.narrow(0, values.numel() - kept, kept));
    }
    ring_ = std::move(ring);
    recorded_ = kept;
  }

  // Forgets every value (the ring is kept).
  void clear() { recorded_ = 0; }

 private:
  int64_t capacity_;
  at::Tensor ring_;
  int64_t recorded_ = 0;
};

}  // namespace fusedamp
