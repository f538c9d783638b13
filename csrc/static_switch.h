#pragma once
// Compile-time switches: a runtime choice (a flag, a dtype) becomes a template argument, so that
// a kernel is compiled once per combination and its inner loop tests nothing. Host code only;
// used by the CPU (.cpp) and the CUDA (.cu) step kernels alike.
//
//   static_switch(body, BoolSwitch{has_master}, DtypeSwitch<float, TP>{grad_dtype});
//
// calls body(kHasMaster, grad) once, with kHasMaster a std::bool_constant (usable directly as a
// `bool` template argument) and grad a value of the chosen element type (use decltype(grad)).
// A switch is any type with visit(fn) that calls fn with one compile-time value; the set of
// switches is open, so a new choice is one more argument (and one more template parameter of
// the kernel), not another branch of a hand-written ladder.
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <type_traits>

#include "dispatch_float_types.h"

namespace fusedamp {

// A flag: visits std::true_type or std::false_type.
struct BoolSwitch {
  bool on;

  template <typename Fn>
  void visit(Fn&& fn) const {
    if (on) {
      fn(std::true_type{});
    } else {
      fn(std::false_type{});
    }
  }
};

// A dtype among a fixed set of element types: visits T{} for the first T of Ts whose dtype it
// is. Only the listed types are instantiated; any other dtype has been rejected by the argument
// checks (op_checks.h) before a kernel runs, so reaching the end is an internal error.
template <typename... Ts>
struct DtypeSwitch {
  c10::ScalarType dtype;

  template <typename Fn>
  void visit(Fn&& fn) const {
    const bool found = (visit_if<Ts>(fn) || ...);
    TORCH_INTERNAL_ASSERT(found, "fusedamp: no kernel instantiated for dtype ", dtype);
  }

 private:
  template <typename T, typename Fn>
  bool visit_if(Fn& fn) const {
    if (dtype != c10::CppTypeToScalarType<T>::value) {
      return false;
    }
    fn(T{});
    return true;
  }
};

// body(v1, ..., vN): one compile-time value per switch, in the order given.
template <typename Body>
void static_switch(Body&& body) {
  body();
}

template <typename Body, typename First, typename... Rest>
void static_switch(Body&& body, const First& first, const Rest&... rest) {
  first.visit([&](auto chosen) {
    static_switch([&](auto... later) { body(chosen, later...); }, rest...);
  });
}

// The choices every fused step kernel makes, then the kernel's own: body(param, grad,
// kHasMaster, kAdoptEdits, kWriteGrads, more...), where param has the params' element type
// (FP32, FP16 or BF16), grad the grads' (FP32 or the params'), kHasMaster says whether FP32
// master weights are given, kAdoptEdits whether edited params are adopted into their masters
// (never without masters: that combination is not instantiated) and kWriteGrads whether the
// multiplied gradients are written back. The lists have been checked (op_checks.h); empty ones
// have nothing to run.
template <typename Body, typename... More>
void step_switch(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                 bool adopt_param_edits, bool write_back_grads, Body&& body,
                 const More&... more) {
  if (params.empty()) {
    return;
  }
  const bool has_master = !master_params.empty();
  FUSEDAMP_DISPATCH_FLOAT_TYPES(params[0].scalar_type(), "fusedamp_step", [&] {
    static_switch(
        [&](auto grad, auto master_on, auto adopt_on, auto... chosen) {
          if constexpr (decltype(master_on)::value || !decltype(adopt_on)::value) {
            body(scalar_t{}, grad, master_on, adopt_on, chosen...);
          }
        },
        DtypeSwitch<float, scalar_t>{grads[0].scalar_type()}, BoolSwitch{has_master},
        BoolSwitch{has_master && adopt_param_edits}, BoolSwitch{write_back_grads}, more...);
  });
}

}  // namespace fusedamp
