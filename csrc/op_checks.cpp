#include "op_checks.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>

namespace fusedamp::checks {
namespace {

bool is_float_kind(c10::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// A 1-element FP32 (or int32) state tensor on `device`.
void check_scalar(const char* op, const char* name, const Tensor& t, c10::ScalarType dtype,
                  const c10::Device& device) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", name, " must be a dense tensor");
  TORCH_CHECK(t.sym_numel() == 1, op, ": ", name, " must have exactly one element, got ",
              t.sym_numel());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(),
              " but the other tensors are on ", device);
}

// Kernels walk each tensor as one flat block of memory.
void check_dense(const char* op, const char* list, size_t i, const Tensor& t,
                 const c10::Device& device) {
  TORCH_CHECK(t.defined(), op, ": ", list, "[", i, "] is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", list, "[", i,
              "] is sparse (or not strided); only dense tensors are supported");
  TORCH_CHECK(t.device() == device, op, ": ", list, "[", i, "] is on ", t.device(),
              " but ", "the first tensor is on ", device, "; all tensors must share one device");
  TORCH_CHECK(t.is_non_overlapping_and_dense(), op, ": ", list, "[", i,
              "] must be non-overlapping and dense (e.g. contiguous); got sizes ", t.sym_sizes(),
              " strides ", t.sym_strides());
}

void check_same_layout(const char* op, const char* list, size_t i, const Tensor& t,
                       const Tensor& ref) {
  TORCH_CHECK(t.sym_sizes() == ref.sym_sizes(), op, ": ", list, "[", i, "] has shape ",
              t.sym_sizes(), " but params[", i, "] has shape ", ref.sym_sizes());
  TORCH_CHECK(t.sym_numel() <= 1 || t.sym_strides() == ref.sym_strides(), op, ": ", list, "[", i,
              "] has strides ", t.sym_strides(), " but params[", i, "] has strides ",
              ref.sym_strides());
}

// Tensors without real memory (meta, FakeTensor under torch.compile) cannot overlap.
bool has_memory(const Tensor& t) {
  return t.has_storage() && t.storage().data() != nullptr;
}

bool overlaps(const Tensor& a, const Tensor& b) {
  if (!has_memory(a) || !has_memory(b) || a.numel() == 0 || b.numel() == 0) {
    return false;
  }
  const auto* a0 = static_cast<const char*>(a.const_data_ptr());
  const auto* b0 = static_cast<const char*>(b.const_data_ptr());
  const auto* a1 = a0 + a.numel() * a.element_size();
  const auto* b1 = b0 + b.numel() * b.element_size();
  return a0 < b1 && b0 < a1;
}

void check_no_overlap(const char* op, size_t i, const Tensor& a, const char* an, const Tensor& b,
                      const char* bn) {
  TORCH_CHECK(!overlaps(a, b), op, ": ", an, "[", i, "] and ", bn, "[", i,
              "] share memory; each must be its own tensor");
}

// ---- fast path ------------------------------------------------------------------------
// The checks above build nothing until they fail, but each of them still walks torch's
// generic (symbolic-aware) accessors, and the overlap test re-derives both byte ranges for
// every pair; with many small tensors that is most of an op's host time. The fast path below
// reads each tensor once with the plain accessors and accepts it only when it is *obviously*
// valid (a conservative test: whatever it accepts the full checks accept too). Anything else,
// e.g. a non-contiguous but dense tensor, symbolic sizes (torch.compile), or a real mistake,
// goes through the full checks for that index, which raise exactly the message they always
// have. Earlier indices passed the fast test, so the first error reported is unchanged.

// Defined, strided, on `device`, of `dtype`, contiguous (hence non-overlapping and dense),
// with concrete sizes and strides that sizes()/strides() may read.
inline bool plain_dense(const Tensor& t, const c10::Device& device, c10::ScalarType dtype) {
  if (!t.defined()) {
    return false;
  }
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return !impl->has_symbolic_sizes_strides() && !impl->is_nested() &&
         !impl->is_python_dispatch() && impl->layout() == at::kStrided &&
         impl->dtype() == dtype && impl->device() == device && impl->is_contiguous();
}

// check_same_layout(t, ref) for two tensors that passed plain_dense.
inline bool same_layout_plain(const Tensor& t, const Tensor& ref) {
  const c10::TensorImpl* a = t.unsafeGetTensorImpl();
  const c10::TensorImpl* b = ref.unsafeGetTensorImpl();
  return a->sizes().equals(b->sizes()) && (a->numel() <= 1 || a->strides().equals(b->strides()));
}

// The bytes a tensor covers, as overlaps() sees them: empty when it has no memory or no
// elements (such a range overlaps nothing).
struct Span {
  const char* lo = nullptr;
  const char* hi = nullptr;
};

// The span of a tensor that passed plain_dense: overlaps()'s bytes, from the TensorImpl
// fields that const_data_ptr() itself combines (storage data + storage offset * item size).
inline Span span_of_plain(const Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  Span s;
  const int64_t n = impl->numel();
  if (n != 0 && impl->has_storage()) {
    const auto* base = static_cast<const char*>(impl->storage().data());
    if (base != nullptr) {
      const auto item = static_cast<int64_t>(impl->dtype().itemsize());
      s.lo = base + impl->storage_offset() * item;
      s.hi = s.lo + n * item;
    }
  }
  return s;
}

// !overlaps(a, b) from precomputed spans.
inline bool disjoint(const Span& a, const Span& b) {
  return a.lo == nullptr || b.lo == nullptr || !(a.lo < b.hi && b.lo < a.hi);
}

// check_scalar(t, kFloat, device) for a tensor with concrete sizes.
inline bool plain_float_scalar(const Tensor& t, const c10::Device& device) {
  if (!t.defined()) {
    return false;
  }
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return !impl->has_symbolic_sizes_strides() && !impl->is_python_dispatch() &&
         impl->layout() == at::kStrided && impl->numel() == 1 &&
         impl->dtype() == at::kFloat && impl->device() == device;
}

void check_list_length(const char* op, const char* name, TensorList l, size_t n) {
  TORCH_CHECK(l.size() == n, op, ": ", name, " has ", l.size(), " tensors but params has ", n);
}

void check_finite_nonneg(const char* op, const char* name, double v) {
  TORCH_CHECK(std::isfinite(v) && v >= 0.0, op, ": invalid ", name, " ", v,
              " (must be finite and >= 0)");
}

void check_beta(const char* op, const char* name, double v) {
  TORCH_CHECK(v >= 0.0 && v < 1.0, op, ": invalid ", name, " ", v, " (must be in [0, 1))");
}

void check_grad_list(const char* op, TensorList grads, const c10::Device& device) {
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].defined() && is_float_kind(grads[i].scalar_type()) &&
        plain_dense(grads[i], device, grads[i].scalar_type())) {
      continue;  // certainly passes the checks below
    }
    check_dense(op, "grads", i, grads[i], device);
    TORCH_CHECK(is_float_kind(grads[i].scalar_type()), op, ": grads[", i,
                "] has dtype ", grads[i].scalar_type(),
                "; supported are float32, float16 and bfloat16");
  }
}

