#include "op_checks.h"

#include <fusedamp/math/telemetry_math.h>

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>

#include "hyper_params.h"
#include "step_addresses.h"
#include "tensor_facts.h"
#include "tensor_prefetch.h"

namespace fusedamp::checks {
namespace {

// Every check below decides on facts alone, inline and without a message; the message of a
// failed check is built by a raise_* function, out of line, so that the hot path stays small.
// ---- one-element state tensors (found_inf, inv_scale, steps[i], ...) ------------------------
[[noreturn]] C10_NOINLINE void raise_scalar(const char* op, const char* name, const Tensor& t,
                                            ScalarFlaw flaw, c10::ScalarType dtype,
                                            const c10::Device& device) {
  TORCH_CHECK(flaw != ScalarFlaw::kUndefined, op, ": ", name, " is undefined");
  TORCH_CHECK(flaw != ScalarFlaw::kNotStrided, op, ": ", name, " must be a dense tensor");
  TORCH_CHECK(flaw != ScalarFlaw::kNotOneElement, op, ": ", name,
              " must have exactly one element, got ", t.sym_numel());
  TORCH_CHECK(flaw != ScalarFlaw::kDtype, op, ": ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(false, op, ": ", name, " is on ", t.device(), " but the other tensors are on ",
              device);
}

C10_ALWAYS_INLINE void check_scalar(const char* op, const char* name, const Tensor& t,
                                    c10::ScalarType dtype, const c10::Device& device) {
  const ScalarFlaw flaw = scalar_flaw(t, dtype, device);
  if (C10_UNLIKELY(flaw != ScalarFlaw::kNone)) {
    raise_scalar(op, name, t, flaw, dtype, device);
  }
}

// ---- the tensors of a list (see tensor_facts.h) ---------------------------------------------

// Kernels walk each tensor as one flat block of memory.
[[noreturn]] C10_NOINLINE void raise_flaw(const char* op, const char* list, size_t i,
                                          const TensorFacts& f, const c10::Device& device) {
  const Tensor& t = *f.tensor;
  TORCH_CHECK(f.flaw != Flaw::kUndefined, op, ": ", list, "[", i, "] is undefined");
  TORCH_CHECK(f.flaw != Flaw::kNotStrided, op, ": ", list, "[", i,
              "] is sparse (or not strided); only dense tensors are supported");
  TORCH_CHECK(f.flaw != Flaw::kOtherDevice, op, ": ", list, "[", i, "] is on ", t.device(),
              " but ", "the first tensor is on ", device, "; all tensors must share one device");
  TORCH_CHECK(false, op, ": ", list, "[", i,
              "] must be non-overlapping and dense (e.g. contiguous); got sizes ", t.sym_sizes(),
              " strides ", t.sym_strides());
}

C10_ALWAYS_INLINE void check_dense(const char* op, const char* list, size_t i,
                                   const TensorFacts& f, const c10::Device& device) {
  if (C10_UNLIKELY(f.flaw != Flaw::kNone)) {
    raise_flaw(op, list, i, f, device);
  }
}

// What a list's dtype must be, as its message says it.
enum class DtypeRule : uint8_t {
  kLikeParams0,  // params: params[0]'s
  kLikeGrads0,   // grads of a step: grads[0]'s
  kLikeList0,    // master_params and the state lists: their own list's [0] (checked once)
  kFloatKind,    // grads of unscale_and_check_ / grad_stats_: FP32, FP16 or BF16
};

[[noreturn]] C10_NOINLINE void raise_dtype(const char* op, const char* list, size_t i,
                                           c10::ScalarType got, c10::ScalarType want,
                                           DtypeRule rule) {
  switch (rule) {
    case DtypeRule::kLikeParams0:
      TORCH_CHECK(false, op, ": params[", i, "] has dtype ", got, " but params[0] has ", want,
                  "; one call takes one params dtype");
    case DtypeRule::kLikeGrads0:
      TORCH_CHECK(false, op, ": grads[", i, "] has dtype ", got, " but grads[0] has ", want);
    case DtypeRule::kLikeList0:
      TORCH_CHECK(false, op, ": ", list, "[", i, "] has dtype ", got, " but ", list,
                  "[0] has ", want, "; one call takes one dtype per list");
    case DtypeRule::kFloatKind:
      break;
  }
  TORCH_CHECK(false, op, ": ", list, "[", i, "] has dtype ", got,
              "; supported are float32, float16 and bfloat16");
}

C10_ALWAYS_INLINE void check_dtype(const char* op, const char* list, size_t i,
                                   const TensorFacts& f, c10::ScalarType want, DtypeRule rule) {
  const bool right = rule == DtypeRule::kFloatKind ? is_float_kind(f.dtype) : f.dtype == want;
  if (C10_UNLIKELY(!right)) {
    raise_dtype(op, list, i, f.dtype, want, rule);
  }
}

// Where t or params[i] has symbolic sizes (torch.compile), their layouts are compared through
// the symbolic-aware accessors, out of line.
C10_NOINLINE bool same_sizes_symbolic(const Tensor& t, const Tensor& params) {
  return t.sym_sizes() == params.sym_sizes();
}

C10_NOINLINE bool same_strides_symbolic(const Tensor& t, const Tensor& params) {
  return t.sym_numel() <= 1 || t.sym_strides() == params.sym_strides();
}

[[noreturn]] C10_NOINLINE void raise_layout(const char* op, const char* list, size_t i,
                                            const Tensor& t, const Tensor& params, bool shape) {
  TORCH_CHECK(!shape, op, ": ", list, "[", i, "] has shape ", t.sym_sizes(), " but params[", i,
              "] has shape ", params.sym_sizes());
  TORCH_CHECK(false, op, ": ", list, "[", i, "] has strides ", t.sym_strides(), " but params[",
              i, "] has strides ", params.sym_strides());
}

// t has params[i]'s shape and (unless it has at most one element) strides.
C10_ALWAYS_INLINE void check_same_layout(const char* op, const char* list, size_t i,
                                         const TensorFacts& t, const TensorFacts& params) {
  const Tensor& a = *t.tensor;
  const Tensor& b = *params.tensor;
  const c10::TensorImpl& ai = *a.unsafeGetTensorImpl();
  const c10::TensorImpl& bi = *b.unsafeGetTensorImpl();
  const bool concrete = C10_LIKELY(t.concrete && params.concrete);
  if (C10_UNLIKELY(!(concrete ? same_ints(ai.sizes(), bi.sizes()) : same_sizes_symbolic(a, b)))) {
    raise_layout(op, list, i, a, b, /*shape=*/true);
  }
  if (C10_UNLIKELY(!(concrete ? ai.numel() <= 1 || same_ints(ai.strides(), bi.strides())
                              : same_strides_symbolic(a, b)))) {
    raise_layout(op, list, i, a, b, /*shape=*/false);
  }
}

[[noreturn]] C10_NOINLINE void raise_overlap(const char* op, size_t i, const char* a_list,
                                             const char* b_list) {
  TORCH_CHECK(false, op, ": ", a_list, "[", i, "] and ", b_list, "[", i,
              "] share memory; each must be its own tensor");
}

C10_ALWAYS_INLINE void check_no_overlap(const char* op, size_t i, const TensorFacts& a,
                                        const char* a_list, const TensorFacts& b,
                                        const char* b_list) {
  if (C10_UNLIKELY(!disjoint(a.span, b.span))) {
    raise_overlap(op, i, a_list, b_list);
  }
}

void check_list_length(const char* op, const char* name, TensorList l, size_t n) {
  TORCH_CHECK(l.size() == n, op, ": ", name, " has ", l.size(), " tensors but params has ", n);
}

void check_finite_nonneg(const char* op, const char* name, double v) {
  TORCH_CHECK(hyper::finite_nonneg(v), op, ": invalid ", name, " ", v,
              " (must be finite and >= 0)");
}

void check_beta(const char* op, const char* name, double v) {
  TORCH_CHECK(hyper::valid_beta(v), op, ": invalid ", name, " ", v, " (must be in [0, 1))");
}

// with_per_tensor: also accept what per_tensor_grad() sends to the per-tensor path; returns
// whether any grad is such.
bool check_grad_list(const char* op, TensorList grads, const c10::Device& device,
                     bool with_per_tensor = false) {
  bool any_per_tensor = false;
  for (size_t i = 0; i < grads.size(); ++i) {
    prefetch_ahead(i, {grads});
    const TensorFacts g = facts_of(grads[i], device);
    if (with_per_tensor && is_per_tensor(g)) {
      any_per_tensor = true;
      continue;
    }
    check_dense(op, "grads", i, g, device);
    check_dtype(op, "grads", i, g, c10::ScalarType::Undefined, DtypeRule::kFloatKind);
  }
  return any_per_tensor;
}

// The per-parameter FP32 state lists of a step (moments or momentum buffers), which must
// mirror params.
struct StateLists {
  static constexpr size_t kMax = 3;  // adam: exp_avgs, exp_avg_sqs[, max_exp_avg_sqs]
  const char* names[kMax] = {};
  TensorList lists[kMax];
  size_t count = 0;

