#pragma once
// The gradients of a list of parameters, read in order with their metadata asked for ahead.
// Reaching a parameter's .grad is a chain of dependent loads (the parameter's TensorImpl, its
// autograd metadata, the gradient's TensorImpl, the gradient's StorageImpl where the data
// pointer lives); with thousands of parameters each link is a cache miss, and a walk that
// meets them unannounced waits for every one in turn. The lookahead starts each link a few
// positions before the walk needs it, once the link before it has had time to arrive, and
// keeps the gradient handles it found on the way, so each .grad is looked up once.
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <torch/csrc/autograd/variable.h>

#include <array>

#include "../ops/tensor_prefetch.h"

namespace fusedamp::optim::detail {

// A parameter's .grad: what Tensor::grad() returns, without its check for non-leaf tensors (an
// out-of-line autograd call per parameter and step, measurable with thousands of parameters;
// an optimizer's parameters are leaves). TensorImpl::grad() is still a call into c10.
inline const at::Tensor& grad_of(const at::Tensor& param) {
  return param.unsafeGetTensorImpl()->grad();
}

class GradLookahead {
 public:
  // with_storages: the walk also reads the data pointers (of the parameters and gradients).
  GradLookahead(at::TensorList params, bool with_storages)
      : params_(params), with_storages_(with_storages) {
    for (size_t i = 0; i < kGradAhead && i < params.size(); ++i) {
      found_[i] = &grad_of(params[i]);
    }
  }

  // grad_of(params[i]), for i = 0, 1, 2, ... in turn; asks for what later positions need.
  const at::Tensor& grad_at(size_t i) {
    const size_t n = params_.size();
    if (i + kImplAhead < n) {
      prefetch_tensor_metadata(params_[i + kImplAhead], /*with_storage=*/false);
    }
    if (i + kMetaAhead < n) {
      prefetch_grad_member(params_[i + kMetaAhead]);
    }
    if (i + kGradAhead < n) {
      const at::Tensor& param = params_[i + kGradAhead];
      const at::Tensor& grad = grad_of(param);
      found_[(i + kGradAhead) % kRing] = &grad;
      prefetch_tensor_metadata(grad, /*with_storage=*/false);
      if (with_storages_) {
        prefetch_tensor_metadata(param, /*with_storage=*/true);
      }
    }
    if (with_storages_ && i + kGradStorageAhead < n) {
      // Its TensorImpl was asked for kGradAhead - kGradStorageAhead positions ago.
      prefetch_tensor_metadata(*found_[(i + kGradStorageAhead) % kRing], /*with_storage=*/true);
    }
    return *found_[i % kRing];
  }

 private:
  // Distances in positions, one stage per link of the chain.
  static constexpr size_t kImplAhead = 32;        // the parameter's TensorImpl
  static constexpr size_t kMetaAhead = 16;        // its autograd metadata
  static constexpr size_t kGradAhead = 8;         // the gradient's TensorImpl (and the
                                                  // parameter's StorageImpl)
  static constexpr size_t kGradStorageAhead = 4;  // the gradient's StorageImpl
  static constexpr size_t kRing = 16;             // > kGradAhead: handles found, not yet used
  static_assert(kRing > kGradAhead && kGradAhead > kGradStorageAhead);

  // The line of the autograd metadata that TensorImpl::grad() reads first (its vtable
  // pointer) and the one holding the .grad member, which may be the next.
  static void prefetch_grad_member(const at::Tensor& param) {
    const c10::AutogradMetaInterface* meta = param.unsafeGetTensorImpl()->autograd_meta();
    if (meta == nullptr) {
      return;
    }
    __builtin_prefetch(meta);
    __builtin_prefetch(&static_cast<const torch::autograd::AutogradMeta*>(meta)->grad_);
  }

  at::TensorList params_;
  bool with_storages_;
  std::array<const at::Tensor*, kRing> found_{};
};

}  // namespace fusedamp::optim::detail
