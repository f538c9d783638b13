// The checks of the step operators (checks.h), on the Step their arguments make
// (step_lists.h): every list position's tensors, the weight store, the device scalars, and the
// hyper-parameters of each algorithm (its descriptor's check()).
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <vector>

#include "check_rules.h"
#include "checks.h"
#include "hyper_params.h"
#include "step_lists.h"
#include "tensor_facts.h"
#include "tensor_prefetch.h"

namespace fusedamp::checks {
namespace {

using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;
using namespace rules;

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
// grad is grads[i] (a caller walking the rows itself passes it before its grads list exists).
C10_ALWAYS_INLINE void check_step_index(const StepLists& lists, size_t i, const Tensor& grad,
                                        const StepFacts& f) {
  const char* op = lists.op;
  const TensorList master_params = lists.master_params;
  const StateLists& state = lists.state;
  const c10::Device& device = f.device;
  const bool has_master = !master_params.empty();
  const size_t n = state.count;
  TensorFacts p, g, mp{}, s[StateLists::kMax];
  read_facts(lists.params[i], device, /*with_span=*/true, p);
  read_facts(grad, device, /*with_span=*/true, g);
  if (has_master) {
    read_facts(master_params[i], device, /*with_span=*/true, mp);
  }
  for (size_t k = 0; k < n; ++k) {
    read_facts(state.lists[k][i], device, /*with_span=*/true, s[k]);
  }
  const char* const* names = state.names;

  check_param_and_grad(op, i, p, g, device, f.param_dtype, f.grad_dtype);
  if (has_master) {
    check_dense(op, "master_params", i, mp, device);
    check_dtype(op, "master_params", i, mp, f.master_dtype, DtypeRule::kLikeList0);
    check_same_layout(op, "master_params", i, mp, p);
    check_no_overlap(op, i, mp, "master_params", p, "params");
    check_no_overlap(op, i, mp, "master_params", g, "grads");
  }
  for (size_t k = 0; k < n; ++k) {
    check_dense(op, names[k], i, s[k], device);
    check_dtype(op, names[k], i, s[k], f.state_list_dtype(k),
                f.quantized ? DtypeRule::kQuantizedCodes : DtypeRule::kLikeList0);
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
  if (f.quantized) {
    const char* scales = lists.block_scales_name;
    TensorFacts q;
    read_facts(lists.block_scales[i], device, /*with_span=*/true, q);
    check_dense(op, scales, i, q, device);
    check_block_scales(op, scales, i, static_cast<int64_t>(n), q, p);
    check_no_overlap(op, i, q, scales, p, "params");
    check_no_overlap(op, i, q, scales, g, "grads");
    for (size_t k = 0; k < n; ++k) {
      check_no_overlap(op, i, q, scales, s[k], names[k]);
    }
    if (has_master) {
      check_no_overlap(op, i, q, scales, mp, "master_params");
    }
  }
  check_scalar(op, "steps[i]", lists.steps[i], at::kFloat, device);
}

// Index i's row of element addresses (step_lists.h), once its checks have passed: the
// tensors' metadata is still in cache.
C10_ALWAYS_INLINE void take_addresses(const StepLists& lists, size_t i, const Tensor& grad,
                                      StepRows& out) {
  const TensorList master_params = lists.master_params;
  const StateLists& state = lists.state;
  StepRow& row = out.rows[i];  // zeroed in one block before the walk (per row: a rep stos)
  const c10::TensorImpl& param = *lists.params[i].unsafeGetTensorImpl();
  const bool concrete = has_concrete_sizes(param);
  row.numel = concrete ? param.numel() : 0;
  row.param = plain_address(lists.params[i]);
  row.grad = plain_address(grad);
  bool plain = row.param != nullptr && row.grad != nullptr;
  if (!master_params.empty()) {
    row.master = plain_address(master_params[i]);
    plain = plain && row.master != nullptr;
  }
  for (size_t k = 0; k < state.count; ++k) {
    row.state[k] = plain_address(state.lists[k][i]);
    plain = plain && row.state[k] != nullptr;
  }
  if (!lists.block_scales.empty()) {  // quantized state: the scales after the state lists
    row.state[state.count] = plain_address(lists.block_scales[i]);
    plain = plain && row.state[state.count] != nullptr;
  }
  row.step = static_cast<float*>(plain_address(lists.steps[i]));
  // An empty tensor's address is never used.
  if (!concrete || row.step == nullptr || (!plain && row.numel != 0)) {
    out.needs_mutable_access = true;
  }
}

// The master_params each mode keeps, for messages: "float32 beside float32, float16 or
// bfloat16 params (master_weights=True: an FP32 master copy), ...".
std::string kept_master_params() {
  std::vector<std::string> kept;
  for (const auto& info : kMasterModes) {
    if (info.spelling != nullptr && info.kept != MasterKept::kNothing) {
      kept.push_back((info.kept == MasterKept::kCompensation
                          ? std::string("the params' own dtype")
                          : c10::getDtypeNames(info.kept_dtype).first) +
                     " beside " + master_mode_dtypes(info) + " params (master_weights=" +
                     info.spelling + ": " + info.about + ")");
    }
  }
  return one_of(kept);
}

// How the weights are kept (fusedamp/master_modes.h), from master_params[0]'s dtype beside the
// params' (a mode keeping such tensors must serve that param dtype), or from rounding_seeds
// (the seeded mode keeps no master_params).
void check_weight_store(const char* op, TensorList params, TensorList master_params,
                        c10::ScalarType pdtype, bool with_rounding_seeds,
                        c10::IntArrayRef rounding_seeds) {
  const size_t n = params.size();
  if (with_rounding_seeds) {
    const auto& seeded = master_mode_info(master_mode_of_step(false, c10::ScalarType::Undefined,
                                                              pdtype, true, false));
    TORCH_CHECK(rounding_seeds.size() == n, op, ": rounding_seeds has ", rounding_seeds.size(),
                " seeds but params has ", n, " tensors; one seed per tensor");
    TORCH_CHECK(master_params.empty(), op, ": ", seeded.about,
                " (rounding_seeds) keeps no master_params; got ", master_params.size());
    TORCH_CHECK(master_mode_fits(seeded, pdtype), op, ": ", seeded.about,
                " (rounding_seeds) is for ", master_mode_dtypes(seeded), " params, got ", pdtype);
  }
  if (master_params.empty()) {
    return;
  }
  const auto mdtype = master_params[0].defined() ? master_params[0].scalar_type() : pdtype;
  const MasterModeInfo* mode = master_mode_keeping(mdtype, pdtype);
  TORCH_CHECK(mode != nullptr && master_mode_fits(*mode, pdtype), op,
              ": master_params have dtype ", mdtype, " for ", pdtype, " params; supported are ",
              kept_master_params());
}
// The lists' lengths (without the grads' for a caller checking rows itself: it has none yet).
void check_lengths(const StepLists& s, bool with_grads) {
  const size_t n = s.params.size();
  TORCH_CHECK(s.master_params.empty() || s.master_params.size() == n, s.op,
              ": master_params has ", s.master_params.size(),
              " tensors; expected 0 (no master weights) or ", n);
  if (with_grads) {
    check_list_length(s.op, "grads", s.grads, n);
  }
  check_list_length(s.op, "steps", s.steps, n);
  for (size_t k = 0; k < s.state.count; ++k) {
    check_list_length(s.op, s.state.names[k], s.state.lists[k], n);
  }
  if (!s.block_scales.empty()) {
    check_list_length(s.op, s.block_scales_name, s.block_scales, n);
  }
}

// The walk of a step's rows: each position's tensors checked, then, with rows, its addresses
// taken while their metadata is in cache.
void check_rows(const StepLists& s, const StepFacts& f, StepRows* rows) {
  const TensorList grads = s.grads;
  const StateLists& state = s.state;
  for (size_t i = 0; i < s.params.size(); ++i) {
    prefetch_ahead(i, {s.params, grads, s.master_params, s.steps, state.lists[0],
                       state.lists[1], state.lists[2],
                       s.block_scales});  // absent lists: nothing to prefetch
    check_step_index(s, i, grads[i], f);
    if (rows != nullptr) {
      take_addresses(s, i, grads[i], *rows);
    }
  }
}

// The list checks of a step operator, then (unless the caller checked them) the rows.
template <typename Hyper>
void check_step_lists(const Step<Hyper>& s, RowsChecked rows) {
  check_lengths(s, /*with_grads=*/true);
  const size_t n = s.params.size();
  if (n == 0) {
    return;
  }
  const StepFacts f = step_facts(s, s.grads[0].defined() ? s.grads[0].scalar_type()
                                                         : s.params[0].scalar_type());
  if (rows == RowsChecked::kByTheCaller) {
    const StepRows& kept = *s.rows;
    TORCH_INTERNAL_ASSERT(kept.rows.size() == n && kept.facts == f, s.op,
                          ": the caller's rows are not this call's");
    return;
  }
  if (s.rows != nullptr) {
    begin_rows(s, f, *s.rows);
  }
  check_rows(s, f, s.rows);
}

// The optional device scalars of a fused step, on the params' device.
void check_step_scalars(const char* op, const ops::StepShared& a, const c10::Device& device) {
  using Named = std::pair<const char*, const OptTensor*>;
  for (const auto& [name, t] :
       {Named{"lr_tensor", &a.lr_tensor}, Named{"inv_scale", &a.inv_scale},
        Named{"found_inf", &a.found_inf}, Named{"grad_sum_sq", &a.grad_sum_sq}}) {
    if (t->has_value() && (*t)->defined()) {
      check_scalar(op, name, **t, at::kFloat, device);
    }
  }
  if (a.max_grad_norm) {
    TORCH_CHECK(hyper::valid_max_grad_norm(*a.max_grad_norm), op,
                ": max_grad_norm must be finite and > 0, got ", *a.max_grad_norm);
    TORCH_CHECK(a.grad_sum_sq && a.grad_sum_sq->defined(), op,
                ": max_grad_norm needs grad_sum_sq (the sum of squares from grad_stats_)");
  }
}

// A step's lists, then its device scalars; false when there are no params.
template <typename Args, typename Hyper>
bool check_step(const Args& a, const Step<Hyper>& s, RowsChecked rows) {
  check_step_lists(s, rows);
  if (s.params.empty()) {
    return false;
  }
  check_step_scalars(a.kName, a.shared, s.params[0].device());
  return true;
}

// The words of an algorithm's hyper-parameter checks (math/<algorithm>_math.h check()), in
// the operator's messages; the ranges are hyper_params.h's.
struct HyperCheck {
  const char* op;
  void finite_nonneg(const char* name, double v) const { check_finite_nonneg(op, name, v); }
  void betas(double beta1, double beta2) const {
    check_beta(op, "beta1", beta1);
    check_beta(op, "beta2", beta2);
  }
  void dampening(double v) const {
    TORCH_CHECK(hyper::valid_dampening(v), op, ": invalid dampening ", v);
  }
  void nesterov(bool nesterov, double momentum, double dampening) const {
    TORCH_CHECK(hyper::valid_nesterov(nesterov, momentum, dampening), op,
                ": Nesterov momentum requires momentum > 0 and zero dampening");
  }
  void that(bool ok, const char* message) const { TORCH_CHECK(ok, op, ": ", message); }
};

}  // namespace

StepFacts step_facts(const StepLists& s, c10::ScalarType grad_dtype) {
  check_lengths(s, /*with_grads=*/false);
  const char* op = s.op;
  const TensorList params = s.params;
  const TensorList master_params = s.master_params;
  const StateLists& state = s.state;
  StepFacts f;
  f.device = params[0].device();
  f.param_dtype = params[0].scalar_type();
  TORCH_CHECK(is_float_kind(f.param_dtype), op, ": params have dtype ", f.param_dtype,
              "; supported are float32, float16 and bfloat16");
  f.grad_dtype = grad_dtype;
  TORCH_CHECK(grad_dtype == f.param_dtype || grad_dtype == at::kFloat, op,
              ": grads have dtype ", grad_dtype, " but params have dtype ", f.param_dtype,
              "; grads must have the params' dtype or float32");
  check_weight_store(op, params, master_params, f.param_dtype, s.with_rounding_seeds,
                     s.rounding_seeds);
  f.master_dtype = master_params.empty() || !master_params[0].defined()
                       ? at::kFloat
                       : master_params[0].scalar_type();
  // The optimizer state (moments, momentum buffers): FP32 or BF16 (state_dtype), one dtype;
  // or quantized: 8-bit codes (Adam: int8 exp_avgs, uint8 exp_avg_sqs; SGD: int8
  // momentum_buffers) and their block scales.
  f.state_dtype = state.count == 0 || !state.lists[0][0].defined()
                      ? at::kFloat
                      : state.lists[0][0].scalar_type();
  f.quantized = !s.block_scales.empty();
  const char* scales = s.block_scales_name;
  if (f.quantized) {
    TORCH_CHECK(state.count > 0, op, ": ", scales,
                " given without a state to quantize (momentum is 0: no momentum_buffers)");
    TORCH_CHECK(state.count <= 2, op, ": quantized moments (", scales,
                ") are for Adam without AMSGrad; max_exp_avg_sqs cannot be kept with them");
    TORCH_CHECK(f.state_dtype == at::kChar, op, ": with ", scales, ", ", state.names[0],
                " must be int8 codes", state.count == 2 ? " (and exp_avg_sqs uint8)" : "",
                ", got ", f.state_dtype);
  } else if (*scales == '\0') {  // an algorithm without a quantized state format
    TORCH_CHECK(f.state_dtype == at::kFloat || f.state_dtype == at::kBFloat16, op, ": ",
                state.names[0], " have dtype ", f.state_dtype,
                "; its optimizer state is float32 or bfloat16 (no 8-bit format)");
  } else {
    TORCH_CHECK(f.state_dtype != at::kChar || state.count > 2, op, ": int8 ", state.names[0],
                " are quantized state; they need their ", scales);
    TORCH_CHECK(f.state_dtype == at::kFloat || f.state_dtype == at::kBFloat16, op, ": ",
                state.names[0], " have dtype ", f.state_dtype,
                "; optimizer state is float32 or bfloat16, or int8 codes with their block "
                "scales");
  }
  return f;
}

void begin_rows(const StepLists& s, const StepFacts& f, StepRows& rows) {
  rows.facts = f;
  rows.needs_mutable_access = false;
  rows.keys = c10::DispatchKeySet();
  rows.rows.assign(s.params.size(), StepRow{});
}

void step_row(const StepLists& s, size_t i, const Tensor& grad, StepRows& rows) {
  check_step_index(s, i, grad, rows.facts);
  take_addresses(s, i, grad, rows);
  rows.keys = rows.keys | s.params[i].key_set() | grad.key_set() | s.steps[i].key_set();
  if (!s.master_params.empty()) {
    rows.keys = rows.keys | s.master_params[i].key_set();
  }
  for (size_t k = 0; k < s.state.count; ++k) {
    rows.keys = rows.keys | s.state.lists[k][i].key_set();
  }
  if (!s.block_scales.empty()) {
    rows.keys = rows.keys | s.block_scales[i].key_set();
  }
}

void prefetch_row(const StepLists& s, size_t i, bool storages) {
  for (const TensorList list : {s.master_params, s.steps, s.state.lists[0], s.state.lists[1],
                                s.state.lists[2], s.block_scales}) {
    if (i < list.size()) {
      prefetch_tensor_metadata(list[i], storages);
    }
  }
}

template <typename Op>
bool step(const Op& a, StepOf<Op>& step, RowsChecked rows) {
  const HyperCheck check{Op::kName};
  check.finite_nonneg("lr", a.lr);
  AlgorithmOf<Op>::check(a, check);
  return check_step(a, step, rows);
}

#define FUSEDAMP_STEP_CHECKS(Algorithm, Op, op, kernels) \
  template bool step(const ops::Op& a, StepOf<ops::Op>& step, RowsChecked rows);
FUSEDAMP_STEP_ALGORITHMS(FUSEDAMP_STEP_CHECKS)
#undef FUSEDAMP_STEP_CHECKS

}  // namespace fusedamp::checks