using StateLists = std::initializer_list<std::pair<const char*, TensorList>>;

// The full checks of index i of a step's lists (the reference; raises the precise message).
void check_step_index(const char* op, size_t i, TensorList params, TensorList master_params,
                      TensorList grads, TensorList steps, StateLists state,
                      const c10::Device& device, c10::ScalarType pdtype,
                      c10::ScalarType gdtype) {
  const Tensor& p = params[i];
  check_dense(op, "params", i, p, device);
  TORCH_CHECK(p.scalar_type() == pdtype, op, ": params[", i, "] has dtype ", p.scalar_type(),
              " but params[0] has ", pdtype, "; one call takes one params dtype");
  check_dense(op, "grads", i, grads[i], device);
  TORCH_CHECK(grads[i].scalar_type() == gdtype, op, ": grads[", i, "] has dtype ",
              grads[i].scalar_type(), " but grads[0] has ", gdtype);
  check_same_layout(op, "grads", i, grads[i], p);
  check_no_overlap(op, i, grads[i], "grads", p, "params");
  if (!master_params.empty()) {
    const Tensor& mp = master_params[i];
    check_dense(op, "master_params", i, mp, device);
    TORCH_CHECK(mp.scalar_type() == at::kFloat, op, ": master_params[", i,
                "] must be float32, got ", mp.scalar_type());
    check_same_layout(op, "master_params", i, mp, p);
    check_no_overlap(op, i, mp, "master_params", p, "params");
    check_no_overlap(op, i, mp, "master_params", grads[i], "grads");
  }
  for (const auto& s : state) {
    const Tensor& t = s.second[i];
    check_dense(op, s.first, i, t, device);
    TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", s.first, "[", i,
                "] must be float32, got ", t.scalar_type());
    check_same_layout(op, s.first, i, t, p);
    check_no_overlap(op, i, t, s.first, p, "params");
    check_no_overlap(op, i, t, s.first, grads[i], "grads");
    if (!master_params.empty()) {
      check_no_overlap(op, i, t, s.first, master_params[i], "master_params");
    }
    for (const auto& o : state) {
      if (o.first != s.first) {
        check_no_overlap(op, i, t, s.first, o.second[i], o.first);
      }
    }
  }
  check_scalar(op, "steps[i]", steps[i], at::kFloat, device);
}

