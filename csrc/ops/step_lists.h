#pragma once
// What every fused step walks, whatever its algorithm (ops.h FUSEDAMP_STEP_ALGORITHMS): its lists, its
// optional device scalars, its modes, and, for a backend whose kernels walk host memory (the
// CPU), one row of element addresses per list position, taken by the argument checks while
// each tensor's metadata is in cache. kernel_entry.h derives a Step from an operator's
// declaration (fusedamp/ops.h) once for every backend.
#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/COWDeleter.h>
#include <c10/macros/Macros.h>
#include <c10/util/ArrayRef.h>
#include <fusedamp/math/clip_math.h>
#include <fusedamp/ops.h>

#include <cstdint>
#include <vector>

#include "static_switch.h"
#include "tensor_facts.h"

namespace fusedamp {

// ---- the device scalars ---------------------------------------------------------------------

// A step's optional device scalars (ops.h StepShared) as raw data pointers, and how a step reads
// them: written once for the host, where the CPU backend reads them (its tensors are plain
// memory), and for the device, where the CUDA kernels read them per block (no value ever
// reaches the host).
struct StepScalarPointers {
  const float* lr = nullptr;           // overrides lr_host
  const float* inv_scale = nullptr;    // 1 if absent
  const float* found_inf = nullptr;    // the step is skipped where *found_inf != 0
  const float* grad_sum_sq = nullptr;  // 0 if absent
  float max_grad_norm = 0.f;           // <= 0: no clipping
  float lr_host = 0.f;                 // used when lr is nullptr