  StateLists& add(const char* name, TensorList list) {
    TORCH_INTERNAL_ASSERT(count < kMax);
    names[count] = name;
    lists[count++] = list;
    return *this;
  }
};

// params[i] and grads[i], the first checks of a step's index i.
C10_ALWAYS_INLINE void check_param_and_grad(const char* op, size_t i, const TensorFacts& p,
                                            const TensorFacts& g, const c10::Device& device,
                                            c10::ScalarType pdtype, c10::ScalarType gdtype) {
  check_dense(op, "params", i, p, device);
  check_dtype(op, "params", i, p, pdtype, DtypeRule::kLikeParams0);
  check_dense(op, "grads", i, g, device);
  check_dtype(op, "grads", i, g, gdtype, DtypeRule::kLikeGrads0);
  check_same_layout(op, "grads", i, g, p);
  check_no_overlap(op, i, g, "grads", p, "params");
}

// The checks of index i of a step's lists. All facts are read first, in one pass over the
// index's tensors (their memory is then fetched together, not one cache miss at a time), then
// judged. The order of the checks decides which mistake a call with several reports: each
// tensor's own facts, its shape and strides against params[i], then its memory against the
// tensors before it, and a state list's also against the later state lists; steps[i] last.
C10_ALWAYS_INLINE void check_step_index(const char* op, size_t i, TensorList params,
                                        TensorList master_params, TensorList grads,
                                        TensorList steps, const StateLists& state,
                                        const c10::Device& device, c10::ScalarType pdtype,
                                        c10::ScalarType gdtype, c10::ScalarType mdtype,
                                        c10::ScalarType sdtype) {
  const bool has_master = !master_params.empty();
  const size_t n = state.count;
  TensorFacts p, g, mp{}, s[StateLists::kMax];
  read_facts(params[i], device, /*with_span=*/true, p);
  read_facts(grads[i], device, /*with_span=*/true, g);
  if (has_master) {
    read_facts(master_params[i], device, /*with_span=*/true, mp);
  }
  for (size_t k = 0; k < n; ++k) {
    read_facts(state.lists[k][i], device, /*with_span=*/true, s[k]);
  }
  const char* const* names = state.names;

  check_param_and_grad(op, i, p, g, device, pdtype, gdtype);
  if (has_master) {
    check_dense(op, "master_params", i, mp, device);
    check_dtype(op, "master_params", i, mp, mdtype, DtypeRule::kLikeList0);
    check_same_layout(op, "master_params", i, mp, p);
    check_no_overlap(op, i, mp, "master_params", p, "params");
    check_no_overlap(op, i, mp, "master_params", g, "grads");
  }
  for (size_t k = 0; k < n; ++k) {
    check_dense(op, names[k], i, s[k], device);
    check_dtype(op, names[k], i, s[k], sdtype, DtypeRule::kLikeList0);
    check_same_layout(op, names[k], i, s[k], p);
    check_no_overlap(op, i, s[k], names[k], p, "params");
    check_no_overlap(op, i, s[k], names[k], g, "grads");
    if (has_master) {
      check_no_overlap(op, i, s[k], names[k], mp, "master_params");
    }
    // The earlier state lists were tested against this one already.
    for (size_t later = k + 1; later < n; ++later) {
      check_no_overlap(op, i, s[k], names[k], s[later], names[later]);
    }
  }
  check_scalar(op, "steps[i]", steps[i], at::kFloat, device);
}

// Index i's row of element addresses (step_addresses.h), once its checks have passed: the
// tensors' metadata is still in cache.
C10_ALWAYS_INLINE void take_addresses(size_t i, TensorList params, TensorList master_params,
                                      TensorList grads, TensorList steps,
                                      const StateLists& state, StepAddresses& out) {
  StepRow& row = out.rows[i];  // zeroed in one block before the walk (per row: a rep stos)
  const c10::TensorImpl& param = *params[i].unsafeGetTensorImpl();
  const bool concrete = has_concrete_sizes(param);
  row.numel = concrete ? param.numel() : 0;
  row.param = plain_address(params[i]);
  row.grad = plain_address(grads[i]);
  bool plain = row.param != nullptr && row.grad != nullptr;
  if (!master_params.empty()) {
    row.master = plain_address(master_params[i]);
    plain = plain && row.master != nullptr;
  }
  for (size_t k = 0; k < state.count; ++k) {
    row.state[k] = plain_address(state.lists[k][i]);
    plain = plain && row.state[k] != nullptr;
  }
  row.step = static_cast<float*>(plain_address(steps[i]));
  // An empty tensor's address is never used.
  if (!concrete || row.step == nullptr || (!plain && row.numel != 0)) {
    out.needs_mutable_access = true;
  }
}

// ---- rows held from an earlier call over the same lists (StepAddresses::state_taken) --------

// params[i]'s sizes and strides are those recorded when the state was taken.
C10_ALWAYS_INLINE bool same_layout_as_recorded(const c10::TensorImpl& param,
                                               const StepAddresses& held, size_t i) {
  const int64_t* recorded = held.param_layouts.data() + held.param_layout_at[i];
  const auto dims = static_cast<size_t>(held.param_layout_at[i + 1] - held.param_layout_at[i]) / 2;
  const c10::IntArrayRef sizes = param.sizes();
  const c10::IntArrayRef strides = param.strides();
  return same_ints(sizes, c10::IntArrayRef(recorded, dims)) &&
         same_ints(strides, c10::IntArrayRef(recorded + dims, dims));
}

// Index i of a call whose rows hold the master/state/step addresses: params[i] and grads[i]
// checked as check_step_index checks them, in its order, and their addresses taken. False
// (nothing raised) where params[i]'s layout is not the recorded one: the call then goes
// through the full checks, which judge it against the state itself.
C10_ALWAYS_INLINE bool check_held_step_index(const char* op, size_t i, const Tensor& param,
                                             const Tensor& grad, const c10::Device& device,
                                             c10::ScalarType pdtype, c10::ScalarType gdtype,
                                             StepAddresses& held) {
  TensorFacts p, g;
  read_facts(param, device, /*with_span=*/true, p);
  read_facts(grad, device, /*with_span=*/true, g);
  check_param_and_grad(op, i, p, g, device, pdtype, gdtype);
  if (C10_UNLIKELY(!p.concrete ||
                   !same_layout_as_recorded(*param.unsafeGetTensorImpl(), held, i))) {
    return false;
  }
  StepRow& row = held.rows[i];
  row.param = plain_address(param);
  row.grad = plain_address(grad);
  if ((row.param == nullptr || row.grad == nullptr) && row.numel != 0) {
    held.needs_mutable_access = true;
  }
  return true;
}

// The walk of a call with held rows; false where it must go through the full checks instead.
bool check_held_step_lists(const char* op, TensorList params, TensorList grads,
                           const c10::Device& device, c10::ScalarType pdtype,
                           c10::ScalarType gdtype, StepAddresses& held) {
  const size_t n = params.size();
  if (held.rows.size() != n || held.param_dtype != pdtype || held.param_device != device) {
    return false;
  }
  held.needs_mutable_access = false;
  for (size_t i = 0; i < n; ++i) {
    prefetch_ahead(i, {params, grads});
    if (!check_held_step_index(op, i, params[i], grads[i], device, pdtype, gdtype, held)) {
      return false;
    }
  }
  return true;
}

// After the full checks of a call whose rows its caller keeps: what the next call compares
// against, and the state's memory, held. Rows that needed the mutable accessors are not kept
// (the backend retakes them; the next call checks everything again).
void record_held_state(TensorList params, TensorList master_params, TensorList steps,
                       const StateLists& state, c10::ScalarType pdtype,
                       const c10::Device& device, StepAddresses& held) {
  held.forget();
  if (held.needs_mutable_access) {
    return;
  }
  const size_t n = params.size();
  held.param_layout_at.reserve(n + 1);
  held.state_storages.reserve(n * (2 + state.count));
  const auto hold = [&](const Tensor& t) {
    held.state_storages.push_back(t.unsafeGetTensorImpl()->unsafe_storage());
    held.state_keys = held.state_keys | t.key_set();
  };
  for (size_t i = 0; i < n; ++i) {
    const c10::TensorImpl& p = *params[i].unsafeGetTensorImpl();
    if (!has_concrete_sizes(p)) {
      held.forget();
      return;
    }
    held.param_layout_at.push_back(held.param_layouts.size());
    held.param_layouts.insert(held.param_layouts.end(), p.sizes().begin(), p.sizes().end());
    held.param_layouts.insert(held.param_layouts.end(), p.strides().begin(), p.strides().end());
    if (!master_params.empty()) {
      hold(master_params[i]);
    }
    for (size_t k = 0; k < state.count; ++k) {
      hold(state.lists[k][i]);
    }
    hold(steps[i]);
  }
  held.param_layout_at.push_back(held.param_layouts.size());
  held.param_dtype = pdtype;
  held.param_device = device;
  held.state_taken = true;
}

// How the weights are kept, from master_params[0]'s dtype (static_switch.h WeightStore): FP32
// masters for any params; int16 remainders for BF16 params; a compensation of the params' own
// 16-bit dtype. Stochastic rounding (rounding_seeds) keeps nothing but BF16 params.
void check_weight_store(const char* op, TensorList params, TensorList master_params,
                        c10::ScalarType pdtype, c10::OptionalIntArrayRef rounding_seeds) {
  const size_t n = params.size();
  if (rounding_seeds.has_value()) {
    TORCH_CHECK(rounding_seeds->size() == n, op, ": rounding_seeds has ", rounding_seeds->size(),
                " seeds but params has ", n, " tensors; one seed per tensor");
    TORCH_CHECK(master_params.empty(), op,
                ": stochastic rounding (rounding_seeds) keeps no master_params; got ",
                master_params.size());
    TORCH_CHECK(pdtype == at::kBFloat16, op,
                ": stochastic rounding (rounding_seeds) is for bfloat16 params, got ", pdtype);
  }
  if (master_params.empty()) {
    return;
  }
  const auto mdtype = master_params[0].defined() ? master_params[0].scalar_type() : pdtype;
  const bool fp32_master = mdtype == at::kFloat;
  const bool split = mdtype == at::kShort && pdtype == at::kBFloat16;
  const bool kahan = mdtype == pdtype && (pdtype == at::kHalf || pdtype == at::kBFloat16);
  TORCH_CHECK(fp32_master || split || kahan, op, ": master_params have dtype ", mdtype,
              " for ", pdtype, " params; supported are float32 (FP32 master weights), int16 "
              "(remainders beside bfloat16 params: master_weights=\"split\") and the params' "
              "own float16/bfloat16 (Kahan compensations: master_weights=\"kahan\")");
}

// The common list checks of adam_step_ and sgd_step_.
void check_step_lists(const char* op, TensorList params, TensorList master_params,
                      TensorList grads, TensorList steps, const StateLists& state,
                      c10::OptionalIntArrayRef rounding_seeds, StepAddresses* addresses) {
  const size_t n = params.size();
  TORCH_CHECK(master_params.empty() || master_params.size() == n, op, ": master_params has ",
              master_params.size(), " tensors; expected 0 (no master weights) or ", n);
  check_list_length(op, "grads", grads, n);
  check_list_length(op, "steps", steps, n);
  for (size_t k = 0; k < state.count; ++k) {
    check_list_length(op, state.names[k], state.lists[k], n);
  }
  if (n == 0) {
    return;
  }
  const auto device = params[0].device();
  const auto pdtype = params[0].scalar_type();
  TORCH_CHECK(is_float_kind(pdtype), op, ": params have dtype ", pdtype,
              "; supported are float32, float16 and bfloat16");
  const auto gdtype = grads[0].defined() ? grads[0].scalar_type() : pdtype;
  TORCH_CHECK(gdtype == pdtype || gdtype == at::kFloat, op, ": grads have dtype ", gdtype,
              " but params have dtype ", pdtype,
              "; grads must have the params' dtype or float32");
  check_weight_store(op, params, master_params, pdtype, rounding_seeds);
  const auto mdtype = master_params.empty() || !master_params[0].defined()
                          ? at::kFloat
                          : master_params[0].scalar_type();
  // The optimizer state (moments, momentum buffers): FP32 or BF16 (state_dtype), one dtype.
  const auto sdtype = state.count == 0 || !state.lists[0][0].defined()
                          ? at::kFloat
                          : state.lists[0][0].scalar_type();
  TORCH_CHECK(sdtype == at::kFloat || sdtype == at::kBFloat16, op, ": ", state.names[0],
              " have dtype ", sdtype, "; optimizer state is float32 or bfloat16");
  if (addresses != nullptr) {
    // Rows the caller took (StepAddresses::rows_taken) for exactly these lists: params and
    // grads were checked there by check_held_step_index, as the walk below would check them.
    const bool taken = addresses->rows_taken && addresses->state_taken &&
                       addresses->rows.size() == n && addresses->param_dtype == pdtype &&
                       addresses->param_device == device && addresses->rows_grad_dtype == gdtype;
    addresses->rows_taken = false;
    if (taken) {
      return;
    }
  }
  if (addresses != nullptr && addresses->state_taken &&
      check_held_step_lists(op, params, grads, device, pdtype, gdtype, *addresses)) {
    return;
  }
  if (addresses != nullptr) {
    addresses->forget();
    addresses->needs_mutable_access = false;
    addresses->rows.assign(n, StepRow{});
  }
  for (size_t i = 0; i < n; ++i) {
    prefetch_ahead(i, {params, grads, master_params, steps, state.lists[0], state.lists[1],
                       state.lists[2]});  // absent lists are empty: nothing to prefetch
    check_step_index(op, i, params, master_params, grads, steps, state, device, pdtype, gdtype,
                     mdtype, sdtype);
    if (addresses != nullptr) {
      take_addresses(i, params, master_params, grads, steps, state, *addresses);
    }
  }
  if (addresses != nullptr && addresses->kept) {
    record_held_state(params, master_params, steps, state, pdtype, device, *addresses);
  }
}

}  // namespace

bool take_held_row(const char* op, size_t i, const Tensor& param, const Tensor& grad,
                   c10::ScalarType grad_dtype, StepAddresses& held) {
  TORCH_INTERNAL_ASSERT(held.state_taken && i < held.rows.size());
  held.rows_grad_dtype = grad_dtype;
  return check_held_step_index(op, i, param, grad, held.param_device, held.param_dtype,
                               grad_dtype, held);
}

bool take_clean_row(size_t i, const TensorFacts& param, const TensorFacts& grad,
                    StepAddresses& held) {
  TORCH_INTERNAL_ASSERT(held.state_taken && i < held.rows.size());
  if (param.dtype != held.param_dtype ||
      !same_layout_as_recorded(*param.tensor->unsafeGetTensorImpl(), held, i)) {
    return false;
  }
  held.rows_grad_dtype = grad.dtype;
  StepRow& row = held.rows[i];
  row.param = plain_address(*param.tensor);
  row.grad = plain_address(*grad.tensor);
  if ((row.param == nullptr || row.grad == nullptr) && row.numel != 0) {
    held.needs_mutable_access = true;
  }
  return true;
}

namespace {

// A 1-D argument a kernel indexes as plain memory (a flag per grad, a telemetry record, a
// ring of norms): strided and contiguous, of `dtype` (`dtype_name`, as torch names it), on
// `device`, the device of the op's argument `anchor`. Its length is each op's own check.
void check_vector(const char* op, const char* name, const Tensor& t, c10::ScalarType dtype,
                  const char* dtype_name, const c10::Device& device, const char* anchor) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.layout() == at::kStrided && t.dim() == 1 && t.is_contiguous(), op, ": ", name,
              " must be a contiguous 1-D tensor, got shape ", t.sym_sizes());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype_name, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(), " but ", anchor,
              " is on ", device);
}

