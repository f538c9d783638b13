#pragma once
// The rules every operator's checks apply (checks.cpp, step_checks.cpp): each decides on a
// tensor's facts (tensor_facts.h) inline and without a message; the message of a failed check is
// built by a raise_* function, out of line, so that the hot path stays small.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include <fusedamp/math/quantized_moments_math.h>

#include "hyper_params.h"
#include "tensor_facts.h"

namespace fusedamp::checks::rules {

using at::Tensor;
using at::TensorList;

// ---- one-element state tensors (found_inf, inv_scale, steps[i], ...) ------------------------
[[noreturn]] C10_NOINLINE inline void raise_scalar(const char* op, const char* name,
                                                   const Tensor& t, ScalarFlaw flaw,
                                                   c10::ScalarType dtype,
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
[[noreturn]] C10_NOINLINE inline void raise_flaw(const char* op, const char* list, size_t i,
                                                 const TensorFacts& f, const c10::Device& device) {
  const Tensor& t = *f.tensor;
  TORCH_CHECK(f.flaw != Flaw::kUndefined, op, ": ", list, "[", i, "] is undefined");
  TORCH_CHECK(f.flaw != Flaw::kNotStrided, op, ": ", list, "[", i,
              "] is sparse (or not strided); only dense tensors are supported");
  TORCH_CHECK(f.flaw != Flaw::kOtherDevice, op, ": ", list, "[", i, "] is on ", t.device(), " but ",
              "the first tensor is on ", device, "; all tensors must share one device");
  TORCH_CHECK(false, op, ": ", list, "[", i,
              "] must be non-overlapping and dense (e.g. contiguous); got sizes ", t.sym_sizes(),
              " strides ", t.sym_strides());
}

C10_ALWAYS_INLINE void check_dense(const char* op, const char* list, size_t i, const TensorFacts& f,
                                   const c10::Device& device) {
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
  kQuantizedCodes,  // quantized moments: int8 exp_avgs, uint8 exp_avg_sqs
};

[[noreturn]] C10_NOINLINE inline void raise_dtype(const char* op, const char* list, size_t i,
                                                  c10::ScalarType got, c10::ScalarType want,
                                                  DtypeRule rule) {
  switch (rule) {
    case DtypeRule::kLikeParams0:
      TORCH_CHECK(false, op, ": params[", i, "] has dtype ", got, " but params[0] has ", want,
                  "; one call takes one params dtype");
    case DtypeRule::kLikeGrads0:
      TORCH_CHECK(false, op, ": grads[", i, "] has dtype ", got, " but grads[0] has ", want);
    case DtypeRule::kLikeList0:
      TORCH_CHECK(false, op, ": ", list, "[", i, "] has dtype ", got, " but ", list, "[0] has ",
                  want, "; one call takes one dtype per list");
    case DtypeRule::kQuantizedCodes:
      TORCH_CHECK(false, op, ": ", list, "[", i, "] has dtype ", got, ", expected ", want,
                  "; quantized state (block scales given) is int8 codes (Adam's exp_avg_sqs: "
                  "uint8)");
    case DtypeRule::kFloatKind:
      break;
  }
  TORCH_CHECK(false, op, ": ", list, "[", i, "] has dtype ", got,
              "; supported are float32, float16 and bfloat16");
}

C10_ALWAYS_INLINE void check_dtype(const char* op, const char* list, size_t i, const TensorFacts& f,
                                   c10::ScalarType want, DtypeRule rule) {
  const bool right = rule == DtypeRule::kFloatKind ? is_float_kind(f.dtype) : f.dtype == want;
  if (C10_UNLIKELY(!right)) {
    raise_dtype(op, list, i, f.dtype, want, rule);
  }
}

// Where t or params[i] has symbolic sizes (torch.compile), their layouts are compared through
// the symbolic-aware accessors, out of line.
C10_NOINLINE inline bool same_sizes_symbolic(const Tensor& t, const Tensor& params) {
  return t.sym_sizes() == params.sym_sizes();
}

C10_NOINLINE inline bool same_strides_symbolic(const Tensor& t, const Tensor& params) {
  return t.sym_numel() <= 1 || t.sym_strides() == params.sym_strides();
}

[[noreturn]] C10_NOINLINE inline void raise_layout(const char* op, const char* list, size_t i,
                                                   const Tensor& t, const Tensor& params,
                                                   bool shape) {
  TORCH_CHECK(!shape, op, ": ", list, "[", i, "] has shape ", t.sym_sizes(), " but params[", i,
              "] has shape ", params.sym_sizes());
  TORCH_CHECK(false, op, ": ", list, "[", i, "] has strides ", t.sym_strides(), " but params[", i,
              "] has strides ", params.sym_strides());
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

[[noreturn]] C10_NOINLINE inline void raise_overlap(const char* op, size_t i, const char* a_list,
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

// block_scales[i] (quantized state, math/quantized_moments_math.h): a contiguous float32
// tensor of one row per block of params[i], one column per quantized state list ([blocks,
// columns], or the engine's [rows, blocks per row, columns]): the kernels read its memory.
[[noreturn]] C10_NOINLINE inline void raise_block_scales(const char* op, const char* list,
                                                         size_t i, int64_t columns,
                                                         const Tensor& t, const Tensor& params) {
  TORCH_CHECK(false, op, ": ", list, "[", i, "] must be a contiguous float32 tensor of ",
              "shape [..., ", columns, "] with one row per block of ", math::kMomentBlock,
              " elements of params[", i, "] (", params.sym_numel(), " elements: ",
              (params.sym_numel() + (math::kMomentBlock - 1)) / math::kMomentBlock,
              " rows); got ", t.scalar_type(), " of shape ", t.sym_sizes(), " strides ",
              t.sym_strides());
}

C10_ALWAYS_INLINE void check_block_scales(const char* op, const char* list, size_t i,
                                          int64_t columns, const TensorFacts& t,
                                          const TensorFacts& params) {
  const Tensor& a = *t.tensor;
  const Tensor& p = *params.tensor;
  const bool concrete = C10_LIKELY(t.concrete && params.concrete);
  const bool right =
      t.dtype == at::kFloat && a.dim() >= 2 &&
      (concrete ? a.size(-1) == columns &&
                      a.numel() == columns * math::moment_blocks(p.numel()) && a.is_contiguous()
                : a.sym_numel() == (p.sym_numel() + (math::kMomentBlock - 1)) /
                                       math::kMomentBlock * columns);
  if (C10_UNLIKELY(!right)) {
    raise_block_scales(op, list, i, columns, a, p);
  }
}

inline void check_list_length(const char* op, const char* name, TensorList l, size_t n) {
  TORCH_CHECK(l.size() == n, op, ": ", name, " has ", l.size(), " tensors but params has ", n);
}

inline void check_finite_nonneg(const char* op, const char* name, double v) {
  TORCH_CHECK(hyper::finite_nonneg(v), op, ": invalid ", name, " ", v,
              " (must be finite and >= 0)");
}

inline void check_beta(const char* op, const char* name, double v) {
  TORCH_CHECK(hyper::valid_beta(v), op, ": invalid ", name, " ", v, " (must be in [0, 1))");
}

// A 1-D argument a kernel indexes as plain memory (a flag per grad, a telemetry record, a
// ring of norms): strided and contiguous, of `dtype` (`dtype_name`, as torch names it), on
// `device`, the device of the op's argument `anchor`. Its length is each op's own check.
void check_vector(const char* op, const char* name, const Tensor& t, c10::ScalarType dtype,
                  const char* dtype_name, const c10::Device& device, const char* anchor);

}  // namespace fusedamp::checks::rules
