#pragma once
// The typed dispatcher handle of each fusedamp operator: the C++ signature of its schema
// (csrc/schemas.cpp), written once. Everything that calls an op unboxed goes through these: the
// C++ API (ops.cpp), the Autograd / ADInplaceOrView kernels (autograd/register_autograd.cpp)
// and fusedamp.ops, the Python entry (python/bind_ops.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/OptionalArrayRef.h>

#include <cstdint>
#include <optional>

namespace fusedamp::op_handles {

using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;

using UnscaleSig = void(TensorList, const Tensor&, const Tensor&, const OptTensor&,
                        const OptTensor&);
using StatsSig = void(TensorList, const Tensor&, const Tensor&, const OptTensor&, const OptTensor&);
using ScaleSig = void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, double,
                      int64_t, int64_t, std::optional<double>, std::optional<double>,
                      const OptTensor&, std::optional<double>);
using TelemetrySig = void(const Tensor&, int64_t, const Tensor&, const Tensor&, const Tensor&,
                          const OptTensor&);
using AccountSig = void(const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                        const OptTensor&, const OptTensor&, const OptTensor&, int64_t);
using AdamSig = void(TensorList, TensorList, TensorList, TensorList, TensorList, TensorList, double,
                     double, double, double, double, bool, bool, const OptTensor&, const OptTensor&,
                     const OptTensor&, const OptTensor&, std::optional<double>, bool, bool,
                     std::optional<TensorList>, c10::OptionalIntArrayRef);
using SgdSig = void(TensorList, TensorList, TensorList, TensorList, TensorList, double, double,
                    double, double, bool, bool, const OptTensor&, const OptTensor&,
                    const OptTensor&, const OptTensor&, std::optional<double>, bool, bool,
                    c10::OptionalIntArrayRef);

template <typename Signature>
c10::TypedOperatorHandle<Signature> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").template typed<Signature>();
}

// Looked up once per library that calls them (the first call), after the schemas are loaded.
inline const c10::TypedOperatorHandle<UnscaleSig>& unscale_and_check() {
  static const auto op = find<UnscaleSig>("fusedamp::unscale_and_check_");
  return op;
}

inline const c10::TypedOperatorHandle<StatsSig>& grad_stats() {
  static const auto op = find<StatsSig>("fusedamp::grad_stats_");
  return op;
}

inline const c10::TypedOperatorHandle<ScaleSig>& update_scale() {
  static const auto op = find<ScaleSig>("fusedamp::update_scale_");
  return op;
}

inline const c10::TypedOperatorHandle<TelemetrySig>& record_telemetry() {
  static const auto op = find<TelemetrySig>("fusedamp::record_telemetry_");
  return op;
}

inline const c10::TypedOperatorHandle<AccountSig>& account_step() {
  static const auto op = find<AccountSig>("fusedamp::account_step_");
  return op;
}

inline const c10::TypedOperatorHandle<AdamSig>& adam_step() {
  static const auto op = find<AdamSig>("fusedamp::adam_step_");
  return op;
}

inline const c10::TypedOperatorHandle<SgdSig>& sgd_step() {
  static const auto op = find<SgdSig>("fusedamp::sgd_step_");
  return op;
}

}  // namespace fusedamp::op_handles