// grad_stats_'s telemetry output, where either op takes it.
void check_telemetry(const char* op, const OptTensor& telemetry, const c10::Device& device) {
  if (!telemetry.has_value() || !telemetry->defined()) {
    return;
  }
  const Tensor& t = *telemetry;
  check_vector(op, "telemetry", t, at::kDouble, "float64", device, "found_inf");
  TORCH_CHECK(t.sym_numel() == math::kTelemetrySlots, op, ": telemetry must have ",
              math::kTelemetrySlots, " elements (amax, subnormal count, zero count, first "
              "non-finite position), got ", t.sym_numel());
}

}  // namespace

bool unscale_and_check(const char* op, TensorList grads, const Tensor& found_inf,
                       const Tensor& inv_scale, const OptTensor& sum_sq,
                       const OptTensor& telemetry) {
  TORCH_CHECK(found_inf.defined(), op, ": found_inf is undefined");
  const auto device = found_inf.device();
  check_scalar(op, "found_inf", found_inf, at::kFloat, device);
  check_scalar(op, "inv_scale", inv_scale, at::kFloat, device);
  const bool with_sum_sq = sum_sq.has_value() && sum_sq->defined();
  if (with_sum_sq) {
    check_scalar(op, "sum_sq", *sum_sq, at::kFloat, device);
  }
  TORCH_CHECK(with_sum_sq || !telemetry.has_value() || !telemetry->defined(), op,
              ": telemetry needs sum_sq (the statistics pass gives both)");
  check_telemetry(op, telemetry, device);
  return check_grad_list(op, grads, device, /*with_per_tensor=*/true);
}

