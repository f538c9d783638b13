#pragma once
// Prefetching the metadata of tensors a loop will reach a few iterations later. Host code that
// walks thousands of small tensors (argument checks, kernels taking each tensor's data pointer)
// spends most of its time waiting for each TensorImpl and StorageImpl to arrive from memory,
// one cache miss after another; asking for them ahead overlaps those waits. A prefetch never
// faults, so any tensor (undefined ones included) may be named.
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <initializer_list>

namespace fusedamp {

// Starts loading `t`'s TensorImpl, or (with_storage; once the TensorImpl is cached, since the
// storage's address is read from it) its StorageImpl, where the data pointer lives.
C10_ALWAYS_INLINE void prefetch_tensor_metadata(const at::Tensor& t, bool with_storage) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (with_storage) {
    __builtin_prefetch(impl->unsafe_storage().unsafeGetStorageImpl());
  } else {
    const auto* bytes = reinterpret_cast<const char*>(impl);
    __builtin_prefetch(bytes);
    __builtin_prefetch(bytes + 64);
    __builtin_prefetch(bytes + 128);
  }
}

// Distances in list positions: TensorImpls twice as far ahead as their storages.
constexpr size_t kImplAhead = 32;
constexpr size_t kStorageAhead = 16;

// Called at position i of a walk over parallel lists: prefetches what positions
// i + kImplAhead (TensorImpls) and i + kStorageAhead (StorageImpls) will read.
C10_ALWAYS_INLINE void prefetch_ahead(size_t i, std::initializer_list<at::TensorList> lists) {
  for (const auto& list : lists) {
    if (i + kImplAhead < list.size()) {
      prefetch_tensor_metadata(list[i + kImplAhead], false);
    }
    if (i + kStorageAhead < list.size()) {
      prefetch_tensor_metadata(list[i + kStorageAhead], true);
    }
  }
}

// The same for a walk over parameters that reads each one's .grad: the parameter's TensorImpl
// at i + kImplAhead, its autograd metadata (where .grad is kept) at i + kStorageAhead, and
// the gradient's TensorImpl at i + kStorageAhead / 2.
C10_ALWAYS_INLINE void prefetch_grads_ahead(size_t i, at::TensorList params) {
  if (i + kImplAhead < params.size()) {
    prefetch_tensor_metadata(params[i + kImplAhead], false);
  }
  if (i + kStorageAhead < params.size()) {
    __builtin_prefetch(params[i + kStorageAhead].unsafeGetTensorImpl()->autograd_meta());
  }
  if (i + kStorageAhead / 2 < params.size()) {
    // TensorImpl::grad(): the .grad of Tensor::grad() without its non-leaf warning.
    prefetch_tensor_metadata(params[i + kStorageAhead / 2].unsafeGetTensorImpl()->grad(), false);
  }
}

}  // namespace fusedamp
