#pragma once
// Prefetching the metadata of tensors a loop will reach a few iterations later. Host code that
// walks thousands of small tensors (argument checks, kernels taking each tensor's data pointer)
// spends most of its time waiting for each TensorImpl and StorageImpl to arrive from memory,
// one cache miss after another; asking for them ahead overlaps those waits. A prefetch never
// faults, so any tensor (undefined ones included) may be named.
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <initializer_list>

#include "tensor_facts.h"

namespace fusedamp {

// Starts loading `t`'s TensorImpl, or (with_storage; once the TensorImpl is cached, since the
// storage's address is read from it) its StorageImpl, where the data pointer lives.
C10_ALWAYS_INLINE void prefetch_tensor_metadata(const at::Tensor& t, bool with_storage) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (with_storage) {
    __builtin_prefetch(impl->unsafe_storage().unsafeGetStorageImpl());
  } else {
    // Every line the object covers: 184 bytes (torch 2.11) from a 16-byte aligned start
    // span four lines unless the start is line-aligned, and the last holds the fields the
    // checks read first (the dispatch keys, dtype, device).
    const auto* bytes = reinterpret_cast<const char*>(impl);
    __builtin_prefetch(bytes);
    __builtin_prefetch(bytes + 64);
    __builtin_prefetch(bytes + 128);
    __builtin_prefetch(bytes + sizeof(c10::TensorImpl) - 1);
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

// Distance of the third stage, for walks that read each tensor's elements: by then its
// TensorImpl and StorageImpl (asked for at kImplAhead and kStorageAhead) are cached.
constexpr size_t kDataAhead = 8;

// Starts loading the first elements of list[i + kDataAhead]; nothing for a tensor without
// plain sizes (its offset may be symbolic) or without memory.
C10_ALWAYS_INLINE void prefetch_data_ahead(size_t i, at::TensorList list) {
  if (i + kDataAhead >= list.size()) {
    return;
  }
  const c10::TensorImpl& impl = *list[i + kDataAhead].unsafeGetTensorImpl();
  const c10::StorageImpl* storage = impl.unsafe_storage().unsafeGetStorageImpl();
  if (storage != nullptr && checks::has_concrete_sizes(impl)) {
    __builtin_prefetch(static_cast<const char*>(storage->data_ptr().get()) +
                       impl.storage_offset() * static_cast<int64_t>(impl.dtype().itemsize()));
  }
}

// Reads the version counter of `t` (an allocation of its own, which an in-place op's
// bump_version() writes), for a walk that bumps `t` a few iterations later: a load rather than a
// prefetch, since torch gives no address of the counter, but one that nothing waits on, so the
// miss overlaps the iterations in between. Inference tensors have no counter: nothing to read.
C10_ALWAYS_INLINE void load_version_counter(const at::Tensor& t) {
  const c10::VariableVersion& version = t.unsafeGetTensorImpl()->version_counter();
  if (version.enabled()) {
    (void)version.current_version();
  }
}

}  // namespace fusedamp