bool per_tensor_grad(const Tensor& grad) {
  return is_per_tensor(facts_of(grad, grad.device()));
}

bool grad_stats(const char* op, TensorList grads, const Tensor& found_inf, const Tensor& sum_sq,
                const OptTensor& tensor_flags, const OptTensor& telemetry) {
  TORCH_CHECK(found_inf.defined(), op, ": found_inf is undefined");
  const auto device = found_inf.device();
  check_scalar(op, "found_inf", found_inf, at::kFloat, device);
  check_scalar(op, "sum_sq", sum_sq, at::kFloat, device);
  if (tensor_flags.has_value() && tensor_flags->defined()) {
    const Tensor& f = *tensor_flags;
    check_vector(op, "tensor_flags", f, at::kFloat, "float32", device, "found_inf");
    TORCH_CHECK(f.sym_numel() == static_cast<int64_t>(grads.size()), op, ": tensor_flags has ",
                f.sym_numel(), " elements but there are ", grads.size(), " grads");
  }
  check_telemetry(op, telemetry, device);
  return check_grad_list(op, grads, device, /*with_per_tensor=*/true);
}

void update_scale(const char* op, const Tensor& scale, const Tensor& growth_tracker,
                  const Tensor& hysteresis_tracker, const Tensor& found_inf, double growth_factor,
                  double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                  std::optional<double> min_scale, std::optional<double> max_scale,
                  const OptTensor& amax, std::optional<double> amax_target,
                  const OptTensor& scale_history, int64_t scale_history_slot) {
  TORCH_CHECK(scale.defined(), op, ": scale is undefined");
  const auto device = scale.device();
  check_scalar(op, "scale", scale, at::kFloat, device);
  check_scalar(op, "growth_tracker", growth_tracker, at::kInt, device);
  check_scalar(op, "hysteresis_tracker", hysteresis_tracker, at::kInt, device);
  check_scalar(op, "found_inf", found_inf, at::kFloat, device);
  hyper::check_scale_options(op, growth_factor, backoff_factor, growth_interval, hysteresis,
                             min_scale, max_scale);
  const bool have_amax = amax.has_value() && amax->defined();
  if (amax_target.has_value()) {
    TORCH_CHECK(std::isfinite(*amax_target) && *amax_target > 0.0, op,
                ": amax_target must be finite and > 0, got ", *amax_target);
    TORCH_CHECK(have_amax, op, ": amax_target needs amax (this step's largest |gradient|)");
  }
  if (have_amax) {
    TORCH_CHECK(amax_target.has_value(), op,
                ": amax is given without amax_target (the amax policy needs both)");
    check_scalar(op, "amax", *amax, at::kDouble, device);
  }
  if (scale_history.has_value() && scale_history->defined()) {
    const Tensor& history = *scale_history;
    check_vector(op, "scale_history", history, at::kFloat, "float32", device, "scale");
    TORCH_CHECK(scale_history_slot >= 0 && scale_history_slot < history.sym_numel(), op,
                ": scale_history_slot ", scale_history_slot, " is outside scale_history (",
                history.sym_numel(), " elements)");
  }
}