// Whether index i certainly passes check_step_index (see "fast path" above).
bool step_index_ok(size_t i, TensorList params, TensorList master_params, TensorList grads,
                   TensorList steps, StateLists state, const c10::Device& device,
                   c10::ScalarType pdtype, c10::ScalarType gdtype) {
  constexpr size_t kMaxState = 2;  // adam: exp_avgs, exp_avg_sqs; sgd: momentum_buffers
  if (state.size() > kMaxState) {
    return false;
  }
  const Tensor& p = params[i];
  const Tensor& g = grads[i];
  if (!plain_dense(p, device, pdtype) || !plain_dense(g, device, gdtype) ||
      !same_layout_plain(g, p) || !plain_float_scalar(steps[i], device)) {
    return false;
  }
  Span spans[3 + kMaxState];  // params, grads, master_params (maybe empty), state...
  size_t n = 0;
  spans[n++] = span_of_plain(p);
  spans[n++] = span_of_plain(g);
  if (!master_params.empty()) {
    const Tensor& mp = master_params[i];
    if (!plain_dense(mp, device, at::kFloat) || !same_layout_plain(mp, p)) {
      return false;
    }
    spans[n++] = span_of_plain(mp);
  }
  for (const auto& s : state) {
    const Tensor& t = s.second[i];
    if (!plain_dense(t, device, at::kFloat) || !same_layout_plain(t, p)) {
      return false;
    }
    spans[n++] = span_of_plain(t);
  }
  // Every pair: the full checks test params/grads, master vs both, each state vs all others.
  for (size_t a = 0; a < n; ++a) {
    for (size_t b = a + 1; b < n; ++b) {
      if (!disjoint(spans[a], spans[b])) {
        return false;
      }
    }
  }
  return true;
}

// The common list checks of adam_step_ and sgd_step_; `state` names the per-parameter FP32
// state lists (moments or momentum buffers) that must mirror params.
void check_step_lists(const char* op, TensorList params, TensorList master_params,
                      TensorList grads, TensorList steps, StateLists state) {
  const size_t n = params.size();
  TORCH_CHECK(master_params.empty() || master_params.size() == n, op, ": master_params has ",
              master_params.size(), " tensors; expected 0 (no master weights) or ", n);
  check_list_length(op, "grads", grads, n);
  check_list_length(op, "steps", steps, n);
  for (const auto& s : state) {
    check_list_length(op, s.first, s.second, n);
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
  for (size_t i = 0; i < n; ++i) {
    if (!step_index_ok(i, params, master_params, grads, steps, state, device, pdtype, gdtype)) {
      check_step_index(op, i, params, master_params, grads, steps, state, device, pdtype,
                       gdtype);
    }
  }
}

}  // namespace

void unscale_and_check(const char* op, TensorList grads, const Tensor& found_inf,
                       const Tensor& inv_scale) {
  TORCH_CHECK(found_inf.defined(), op, ": found_inf is undefined");
  const auto device = found_inf.device();
  check_scalar(op, "found_inf", found_inf, at::kFloat, device);
  check_scalar(op, "inv_scale", inv_scale, at::kFloat, device);
  check_grad_list(op, grads, device);
}

void grad_stats(const char* op, TensorList grads, const Tensor& found_inf, const Tensor& sum_sq,
                const OptTensor& tensor_flags) {
  TORCH_CHECK(found_inf.defined(), op, ": found_inf is undefined");
  const auto device = found_inf.device();
  check_scalar(op, "found_inf", found_inf, at::kFloat, device);
  check_scalar(op, "sum_sq", sum_sq, at::kFloat, device);
  if (tensor_flags.has_value() && tensor_flags->defined()) {
    const Tensor& f = *tensor_flags;
    TORCH_CHECK(f.layout() == at::kStrided && f.dim() == 1 && f.is_contiguous(), op,
                ": tensor_flags must be a contiguous 1-D tensor");
    TORCH_CHECK(f.sym_numel() == static_cast<int64_t>(grads.size()), op, ": tensor_flags has ",
                f.sym_numel(), " elements but there are ", grads.size(), " grads");
    TORCH_CHECK(f.scalar_type() == at::kFloat, op, ": tensor_flags must be float32, got ",
                f.scalar_type());
    TORCH_CHECK(f.device() == device, op, ": tensor_flags is on ", f.device(),
                " but found_inf is on ", device);
  }
  check_grad_list(op, grads, device);
}

