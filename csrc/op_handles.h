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

// The handle of the operator named `Name`, looked up once per library that calls it (the first
// call), after the schemas are loaded.
template <typename Signature, const char* Name>
const c10::TypedOperatorHandle<Signature>& handle() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(Name, "").template typed<Signature>();
  return op;
}

inline const auto& unscale_and_check() { return handle<UnscaleSig, names::kUnscaleAndCheck>(); }
inline const auto& grad_stats() { return handle<StatsSig, names::kGradStats>(); }
inline const auto& update_scale() { return handle<ScaleSig, names::kUpdateScale>(); }
inline const auto& record_telemetry() { return handle<TelemetrySig, names::kRecordTelemetry>(); }
inline const auto& account_step() { return handle<AccountSig, names::kAccountStep>(); }
inline const auto& adam_step() { return handle<AdamSig, names::kAdamStep>(); }
inline const auto& sgd_step() { return handle<SgdSig, names::kSgdStep>(); }

}  // namespace fusedamp::op_handles