void record_telemetry(const char* op, const Tensor& ring, int64_t slot, const Tensor& scale,
                      const Tensor& found_inf, const Tensor& measured,
                      const OptTensor& pass_sum_sq) {
  TORCH_CHECK(ring.defined(), op, ": ring is undefined");
  const auto device = ring.device();
  TORCH_CHECK(ring.layout() == at::kStrided && ring.dim() == 2 && ring.is_contiguous() &&
                  ring.scalar_type() == at::kDouble && ring.sym_size(1) == math::kTelemetryColumns,
              op, ": ring must be a contiguous float64 tensor of shape [capacity, ",
              int64_t{math::kTelemetryColumns}, "], got ", ring.scalar_type(), " of shape ",
              ring.sym_sizes());
  TORCH_CHECK(slot >= 0 && slot < ring.sym_size(0), op, ": slot ", slot,
              " is outside ring (", ring.sym_size(0), " rows)");
  check_scalar(op, "scale", scale, at::kFloat, device);
  check_scalar(op, "found_inf", found_inf, at::kFloat, device);
  check_vector(op, "measured", measured, at::kDouble, "float64", device, "ring");
  TORCH_CHECK(measured.sym_numel() == math::kTelemetrySlots + 1, op, ": measured must have ",
              int64_t{math::kTelemetrySlots + 1}, " elements (the telemetry slots and a sum of "
              "squares), got ", measured.sym_numel());
  if (pass_sum_sq.has_value() && pass_sum_sq->defined()) {
    check_scalar(op, "pass_sum_sq", *pass_sum_sq, at::kFloat, device);
  }
}

