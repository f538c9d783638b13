#pragma once
// What the argument checks (op_checks.cpp) know about one tensor, each fact read once.
//
// The facts come from the TensorImpl: torch's generic (symbolic-aware) accessors repeat their
// own checks on every call, which with many small tensors used to be most of an op's host
// time. Sizes, strides and numel come from the plain accessors where they hold concrete values,
// from the symbolic-aware ones otherwise (torch.compile's FakeTensors, tensor subclasses). The
// checks decide on these facts alone, in one fixed order, and build a message only for the
// first one that fails: one definition of "valid", whatever path a tensor's facts came by.
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/core/TensorImpl.h>

#include <cstdint>

namespace fusedamp::checks {

// The element types the fused kernels walk.
inline bool is_float_kind(c10::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// Sizes, strides and numel are plain values (not symbolic, not answered by Python).
C10_ALWAYS_INLINE bool has_concrete_sizes(const c10::TensorImpl& impl) {
  return !impl.has_symbolic_sizes_strides() && !impl.is_nested() && !impl.is_python_dispatch();
}

// The bytes a tensor covers, as the overlap test sees them: data pointer to data pointer plus
// numel * item size; empty when it has no memory (meta, FakeTensor) or no elements (such a
// range overlaps nothing).
struct Span {
  const char* lo = nullptr;  // nullptr: empty
  const char* hi = nullptr;
};

// Two shapes (or two stride lists) alike, compared inline: IntArrayRef::equals and == call
// memcmp, a library call per comparison that was 3.5% of a whole AMP step over 10,000
// one-element tensors (perf), for lists of one to four numbers.
C10_ALWAYS_INLINE bool same_ints(c10::IntArrayRef x, c10::IntArrayRef y) {
  if (x.size() != y.size()) {
    return false;
  }
  for (size_t d = 0; d < x.size(); ++d) {
    if (x[d] != y[d]) {
      return false;
    }
  }
  return true;
}

inline bool disjoint(const Span& a, const Span& b) {
  return a.lo == nullptr || b.lo == nullptr || !(a.lo < b.hi && b.lo < a.hi);
}

// The span of a tensor with concrete sizes, from the TensorImpl fields that const_data_ptr()
// combines (without its own checks).
C10_ALWAYS_INLINE Span span_of_concrete(const c10::TensorImpl& impl) {
  Span s;
  const int64_t n = impl.numel();
  if (n != 0 && impl.has_storage()) {
    const auto* base = static_cast<const char*>(impl.storage().data());
    if (base != nullptr) {
      const auto item = static_cast<int64_t>(impl.dtype().itemsize());
      s.lo = base + impl.storage_offset() * item;
      s.hi = s.lo + n * item;
    }
  }
  return s;
}

// The same through the symbolic-aware accessors (the overlap test's own definition).
C10_NOINLINE inline Span span_of_symbolic(const at::Tensor& t) {
  Span s;
  if (t.has_storage() && t.storage().data() != nullptr && t.numel() != 0) {
    s.lo = static_cast<const char*>(t.const_data_ptr());
    s.hi = s.lo + t.numel() * t.element_size();
  }
  return s;
}

// What keeps a tensor from being walked as one flat dense block on the op's device: the first
// of these that holds (the later ones are not read then).
enum class Flaw : uint8_t { kNone, kUndefined, kNotStrided, kOtherDevice, kNotDense };

// Filled by read_facts (all members, so that a slot needs no initialisation before).
struct TensorFacts {
  const at::Tensor* tensor;
  Flaw flaw;
  c10::ScalarType dtype;
  bool concrete;  // see has_concrete_sizes
  Span span;      // read only when asked for
};

// All facts of one tensor, in one pass, into f. Reading them has no side effect on a tensor that
// reaches an op's kernel (FakeTensors under torch.compile answer through the symbolic-aware
// accessors; a wrapper subclass, whose storage may not be read, is handled by its own
// __torch_dispatch__ first), so they are read before any is judged.
C10_ALWAYS_INLINE void read_facts(const at::Tensor& t, const c10::Device& device, bool with_span,
                                  TensorFacts& f) {
  f.tensor = &t;
  if (!t.defined()) {
    f.flaw = Flaw::kUndefined;
    f.dtype = c10::ScalarType::Undefined;
    f.concrete = false;
    f.span = Span();
    return;
  }
  const c10::TensorImpl& impl = *t.unsafeGetTensorImpl();
  const bool concrete = has_concrete_sizes(impl);
  f.concrete = concrete;
  f.dtype = c10::typeMetaToScalarType(impl.dtype());
  f.flaw = impl.layout() != at::kStrided       ? Flaw::kNotStrided
           : impl.device() != device            ? Flaw::kOtherDevice
           : !impl.is_non_overlapping_and_dense() ? Flaw::kNotDense
                                                  : Flaw::kNone;
  // The span of a tensor with a flaw still counts: the overlap test of a state list looks at
  // the later state lists before their own checks.
  f.span = !with_span                ? Span()
           : C10_LIKELY(concrete)    ? span_of_concrete(impl)
                                     : span_of_symbolic(t);
}

// A parameter and its gradient as every fused step takes them, decided on their facts alone
// (read on the step's device, with spans): both strided, dense and on the device, of plain
// sizes, of one shape and (beyond one element) the same strides, in memory of their own.
// Where this holds, every check of the pair passes (dtypes aside: each caller knows what it
// expects); where not, the message-raising checks decide.
C10_ALWAYS_INLINE bool clean_param_and_grad(const TensorFacts& param, const TensorFacts& grad) {
  if (param.flaw != Flaw::kNone || grad.flaw != Flaw::kNone || !param.concrete ||
      !grad.concrete) {
    return false;
  }
  const c10::TensorImpl& p = *param.tensor->unsafeGetTensorImpl();
  const c10::TensorImpl& g = *grad.tensor->unsafeGetTensorImpl();
  return same_ints(g.sizes(), p.sizes()) &&
         (p.numel() <= 1 || same_ints(g.strides(), p.strides())) &&
         disjoint(param.span, grad.span);
}

inline TensorFacts facts_of(const at::Tensor& t, const c10::Device& device) {
  TensorFacts f;
  read_facts(t, device, /*with_span=*/false, f);
  return f;
}

// A grad unscale_and_check_ hands to torch's per-tensor kernel (op_checks.h per_tensor_grad):
// FP64, or a float grad that is strided but not dense.
inline bool is_per_tensor(const TensorFacts& g) {
  return (g.flaw == Flaw::kNone && g.dtype == at::kDouble) ||
         (g.flaw == Flaw::kNotDense && (is_float_kind(g.dtype) || g.dtype == at::kDouble));
}

// ---- one-element tensors ------------------------------------------------------------------

enum class ScalarFlaw : uint8_t { kNone, kUndefined, kNotStrided, kNotOneElement, kDtype, kDevice };

C10_NOINLINE inline bool has_one_element_symbolic(const at::Tensor& t) {
  return t.sym_numel() == 1;
}

// What keeps a tensor from being a one-element `dtype` scalar on `device` (found_inf, inv_scale,
// steps[i], ...): the first of these that holds.
C10_ALWAYS_INLINE ScalarFlaw scalar_flaw(const at::Tensor& t, c10::ScalarType dtype,
                                         const c10::Device& device) {
  if (!t.defined()) {
    return ScalarFlaw::kUndefined;
  }
  const c10::TensorImpl& impl = *t.unsafeGetTensorImpl();
  if (impl.layout() != at::kStrided) {
    return ScalarFlaw::kNotStrided;
  }
  if (!(C10_LIKELY(has_concrete_sizes(impl)) ? impl.numel() == 1 : has_one_element_symbolic(t))) {
    return ScalarFlaw::kNotOneElement;
  }
  if (impl.dtype() != dtype) {
    return ScalarFlaw::kDtype;
  }
  return impl.device() != device ? ScalarFlaw::kDevice : ScalarFlaw::kNone;
}

}  // namespace fusedamp::checks
