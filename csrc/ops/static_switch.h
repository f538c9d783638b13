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

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <fusedamp/master_modes.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

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
// checks (ops/checks.h) before a kernel runs, so reaching the end is an internal error.
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

// How a step keeps the weights it updates: its master-weight mode (fusedamp/master_modes.h), as
// the kernels name it. The element math sees FP32 lanes either way; only the loads and stores
// differ (cpu/step_weights.h and cuda/step_weights.cuh StepWeights).
using WeightStore = MasterMode;

namespace detail {
template <typename T>
struct TypeIs {
  using type = T;
};
template <c10::ScalarType kDtype>
struct CppTypeOf {
  using type = c10::impl::ScalarTypeToCPPTypeT<kDtype>;
};
}  // namespace detail

// The element of what kStore keeps in master_params beside params of TP: an FP32 master, a
// remainder (int16_t, int8_t) or a compensation (TP); float where it keeps nothing.
template <typename TP, WeightStore kStore>
using KeptElem = typename std::conditional_t<
    master_mode_info(kStore).kept == MasterKept::kCompensation, detail::TypeIs<TP>,
    std::conditional_t<master_mode_info(kStore).kept_dtype == c10::ScalarType::Undefined,
                       detail::TypeIs<float>,
                       detail::CppTypeOf<master_mode_info(kStore).kept_dtype>>>::type;

// The remainder element of a split store.
template <WeightStore kStore>
using SplitRemainder = KeptElem<c10::BFloat16, kStore>;

constexpr bool is_split_store(WeightStore store) {
  return master_mode_info(store).kept == MasterKept::kRemainder;
}

// Which stores exist for a param element type; no kernel is instantiated for the others (the
// argument checks reject them first).
template <typename TP>
constexpr bool weight_store_fits(WeightStore store) {
  return master_mode_fits(master_mode_info(store), c10::CppTypeToScalarType<TP>::value);
}

// A WeightStore among kStores: visits std::integral_constant<WeightStore, store>.
template <WeightStore... kStores>
struct WeightStoreSwitchOf {
  WeightStore store;

  // Whether kernels are instantiated for `mode`.
  static constexpr bool holds(WeightStore mode) { return ((mode == kStores) || ...); }

  template <typename Fn>
  void visit(Fn&& fn) const {
    const bool found =
        ((store == kStores && (fn(std::integral_constant<WeightStore, kStores>{}), true)) || ...);
    TORCH_INTERNAL_ASSERT(found, "fusedamp: no kernel for weight store ", int(store));
  }
};

namespace detail {
template <size_t... kIndex>
WeightStoreSwitchOf<kMasterModes[kIndex].mode...> every_store(std::index_sequence<kIndex...>);
}  // namespace detail

// Every mode of kMasterModes.
using WeightStoreSwitch =
    decltype(detail::every_store(std::make_index_sequence<kMasterModes.size()>{}));

// The choices every fused step kernel makes, then the kernel's own: body(param, grad, kStore,
// more...), where param has the params' element type (FP32, FP16 or BF16), grad the grads'
// (FP32 or the params') and kStore is how the weights are kept (WeightStore; only the
// combinations weight_store_fits allows are instantiated). Whether the multiplied gradients are
// written back is a runtime flag of the kernels on both backends (one predictable branch per
// vector, half the kernels to compile; cuda/step_weights.cuh StepGrads). The lists have been
// checked (ops/checks.h); empty ones have nothing to run.
template <typename Body, typename... More>
void step_switch(at::TensorList params, at::TensorList grads, WeightStore store, Body&& body,
                 const More&... more) {
  if (params.empty()) {
    return;
  }
  FUSEDAMP_DISPATCH_FLOAT_TYPES(params[0].scalar_type(), "fusedamp_step", [&] {
    static_switch(
        [&](auto grad, auto kept, auto... chosen) {
          if constexpr (weight_store_fits<scalar_t>(decltype(kept)::value)) {
            body(scalar_t{}, grad, kept, chosen...);
          }
        },
        DtypeSwitch<float, scalar_t>{grads[0].scalar_type()}, WeightStoreSwitch{store},
        more...);
  });
}

}  // namespace fusedamp