void account_step(const char* op, const Tensor& step_applied, const Tensor& skipped_steps,
                  const OptTensor& found_inf, const OptTensor& found_inf_out,
                  const OptTensor& grad_sum_sq, const OptTensor& inv_scale,
                  const OptTensor& grad_norms, int64_t grad_norm_slot) {
  TORCH_CHECK(step_applied.defined(), op, ": step_applied is undefined");
  const auto device = step_applied.device();
  check_scalar(op, "step_applied", step_applied, at::kFloat, device);
  check_scalar(op, "skipped_steps", skipped_steps, at::kLong, device);
  const auto given = [](const OptTensor& t) { return t.has_value() && t->defined(); };
  if (given(found_inf)) {
    check_scalar(op, "found_inf", *found_inf, at::kFloat, device);
  }
  if (given(found_inf_out)) {
    TORCH_CHECK(given(found_inf), op,
                ": found_inf_out is given without found_inf (an unchecked step has no flag)");
    check_scalar(op, "found_inf_out", *found_inf_out, at::kFloat, device);
  }
  if (!given(grad_norms)) {
    TORCH_CHECK(!given(grad_sum_sq) && !given(inv_scale), op,
                ": grad_sum_sq and inv_scale only make the norm written into grad_norms, which "
                "is not given");
    return;
  }
  TORCH_CHECK(given(grad_sum_sq), op,
              ": grad_norms needs grad_sum_sq (the sum of squares from grad_stats_)");
  check_scalar(op, "grad_sum_sq", *grad_sum_sq, at::kFloat, device);
  if (given(inv_scale)) {
    check_scalar(op, "inv_scale", *inv_scale, at::kFloat, device);
  }
  const Tensor& norms = *grad_norms;
  check_vector(op, "grad_norms", norms, at::kFloat, "float32", device, "step_applied");
  TORCH_CHECK(grad_norm_slot >= 0 && grad_norm_slot < norms.sym_numel(), op,
              ": grad_norm_slot ", grad_norm_slot, " is outside grad_norms (",
              norms.sym_numel(), " elements)");
}

