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
                      const OptTensor&, std::optional<double>, const OptTensor&, int64_t);
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

// Each operator's qualified name, written once: the dispatcher lookups below, the checks'
// messages (op_prelude.h), the Autograd kernels' refusals, the engine's step ops.
namespace names {
inline constexpr char kUnscaleAndCheck[] = "fusedamp::unscale_and_check_";
inline constexpr char kGradStats[] = "fusedamp::grad_stats_";
inline constexpr char kUpdateScale[] = "fusedamp::update_scale_";
inline constexpr char kRecordTelemetry[] = "fusedamp::record_telemetry_";
inline constexpr char kAccountStep[] = "fusedamp::account_step_";
inline constexpr char kAdamStep[] = "fusedamp::adam_step_";
inline constexpr char kSgdStep[] = "fusedamp::sgd_step_";
}  // namespace names

template <typename Signature>
c10::TypedOperatorHandle<Signature> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").template typed<Signature>();
}

// Looked up once per library that calls them (the first call), after the schemas are loaded.
inline const c10::TypedOperatorHandle<UnscaleSig>& unscale_and_check() {
  static const auto op = find<UnscaleSig>(names::kUnscaleAndCheck);
  return op;
}

inline const c10::TypedOperatorHandle<StatsSig>& grad_stats() {
  static const auto op = find<StatsSig>(names::kGradStats);
  return op;
}

inline const c10::TypedOperatorHandle<ScaleSig>& update_scale() {
  static const auto op = find<ScaleSig>(names::kUpdateScale);
  return op;
}

inline const c10::TypedOperatorHandle<TelemetrySig>& record_telemetry() {
  static const auto op = find<TelemetrySig>(names::kRecordTelemetry);
  return op;
}

inline const c10::TypedOperatorHandle<AccountSig>& account_step() {
  static const auto op = find<AccountSig>(names::kAccountStep);
  return op;
}

inline const c10::TypedOperatorHandle<AdamSig>& adam_step() {
  static const auto op = find<AdamSig>(names::kAdamStep);
  return op;
}

inline const c10::TypedOperatorHandle<SgdSig>& sgd_step() {
  static const auto op = find<SgdSig>(names::kSgdStep);
  return op;
}

}  // namespace fusedamp::op_handles
