#pragma once
// Writes of a few numbers into the engine's own small tensors (a step's statistics, a
// telemetry record, a fresh overflow flag): on the CPU plain stores into host memory,
// elsewhere the ATen op (a kernel launch on a GPU). Each op is a fixed cost of every step
// (dispatcher, TensorIterator set-up), paid even for one number: over a whole CPU AMP step,
// with the code and metadata out of cache between steps, several microseconds apiece (issue
// 13). The destinations are the engine's, written as its ops write their outputs.
#include <ATen/ATen.h>

#include <cstring>

namespace fusedamp::detail {

// A tensor whose elements are plain host memory the engine may read or write directly.
inline bool plain_cpu(const at::Tensor& t) {
  const c10::TensorImpl& impl = *t.unsafeGetTensorImpl();
  return impl.device_type() == c10::DeviceType::CPU && !impl.is_python_dispatch() &&
         !impl.has_symbolic_sizes_strides() && impl.is_contiguous() && impl.has_storage() &&
         impl.storage().data() != nullptr;
}

// dst = src (copy_'s rules: broadcast, conversion, another device, where the stores do not
// apply).
inline void copy_small(const at::Tensor& dst, const at::Tensor& src) {
  if (plain_cpu(dst) && plain_cpu(src) && dst.scalar_type() == src.scalar_type() &&
      dst.numel() == src.numel()) {
    std::memcpy(dst.mutable_data_ptr(), src.const_data_ptr(), dst.nbytes());
    return;
  }
  dst.copy_(src, /*non_blocking=*/true);
}

// dst = 0.
inline void zero_small(const at::Tensor& dst) {
  if (plain_cpu(dst)) {
    std::memset(dst.mutable_data_ptr(), 0, dst.nbytes());
    return;
  }
  dst.zero_();
}

}  // namespace fusedamp::detail
