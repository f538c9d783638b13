// The inverse of a loss scale, as torch.amp computes it: the reciprocal in double, rounded once
// to float. Shared by the scaler (unscale_) and the optimizers (a scaled step).
#pragma once

#include <ATen/ATen.h>

#include "small_writes.h"

namespace fusedamp::detail {

// For an FP32 scale this is one ATen call (one kernel launch on a GPU, paid every step) instead
// of three (to double, reciprocal, back to float), and the same number: an IEEE division of
// floats rounded through a double intermediate equals the directly rounded one, because 53 bits
// hold at least 2 * 24 + 2 (double rounding is harmless for +, -, *, / and sqrt then).
// tests/python/test_loss_scale.py compares both with torch's formula over random scales.
// `out` is a handle: its memory is written.
inline void inverse_scale_into(at::Tensor out, const at::Tensor& scale) {
  if (scale.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat) {
    at::reciprocal_out(out, scale.reshape(out.sizes()));
  } else {
    out.copy_(scale.to(at::kDouble).reciprocal().reshape(out.sizes()));
  }
}

// FP32 on the scale's device, in the scale's shape (one element: the ops take any shape of
// one element; no reshape op on every step). Not inverse_scale_into on a new tensor: that is
// one ATen call (the allocation) more on every scaled step.
inline at::Tensor inverse_scale(const at::Tensor& scale) {
  if (scale.scalar_type() == at::kFloat) {
    return at::reciprocal(scale);
  }
  return scale.to(at::kDouble).reciprocal().to(at::kFloat);
}

// The same number, where the scale is a plain FP32 CPU tensor, computed on the host into
// `kept` (the caller's, reused from one step to the next; made here in the scale's shape when
// it has none or another): a CPU scale is host memory, so a step needs no ATen call (an
// allocation and a TensorIterator) for it. Elsewhere (a device, another dtype, a tensor that
// answers through Python such as a FakeTensor) inverse_scale's op. The result is only read.
inline at::Tensor inverse_scale_reusing(const at::Tensor& scale, at::Tensor& kept) {
  if (!plain_cpu(scale) || scale.scalar_type() != at::kFloat || scale.numel() != 1) {
    return inverse_scale(scale);
  }
  if (!kept.defined() || !kept.sizes().equals(scale.sizes())) {
    kept = at::empty(scale.sizes(), at::TensorOptions().dtype(at::kFloat));
  }
  *kept.mutable_data_ptr<float>() =
      static_cast<float>(1.0 / static_cast<double>(*scale.const_data_ptr<float>()));
  return kept;
}

}  // namespace fusedamp::detail
