// The checks of the step operators, adam_step_ and sgd_step_ (checks.h), on the Step their
// arguments make (step_lists.h): every list position's tensors, the weight store, the device
// scalars, and the hyper-parameters of each algorithm.
#include <c10/util/Exception.h>

#include <cstdint>

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

// Index i's row of element addresses (step_lists.h), once its checks have passed: the
// tensors' metadata is still in cache.
C10_ALWAYS_INLINE void take_addresses(size_t i, TensorList params, TensorList master_params,
                                      TensorList grads, TensorList steps, const StateLists& state,
                                      StepRows& out) {
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

// How the weights are kept, from master_params[0]'s dtype (static_switch.h WeightStore): FP32
// masters for any params; int16 remainders for BF16 params; a compensation of the params' own
// 16-bit dtype. Stochastic rounding (rounding_seeds) keeps nothing but BF16 params.
void check_weight_store(const char* op, TensorList params, TensorList master_params,
                        c10::ScalarType pdtype, bool with_rounding_seeds,
                        c10::IntArrayRef rounding_seeds) {
  const size_t n = params.size();
  if (with_rounding_seeds) {
    TORCH_CHECK(rounding_seeds.size() == n, op, ": rounding_seeds has ", rounding_seeds.size(),
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
  TORCH_CHECK(fp32_master || split || kahan, op, ": master_params have dtype ", mdtype, " for ",
              pdtype,
              " params; supported are float32 (FP32 master weights), int16 "
              "(remainders beside bfloat16 params: master_weights=\"split\") and the params' "
              "own float16/bfloat16 (Kahan compensations: master_weights=\"kahan\")");
}
// The common list checks of adam_step_ and sgd_step_; with rows, each position's addresses are
// taken as soon as its checks have passed.
template <typename Hyper>
void check_step_lists(const Step<Hyper>& s) {
  const char* op = s.op;
  const TensorList params = s.params;
  const TensorList master_params = s.master_params;
  const TensorList grads = s.grads;
  const TensorList steps = s.steps;
  const StateLists& state = s.state;
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
              " but params have dtype ", pdtype, "; grads must have the params' dtype or float32");
  check_weight_store(op, params, master_params, pdtype, s.with_rounding_seeds, s.rounding_seeds);
  const auto mdtype = master_params.empty() || !master_params[0].defined()
                          ? at::kFloat
                          : master_params[0].scalar_type();
  // The optimizer state (moments, momentum buffers): FP32 or BF16 (state_dtype), one dtype.
  const auto sdtype = state.count == 0 || !state.lists[0][0].defined()
                          ? at::kFloat
                          : state.lists[0][0].scalar_type();
  TORCH_CHECK(sdtype == at::kFloat || sdtype == at::kBFloat16, op, ": ", state.names[0],
              " have dtype ", sdtype, "; optimizer state is float32 or bfloat16");
  StepRows* rows = s.rows;
  if (rows != nullptr) {
    rows->needs_mutable_access = false;
    (*rows->rows).assign(n, StepRow{});
  }
  for (size_t i = 0; i < n; ++i) {
    prefetch_ahead(i, {params, grads, master_params, steps, state.lists[0], state.lists[1],
                       state.lists[2]});  // absent lists are empty: nothing to prefetch
    check_step_index(op, i, params, master_params, grads, steps, state, device, pdtype, gdtype,
                     mdtype, sdtype);
    if (rows != nullptr) {
      take_addresses(i, params, master_params, grads, steps, state, *rows);
    }
  }
}

// The optional device scalars of a fused step, on the params' device.
template <typename Args>
void check_step_scalars(const Args& a, const c10::Device& device) {
  const char* op = a.kName;
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
bool check_step(const Args& a, const Step<Hyper>& s) {
  check_step_lists(s);
  if (s.params.empty()) {
    return false;
  }
  check_step_scalars(a, s.params[0].device());
  return true;
}

}  // namespace

bool adam_step(const ops::AdamStep& a, Step<math::AdamHyper>& step) {
  const char* op = a.kName;
  check_finite_nonneg(op, "lr", a.lr);
  check_beta(op, "beta1", a.beta1);
  check_beta(op, "beta2", a.beta2);
  check_finite_nonneg(op, "eps", a.eps);
  check_finite_nonneg(op, "weight_decay", a.weight_decay);
  return check_step(a, step);
}

bool sgd_step(const ops::SgdStep& a, Step<math::SgdHyper>& step) {
  const char* op = a.kName;
  check_finite_nonneg(op, "lr", a.lr);
  check_finite_nonneg(op, "momentum", a.momentum);
  TORCH_CHECK(hyper::valid_dampening(a.dampening), op, ": invalid dampening ", a.dampening);
  check_finite_nonneg(op, "weight_decay", a.weight_decay);
  TORCH_CHECK(hyper::valid_nesterov(a.nesterov, a.momentum, a.dampening), op,
              ": Nesterov momentum requires momentum > 0 and zero dampening");
  if (a.momentum == 0.0) {
    TORCH_CHECK(a.momentum_buffers.empty(), op,
                ": momentum_buffers must be empty when momentum is 0");
  }
  return check_step(a, step);
}

}  // namespace fusedamp::checks
