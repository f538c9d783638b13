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

#include <cstdint>
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

// How a step keeps the weights it updates (master_weights of the optimizers): the element
// math sees FP32 lanes either way; only the loads and stores differ (cpu/step_weights.h and
// cuda/step_weights.cuh StepWeights).
enum class WeightStore : uint8_t {
  kParams,                // no master: the params are read and written (round to nearest)
  kMaster,                // FP32 master_params (master_weights=True)
  kMasterAdoptingEdits,   // the same, and edited params are taken into their masters
  kSplit,                 // BF16 params + int16 remainders in master_params (math/split_math.h)
  kSplit8,                // BF16 params + int8 remainders: 24-bit masters (math/split_math.h)
  kKahan,                 // FP16/BF16 params + compensations of their dtype (math/kahan_math.h)
  kStochastic,            // BF16 params, stochastic rounding (math/stochastic_rounding_math.h)
};

// The remainder element of a split store (int16_t for kSplit, int8_t for kSplit8).
template <WeightStore kStore>
using SplitRemainder = std::conditional_t<kStore == WeightStore::kSplit8, int8_t, int16_t>;

constexpr bool is_split_store(WeightStore store) {
  return store == WeightStore::kSplit || store == WeightStore::kSplit8;
}

// Which stores exist for a param element type; no kernel is instantiated for the others (the
// argument checks reject them first).
template <typename TP>
constexpr bool weight_store_fits(WeightStore store) {
  constexpr bool bf16 = std::is_same_v<TP, c10::BFloat16>;
  constexpr bool half = std::is_same_v<TP, c10::Half>;
  switch (store) {
    case WeightStore::kSplit:
    case WeightStore::kSplit8:
    case WeightStore::kStochastic:
      return bf16;
    case WeightStore::kKahan:
      return bf16 || half;
    default:
      return true;
  }
}

// The store a step's arguments ask for (checked by op_checks.h): master_params' dtype names
// it — FP32 masters, int16 or int8 remainders, or compensations of the params' dtype — and stochastic
// rounding comes with its seeds and no master_params.
inline WeightStore weight_store_of(at::TensorList master_params, bool adopt_param_edits,
                                   bool stochastic_rounding) {
  if (stochastic_rounding) {
    return WeightStore::kStochastic;
  }
  if (master_params.empty()) {
    return WeightStore::kParams;
  }
  switch (master_params[0].scalar_type()) {
    case at::kFloat:
      return adopt_param_edits ? WeightStore::kMasterAdoptingEdits : WeightStore::kMaster;
    case at::kShort:
      return WeightStore::kSplit;
    case at::kChar:
      return WeightStore::kSplit8;
    default:
      return WeightStore::kKahan;
  }
}

// A WeightStore among kStores: visits std::integral_constant<WeightStore, store>.
template <WeightStore... kStores>
struct WeightStoreSwitchOf {
  WeightStore store;

  template <typename Fn>
  void visit(Fn&& fn) const {
    const bool found =
        ((store == kStores && (fn(std::integral_constant<WeightStore, kStores>{}), true)) || ...);
    TORCH_INTERNAL_ASSERT(found, "fusedamp: no kernel for weight store ", int(store));
  }
};

using WeightStoreSwitch =
    WeightStoreSwitchOf<WeightStore::kParams, WeightStore::kMaster,
                        WeightStore::kMasterAdoptingEdits, WeightStore::kSplit,
                        WeightStore::kSplit8, WeightStore::kKahan, WeightStore::kStochastic>;

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
