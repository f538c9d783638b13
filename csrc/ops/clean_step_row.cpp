// checks::clean_step_row (checks.h): a step's row taken in one read of its tensors, where that
// read shows every check of the row passing.
//
// step_row reads each tensor's facts, judges them rule by rule, then takes the addresses and
// the dispatch keys: three reads of every TensorImpl and StorageImpl of the row, through
// accessors each with its own tests. Over thousands of one-element tensors that is most of a
// step's host time. Here each tensor is read once, into what every rule of the row needs, and
// the rules are plain comparisons of those values. The read is conservative: anything it does
// not vouch for (a flaw, a tensor outside the plain CPU dispatch keys, an address only the
// mutable accessors may give) makes it answer false, and step_row, with the op's messages,
// decides the row.
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/COWDeleter.h>
#include <fusedamp/math/quantized_moments_math.h>

#include <cstdint>

#include "checks.h"
#include "step_lists.h"
#include "tensor_facts.h"

namespace fusedamp::checks {
namespace {

using at::Tensor;

// The keys of a dense CPU tensor, with or without autograd: a tensor with others (Python,
// functionalization, sparse or nested layouts, conjugate or negative views) goes to step_row.
const c10::DispatchKeySet kPlainCpuKeys{c10::DispatchKey::CPU, c10::DispatchKey::ADInplaceOrView,
                                        c10::DispatchKey::AutogradCPU,
                                        c10::DispatchKey::AutocastCPU};

// What the row's rules read of one tensor.
struct Plain {
  const c10::TensorImpl* impl;
  char* data;      // element 0, as plain_address gives it
  const char* end;  // data + numel * itemsize (the overlap test's span; data == end: empty)
};

// Reads t as a row needs it. True where it is defined, of plain CPU keys and plain sizes,
// strided, of `dtype`, on `device`, non-overlapping and dense (with `dense`), and its element 0
// has an address the const accessors give: every fact step_row's checks of t's own ask for.
C10_ALWAYS_INLINE bool read_plain(const Tensor& t, const c10::Device& device,
                                  caffe2::TypeMeta dtype, bool dense, c10::DispatchKeySet& keys,
                                  Plain& out) {
  if (!t.defined()) {
    return false;
  }
  const c10::TensorImpl& impl = *t.unsafeGetTensorImpl();
  const c10::DispatchKeySet ks = impl.key_set();
  if (!kPlainCpuKeys.isSupersetOf(ks) || impl.has_symbolic_sizes_strides() ||
      impl.dtype() != dtype || impl.device() != device ||
      (dense && !impl.is_non_overlapping_and_dense())) {
    return false;
  }
  const c10::StorageImpl* storage = impl.unsafe_storage().unsafeGetStorageImpl();
  if (storage == nullptr) {
    return false;
  }
  const c10::DataPtr& data = storage->data_ptr();
  if (data.get() == nullptr || data.get_deleter() == &c10::impl::cow::cow_deleter) {
    return false;
  }
  const auto item = static_cast<int64_t>(dtype.itemsize());
  out.impl = &impl;
  out.data = static_cast<char*>(data.get()) + impl.storage_offset() * item;
  out.end = out.data + impl.numel() * item;
  keys = keys | ks;
  return true;
}

// t has p's shape and (beyond one element) strides: check_same_layout on plain sizes.
C10_ALWAYS_INLINE bool same_layout(const Plain& t, const Plain& p) {
  return same_ints(t.impl->sizes(), p.impl->sizes()) &&
         (t.impl->numel() <= 1 || same_ints(t.impl->strides(), p.impl->strides()));
}

// No two of the row's tensors share a byte (empty ones share none): every check_no_overlap of
// the row.
C10_ALWAYS_INLINE bool all_disjoint(const Plain* t, size_t n) {
  for (size_t a = 0; a < n; ++a) {
    for (size_t b = a + 1; b < n; ++b) {
      const bool empty = t[a].data == t[a].end || t[b].data == t[b].end;
      if (!empty && t[a].data < t[b].end && t[b].data < t[a].end) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

bool clean_step_row(const StepLists& s, size_t i, const Tensor& grad, StepRows& rows) {
  const StepFacts& f = rows.facts;
  const c10::Device& device = f.device;
  const bool has_master = !s.master_params.empty();
  const size_t n = s.state.count;
  const bool quantized = f.quantized;
  // params, grads, master_params, the state lists, block_scales: at most 1 + 1 + 1 + 3 + 1.
  Plain t[3 + StateLists::kMax + 1];
  Plain step;
  c10::DispatchKeySet keys = rows.keys;
  size_t m = 0;
  if (!read_plain(s.params[i], device, c10::scalarTypeToTypeMeta(f.param_dtype), true, keys,
                  t[m++]) ||
      !read_plain(grad, device, c10::scalarTypeToTypeMeta(f.grad_dtype), true, keys, t[m++])) {
    return false;
  }
  if (has_master && !read_plain(s.master_params[i], device,
                                c10::scalarTypeToTypeMeta(f.master_dtype), true, keys, t[m++])) {
    return false;
  }
  for (size_t k = 0; k < n; ++k) {
    if (!read_plain(s.state.lists[k][i], device,
                    c10::scalarTypeToTypeMeta(f.state_list_dtype(k)), true, keys, t[m++])) {
      return false;
    }
  }
  // Every list but the block scales has params[i]'s layout.
  for (size_t k = 1; k < m; ++k) {
    if (!same_layout(t[k], t[0])) {
      return false;
    }
  }
  if (quantized) {
    Plain& q = t[m++];
    if (!read_plain(s.block_scales[i], device, caffe2::TypeMeta::Make<float>(), true, keys, q)) {
      return false;
    }
    // check_block_scales on plain sizes.
    const auto columns = static_cast<int64_t>(n);
    const c10::IntArrayRef sizes = q.impl->sizes();
    if (sizes.size() < 2 || sizes.back() != columns ||
        q.impl->numel() != columns * math::moment_blocks(t[0].impl->numel()) ||
        !q.impl->is_contiguous()) {
      return false;
    }
  }
  if (!all_disjoint(t, m)) {
    return false;
  }
  // steps[i]: check_scalar's one FP32 element on the device (any strides).
  if (!read_plain(s.steps[i], device, caffe2::TypeMeta::Make<float>(), false, keys, step) ||
      step.impl->numel() != 1) {
    return false;
  }
  // Every check passed: the row, as take_addresses writes it.
  StepRow& row = rows.rows[i];  // zeroed by begin_rows
  row.numel = t[0].impl->numel();
  row.param = t[0].data;
  row.grad = t[1].data;
  size_t next = 2;
  if (has_master) {
    row.master = t[next++].data;
  }
  for (size_t k = 0; k < n; ++k) {
    row.state[k] = t[next++].data;
  }
  if (quantized) {
    row.state[n] = t[next].data;
  }
  row.step = reinterpret_cast<float*>(step.data);
  rows.keys = keys;
  return true;
}

}  // namespace fusedamp::checks
