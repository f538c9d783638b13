#pragma once
// The element addresses of a fused step's tensors, one row per list position, taken by the
// argument checks (op_checks.cpp) while each tensor's metadata is still in cache, for a backend
// whose kernels walk host memory (the CPU). Without them the kernels would look up every
// TensorImpl and StorageImpl a second time after the checks: in a step over thousands of small
// tensors, those cache misses were a third of the host time (perf, issue 13).
#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/COWDeleter.h>

#include <cstdint>
#include <vector>

#include "tensor_facts.h"

namespace fusedamp {

// Position i of a step's lists. One cache line, so a kernel walking the rows reads memory in
// order. The state lists are the op's, in its order: adam_step_'s exp_avgs, exp_avg_sqs[,
// max_exp_avg_sqs]; sgd_step_'s momentum_buffers.
struct StepRow {
  void* param;
  void* grad;
  void* master;    // master_params[i]; nullptr when the op has no master_params
  void* state[3];  // nullptr past the op's state lists
  float* step;     // steps[i]'s one element
  int64_t numel;   // of params[i], and so of every tensor of the row
};
static_assert(sizeof(StepRow) == 64, "a StepRow is one cache line");

struct StepAddresses {
  std::vector<StepRow> rows;
  // Some address could not be taken through the const accessors the checks use: a storage
  // whose data is copy-on-write (a write must first give it its own copy), one without memory
  // although the tensor has elements, sizes that are not plain values. The backend then takes
  // every address through the tensors' mutable accessors instead, after the checks, so that
  // torch's own handling (the copy, its error) applies.
  bool needs_mutable_access = false;

  // ---- rows a caller keeps from one call to the next over the same lists ------------------
  // (the engine keeps one per bucket and lends it to each step: StepRowsLoan). The first call
  // checks every tensor and records, besides the rows, what the later calls compare against;
  // a later call then checks only params and grads (new every step) and takes only their
  // addresses: the master weights, state and step counts are the caller's own tensors, the
  // same ones as before, so their metadata (four of a row's six tensors, most of the step's
  // cache misses) is not read again. Anything that differs from the record sends the call
  // back through the full checks, which record anew.
  bool kept = false;         // by a caller, across calls (set by StepRowsLoan)
  bool state_taken = false;  // the rows' master/state/step addresses are checked and current
  c10::ScalarType param_dtype = c10::ScalarType::Undefined;  // of params then
  c10::Device param_device = c10::Device(c10::kCPU);
  // Per row, params[i]'s sizes then strides when the state was taken, from param_layout_at[i]
  // (param_layout_at[n] ends the last row).
  std::vector<int64_t> param_layouts;
  std::vector<size_t> param_layout_at;
  // The state's memory, held while its addresses are: a state tensor given other memory
  // (`set_`, `.data =`) must leave no dangling address behind (its new memory is not seen
  // until the caller rebuilds; the engine documents it).
  std::vector<c10::Storage> state_storages;
  // The dispatch keys of those tensors together (the engine's call needs no dispatcher to
  // read them again: engine/step_dispatch.h).
  c10::DispatchKeySet state_keys;

  // ---- rows taken ahead by the caller (checks::take_held_row) -------------------------------
  // A caller that walks the params and grads anyway, right before the call (the engine's
  // gradient walk of a whole step), checks them there with the op's own checks and takes
  // their addresses while their metadata is in cache; the call then skips its own walk of
  // them (a third of a whole AMP step over 10,000 one-element tensors was those walks
  // reading the same metadata again: perf, issue 13). Set by the caller once every row is
  // taken, for the next call only: the call clears it, whatever it does.
  bool rows_taken = false;
  c10::ScalarType rows_grad_dtype = c10::ScalarType::Undefined;  // what take_held_row was told

  // Before a caller's walk that takes rows: nothing taken yet, no row needing the mutable
  // accessors yet (take_held_row sets it, as the call's own walk would).
  void begin_taking_rows() {
    rows_taken = false;
    needs_mutable_access = false;
  }

  // Forgets the record (the next call checks everything and records again).
  void forget() {
    rows_taken = false;
    state_taken = false;
    param_layouts.clear();
    param_layout_at.clear();
    state_storages.clear();
    state_keys = c10::DispatchKeySet();
  }
};

// Lends a caller's kept rows to the next step op this thread runs over exactly these lists
// (the same vectors: params, master_params and steps by address and length), for one call.
// Ops reached otherwise (another thread, other lists, a user's call) never see them.
class StepRowsLoan {
 public:
  StepRowsLoan(StepAddresses& rows, at::TensorList params, at::TensorList master_params,
               at::TensorList steps);
  ~StepRowsLoan();
  StepRowsLoan(const StepRowsLoan&) = delete;
  StepRowsLoan& operator=(const StepRowsLoan&) = delete;
};

// The rows lent for a call over these lists, taken (a second call gets none); nullptr if none.
StepAddresses* borrow_step_rows(at::TensorList params, at::TensorList master_params,
                                at::TensorList steps);

// The address of element 0 of a checked dense tensor, as its mutable accessor would give it
// where that gives the same pointer without side effects; nullptr where it would not (see
// StepAddresses::needs_mutable_access). Reads only the TensorImpl and StorageImpl the checks
// have just read, through inline accessors (has_storage() and storage() are calls into c10;
// a checked strided tensor with plain sizes has its storage in the member they return).
C10_ALWAYS_INLINE void* plain_address(const at::Tensor& t) {
  const c10::TensorImpl& impl = *t.unsafeGetTensorImpl();
  const c10::StorageImpl* storage = impl.unsafe_storage().unsafeGetStorageImpl();
  if (!checks::has_concrete_sizes(impl) || storage == nullptr) {
    return nullptr;
  }
  const c10::DataPtr& data = storage->data_ptr();
  // c10::impl::cow::is_cow_data_ptr's test, inline (it is a call into c10, twice per row).
  if (data.get() == nullptr || data.get_deleter() == &c10::impl::cow::cow_deleter) {
    return nullptr;
  }
  return static_cast<char*>(data.get()) +
         impl.storage_offset() * static_cast<int64_t>(impl.dtype().itemsize());
}

// Starts loading the first elements of a row's tensors, for a kernel that will reach the row a
// few rows later: with many small tensors each is an allocation of its own, one cache miss
// apiece when reached unannounced. A prefetch never faults, so null addresses are harmless.
C10_ALWAYS_INLINE void prefetch_row_elements(const StepRow& row) {
  __builtin_prefetch(row.param, 1);
  __builtin_prefetch(row.grad);
  __builtin_prefetch(row.master, 1);
  __builtin_prefetch(row.state[0], 1);
  __builtin_prefetch(row.state[1], 1);
  __builtin_prefetch(row.state[2], 1);
}

}  // namespace fusedamp