void step_scalars(const char* op, const Tensor& like, const OptTensor& lr_tensor,
                  const OptTensor& inv_scale, const OptTensor& found_inf,
                  const OptTensor& grad_sum_sq, std::optional<double> max_grad_norm) {
  const auto device = like.device();
  if (lr_tensor && lr_tensor->defined()) {
    check_scalar(op, "lr_tensor", *lr_tensor, at::kFloat, device);
  }
  if (inv_scale && inv_scale->defined()) {
    check_scalar(op, "inv_scale", *inv_scale, at::kFloat, device);
  }
  if (found_inf && found_inf->defined()) {
    check_scalar(op, "found_inf", *found_inf, at::kFloat, device);
  }
  if (grad_sum_sq && grad_sum_sq->defined()) {
    check_scalar(op, "grad_sum_sq", *grad_sum_sq, at::kFloat, device);
  }
  if (max_grad_norm) {
    TORCH_CHECK(hyper::valid_max_grad_norm(*max_grad_norm), op,
                ": max_grad_norm must be finite and > 0, got ", *max_grad_norm);
    TORCH_CHECK(grad_sum_sq && grad_sum_sq->defined(), op,
                ": max_grad_norm needs grad_sum_sq (the sum of squares from grad_stats_)");
  }
}

namespace {  // A step's lists, then its device scalars; false when there are no params.
bool check_step(const char* op, TensorList params, TensorList master_params, TensorList grads,
                TensorList steps, const StateLists& state, const OptTensor& lr_tensor,
                const OptTensor& inv_scale, const OptTensor& found_inf,
                const OptTensor& grad_sum_sq, std::optional<double> max_grad_norm,
                c10::OptionalIntArrayRef rounding_seeds, StepAddresses* addresses) {
  check_step_lists(op, params, master_params, grads, steps, state, rounding_seeds, addresses);
  if (params.empty()) {
    return false;
  }
  step_scalars(op, params[0], lr_tensor, inv_scale, found_inf, grad_sum_sq, max_grad_norm);
  return true;
}
}  // namespace