void update_scale(const char* op, const Tensor& scale, const Tensor& growth_tracker,
                  const Tensor& hysteresis_tracker, const Tensor& found_inf, double growth_factor,
                  double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                  std::optional<double> min_scale, std::optional<double> max_scale) {
  TORCH_CHECK(scale.defined(), op, ": scale is undefined");
  const auto device = scale.device();
  check_scalar(op, "scale", scale, at::kFloat, device);
  check_scalar(op, "growth_tracker", growth_tracker, at::kInt, device);
  check_scalar(op, "hysteresis_tracker", hysteresis_tracker, at::kInt, device);
  check_scalar(op, "found_inf", found_inf, at::kFloat, device);
  TORCH_CHECK(std::isfinite(growth_factor) && growth_factor > 1.0, op,
              ": growth_factor must be > 1, got ", growth_factor);
  TORCH_CHECK(backoff_factor > 0.0 && backoff_factor < 1.0, op,
              ": backoff_factor must be in (0, 1), got ", backoff_factor);
  TORCH_CHECK(growth_interval >= 1 && growth_interval <= INT32_MAX, op,
              ": growth_interval must be a positive int32, got ", growth_interval);
  TORCH_CHECK(hysteresis >= 1 && hysteresis <= INT32_MAX, op,
              ": hysteresis must be a positive int32, got ", hysteresis);
  if (min_scale) {
    TORCH_CHECK(std::isfinite(*min_scale) && *min_scale > 0.0, op,
                ": min_scale must be finite and > 0, got ", *min_scale);
  }
  if (max_scale) {
    TORCH_CHECK(std::isfinite(*max_scale) && *max_scale > 0.0, op,
                ": max_scale must be finite and > 0, got ", *max_scale);
  }
  if (min_scale && max_scale) {
    TORCH_CHECK(*min_scale <= *max_scale, op, ": min_scale (", *min_scale,
                ") must not exceed max_scale (", *max_scale, ")");
  }
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
    TORCH_CHECK(std::isfinite(*max_grad_norm) && *max_grad_norm > 0.0, op,
                ": max_grad_norm must be finite and > 0, got ", *max_grad_norm);
    TORCH_CHECK(grad_sum_sq && grad_sum_sq->defined(), op,
                ": max_grad_norm needs grad_sum_sq (the sum of squares from grad_stats_)");
  }
}

bool adam_step(const char* op, TensorList params, TensorList master_params, TensorList grads,
               TensorList exp_avgs, TensorList exp_avg_sqs, TensorList steps, double lr,
               double beta1, double beta2, double eps, double weight_decay,
               const OptTensor& lr_tensor, const OptTensor& inv_scale,
               const OptTensor& found_inf, const OptTensor& grad_sum_sq,
               std::optional<double> max_grad_norm) {
  check_finite_nonneg(op, "lr", lr);
  check_beta(op, "beta1", beta1);
  check_beta(op, "beta2", beta2);
  check_finite_nonneg(op, "eps", eps);
  check_finite_nonneg(op, "weight_decay", weight_decay);
  check_step_lists(op, params, master_params, grads, steps,
                   {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}});
  if (params.empty()) {
    return false;
  }
  step_scalars(op, params[0], lr_tensor, inv_scale, found_inf, grad_sum_sq, max_grad_norm);
  return true;
}

bool sgd_step(const char* op, TensorList params, TensorList master_params, TensorList grads,
              TensorList momentum_buffers, TensorList steps, double lr, double momentum,
              double dampening, double weight_decay, bool nesterov, const OptTensor& lr_tensor,
              const OptTensor& inv_scale, const OptTensor& found_inf,
              const OptTensor& grad_sum_sq, std::optional<double> max_grad_norm) {
  check_finite_nonneg(op, "lr", lr);
  check_finite_nonneg(op, "momentum", momentum);
  TORCH_CHECK(std::isfinite(dampening), op, ": invalid dampening ", dampening);
  check_finite_nonneg(op, "weight_decay", weight_decay);
  TORCH_CHECK(!nesterov || (momentum > 0.0 && dampening == 0.0), op,
              ": Nesterov momentum requires momentum > 0 and zero dampening");
  if (momentum == 0.0) {
    TORCH_CHECK(momentum_buffers.empty(), op,
                ": momentum_buffers must be empty when momentum is 0");
    check_step_lists(op, params, master_params, grads, steps, {});
  } else {
    check_step_lists(op, params, master_params, grads, steps,
                     {{"momentum_buffers", momentum_buffers}});
  }
  if (params.empty()) {
    return false;
  }
  step_scalars(op, params[0], lr_tensor, inv_scale, found_inf, grad_sum_sq, max_grad_norm);
  return true;
}

}  // namespace fusedamp::checks