  // A skipped step reads and writes nothing (steps included).
  C10_HOST_DEVICE bool skipped() const { return found_inf != nullptr && *found_inf != 0.f; }
  C10_HOST_DEVICE float learning_rate() const { return lr != nullptr ? *lr : lr_host; }
  // The factor every gradient is multiplied by: the inverse loss scale times the clip
  // coefficient (clip_math.h).
  C10_HOST_DEVICE float grad_multiplier() const {
    return math::grad_multiplier(inv_scale != nullptr ? *inv_scale : 1.f,
                                 grad_sum_sq != nullptr ? *grad_sum_sq : 0.f, max_grad_norm);
  }
};

// ---- element addresses ----------------------------------------------------------------------

// Position i of a step's lists. One cache line, so a kernel walking the rows reads memory in
// order. The state lists are the step's (Step::state), in its order.
struct StepRow {
  void* param;
  void* grad;
  void* master;    // master_params[i]; nullptr when the step has no master_params
  // nullptr past the step's state lists; with quantized state, the one after the last state
  // list is block_scales[i] (adam_step_: state[2], sgd_step_: state[1]).
  void* state[3];
  float* step;     // steps[i]'s one element
  int64_t numel;   // of params[i], and so of every tensor of the row
};
static_assert(sizeof(StepRow) == 64, "a StepRow is one cache line");

// What every row of a step is checked against, derived from the lists' first tensors (and the
// grads' dtype): the device and the dtype of each list.
struct StepFacts {
  c10::Device device = c10::Device(c10::kCPU);
  c10::ScalarType param_dtype = c10::ScalarType::Undefined;
  c10::ScalarType grad_dtype = c10::ScalarType::Undefined;
  c10::ScalarType master_dtype = c10::ScalarType::Undefined;
  c10::ScalarType state_dtype = c10::ScalarType::Undefined;  // of the first state list
  // The state as 8-bit codes with block scales (math/quantized_moments_math.h): Adam's int8
  // exp_avgs and uint8 exp_avg_sqs, SGD's int8 momentum_buffers; the block_scales list.
  bool quantized = false;
  bool operator==(const StepFacts& o) const {
    return device == o.device && param_dtype == o.param_dtype && grad_dtype == o.grad_dtype &&
           master_dtype == o.master_dtype && state_dtype == o.state_dtype &&
           quantized == o.quantized;
  }
  // The dtype of state list k: the first list's, but the uint8 exp_avg_sqs of quantized moments
  // (the second list of a quantized state is Adam's).
  c10::ScalarType state_list_dtype(size_t k) const {
    return quantized && k == 1 ? c10::ScalarType::Byte : state_dtype;
  }
};

// A step's rows: those of one call (kernel_entry.h lends their vector from this thread's pool:
// a call over thousands of tensors allocates nothing once warm), or those a caller keeps and
// checks itself, row by row (checks::step_row).
struct StepRows {
  std::vector<StepRow> rows;
  StepFacts facts;  // what the rows were checked against
  // The dispatch keys of every tensor of the rows, together (checks::step_row).
  c10::DispatchKeySet keys;
  // Some address could not be taken through the const accessors the checks use: a storage
  // whose data is copy-on-write (a write must first give it its own copy), one without memory
  // although the tensor has elements, sizes that are not plain values. The backend then takes
  // every address through the tensors' mutable accessors instead, after the checks, so that
  // torch's own handling (the copy, its error) applies.
  bool needs_mutable_access = false;
};

// The address of element 0 of a checked dense tensor, as its mutable accessor would give it
// where that gives the same pointer without side effects; nullptr where it would not (see
// StepRows::needs_mutable_access). Reads only the TensorImpl and StorageImpl the checks have
// just read, through inline accessors.
C10_ALWAYS_INLINE void* plain_address(const at::Tensor& t) {
  const c10::TensorImpl& impl = *t.unsafeGetTensorImpl();
  const c10::StorageImpl* storage = impl.unsafe_storage().unsafeGetStorageImpl();
  if (!checks::has_concrete_sizes(impl) || storage == nullptr) {
    return nullptr;
  }
  const c10::DataPtr& data = storage->data_ptr();
  // c10::impl::cow::is_cow_data_ptr's test, inline (it is a call into c10, per tensor).
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

// ---- a step -----------------------------------------------------------------------------------

// The per-parameter state lists of a step, which mirror params: adam_step_'s exp_avgs,
// exp_avg_sqs[, max_exp_avg_sqs (AMSGrad)]; sgd_step_'s momentum_buffers (none without
// momentum). Their names are the operator's, for messages.
struct StateLists {
  static constexpr size_t kMax = 3;
  const char* names[kMax] = {};
  at::TensorList lists[kMax];
  size_t count = 0;

  void add(const char* name, at::TensorList list) {
    names[count] = name;
    lists[count++] = list;
  }
};

// The lists of a step and how its weights are kept: what its rows are.
struct StepLists {
  const char* op;  // the operator's qualified name, for messages
  at::TensorList params;
  at::TensorList master_params;  // empty, FP32 masters, int16 remainders or compensations
  at::TensorList grads;
  at::TensorList steps;  // per-tensor step counts, advanced unless the step is skipped
  StateLists state;
  // Quantized state: each param's block scales, one column per state list (adam_step_'s
  // moment_scales, sgd_step_'s momentum_scales, as block_scales_name says); empty otherwise.
  at::TensorList block_scales;
  const char* block_scales_name = "";
  c10::IntArrayRef rounding_seeds;  // stochastic rounding: one seed per tensor; else empty
  bool with_rounding_seeds;         // given (even empty): the checks judge them

  // An algorithm's block scales argument (its descriptor's lists()), named for messages.
  void set_block_scales(const char* name, const std::optional<at::TensorList>& scales) {
    block_scales_name = name;
    block_scales = scales.value_or(at::TensorList());
  }
};

template <typename Hyper>
struct Step : StepLists {
  Hyper hyper;
  float lr = 0.f;  // the numeric learning rate; shared->lr_tensor overrides it
  // The operator's arguments both step ops take (ops.h StepShared), as given: its device
  // scalars (checked: one-element FP32 tensors on the params' device), clipping,
  // adopt_param_edits (master := param where param != rounding of master) and
  // write_back_grads (grads := the multiplied gradient the update used).
  const ops::StepShared* shared = nullptr;
  // Where the backend walks host memory: the rows the checks fill; nullptr otherwise.
  StepRows* rows = nullptr;

  // The device scalars' data pointers, for a backend whose tensors hold memory (not Meta).
  StepScalarPointers scalar_pointers() const {
    StepScalarPointers s;
    s.lr = data_of(shared->lr_tensor);
    s.inv_scale = data_of(shared->inv_scale);
    s.found_inf = data_of(shared->found_inf);
    s.grad_sum_sq = data_of(shared->grad_sum_sq);
    s.max_grad_norm = static_cast<float>(shared->max_grad_norm.value_or(0.0));
    s.lr_host = lr;
    return s;
  }

  // The mode its arguments ask for (checked: step_checks.cpp).
  WeightStore weight_store() const {
    const bool masters = !master_params.empty();
    return master_mode_of_step(
        masters, masters ? master_params[0].scalar_type() : c10::ScalarType::Undefined,
        params.empty() ? c10::ScalarType::Undefined : params[0].scalar_type(),
        !rounding_seeds.empty(), shared->adopt_param_edits);
  }

 private:
  static const float* data_of(const std::optional<at::Tensor>& t) {
    return t && t->defined() ? t->const_data_ptr<float>() : nullptr;
  }
};

// A step operator's algorithm (ops.h StepAlgorithmOf) and its Step.
template <typename Op>
using AlgorithmOf = typename ops::StepAlgorithmOf<Op>::type;
template <typename Op>
using StepOf = Step<typename AlgorithmOf<Op>::Hyper>;

// The Step of a step operator's arguments (kernel_entry.h; step_checks.cpp checks it): the
// lists and arguments every step has, then its algorithm's hyper-parameters and lists.
template <typename Op>
StepOf<Op> step_of(const Op& a) {
  StepOf<Op> s{};
  s.op = Op::kName;
  s.params = a.params;
  s.master_params = a.master_params;
  s.grads = a.grads;
  s.steps = a.steps;
  s.hyper = AlgorithmOf<Op>::hyper(a);
  s.lr = static_cast<float>(a.lr);
  s.shared = &a.shared;
  s.with_rounding_seeds = a.rounding_seeds.has_value();
  s.rounding_seeds = a.rounding_seeds.value_or(c10::IntArrayRef());
  AlgorithmOf<Op>::lists(a, s);
  return s;
}

}  // namespace fusedamp