bool adam_step(const char* op, TensorList params, TensorList master_params, TensorList grads,
               TensorList exp_avgs, TensorList exp_avg_sqs, TensorList max_exp_avg_sqs,
               TensorList steps, double lr, double beta1, double beta2, double eps,
               double weight_decay,
               const OptTensor& lr_tensor, const OptTensor& inv_scale,
               const OptTensor& found_inf, const OptTensor& grad_sum_sq,
               std::optional<double> max_grad_norm, c10::OptionalIntArrayRef rounding_seeds,
               StepAddresses* addresses) {
  check_finite_nonneg(op, "lr", lr);
  check_beta(op, "beta1", beta1);
  check_beta(op, "beta2", beta2);
  check_finite_nonneg(op, "eps", eps);
  check_finite_nonneg(op, "weight_decay", weight_decay);
  StateLists state;
  state.add("exp_avgs", exp_avgs).add("exp_avg_sqs", exp_avg_sqs);
  if (!max_exp_avg_sqs.empty()) {  // AMSGrad
    state.add("max_exp_avg_sqs", max_exp_avg_sqs);
  }
  return check_step(op, params, master_params, grads, steps, state, lr_tensor, inv_scale,
                    found_inf, grad_sum_sq, max_grad_norm, rounding_seeds, addresses);
}

bool sgd_step(const char* op, TensorList params, TensorList master_params, TensorList grads,
              TensorList momentum_buffers, TensorList steps, double lr, double momentum,
              double dampening, double weight_decay, bool nesterov, const OptTensor& lr_tensor,
              const OptTensor& inv_scale, const OptTensor& found_inf,
              const OptTensor& grad_sum_sq, std::optional<double> max_grad_norm,
              c10::OptionalIntArrayRef rounding_seeds, StepAddresses* addresses) {
  check_finite_nonneg(op, "lr", lr);
  check_finite_nonneg(op, "momentum", momentum);
  TORCH_CHECK(hyper::valid_dampening(dampening), op, ": invalid dampening ", dampening);
  check_finite_nonneg(op, "weight_decay", weight_decay);
  TORCH_CHECK(hyper::valid_nesterov(nesterov, momentum, dampening), op,
              ": Nesterov momentum requires momentum > 0 and zero dampening");
  StateLists state;
  if (momentum == 0.0) {
    TORCH_CHECK(momentum_buffers.empty(), op,
                ": momentum_buffers must be empty when momentum is 0");
  } else {
    state.add("momentum_buffers", momentum_buffers);
  }
  return check_step(op, params, master_params, grads, steps, state, lr_tensor, inv_scale,
                    found_inf, grad_sum_sq, max_grad_norm, rounding_seeds, addresses);
}

}  // namespace fusedamp::checks
