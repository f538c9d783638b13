// The checks of the loss scaler's operators and of account_step_ (checks.h); the step
// operators' are in step_checks.cpp.
#include "checks.h"

#include <c10/util/Exception.h>
#include <fusedamp/math/telemetry_math.h>

#include <cmath>
#include <cstdint>

#include "check_rules.h"
#include "hyper_params.h"
#include "tensor_facts.h"
#include "tensor_prefetch.h"

namespace fusedamp::checks {

using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;
using namespace rules;

void rules::check_vector(const char* op, const char* name, const Tensor& t, c10::ScalarType dtype,
                         const char* dtype_name, const c10::Device& device, const char* anchor) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.layout() == at::kStrided && t.dim() == 1 && t.is_contiguous(), op, ": ", name,
              " must be a contiguous 1-D tensor, got shape ", t.sym_sizes());
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype_name, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(), " but ", anchor,
              " is on ", device);
}

namespace {

bool given(const OptTensor& t) { return t.has_value() && t->defined(); }

// The grads of unscale_and_check_ / grad_stats_: each FP32, FP16 or BF16 and dense on `device`,
// or one for the per-tensor path (per_tensor_grad); returns whether any grad is such.
bool check_grad_list(const char* op, TensorList grads, const c10::Device& device) {
  bool any_per_tensor = false;
  for (size_t i = 0; i < grads.size(); ++i) {
    prefetch_ahead(i, {grads});
    const TensorFacts g = facts_of(grads[i], device);
    if (is_per_tensor(g)) {
      any_per_tensor = true;
      continue;
    }
    check_dense(op, "grads", i, g, device);
    check_dtype(op, "grads", i, g, c10::ScalarType::Undefined, DtypeRule::kFloatKind);
  }
  return any_per_tensor;
}

// grad_stats_'s telemetry output, where either op takes it.
void check_telemetry(const char* op, const OptTensor& telemetry, const c10::Device& device) {
  if (!given(telemetry)) {
    return;
  }
  const Tensor& t = *telemetry;
  check_vector(op, "telemetry", t, at::kDouble, "float64", device, "found_inf");
  TORCH_CHECK(t.sym_numel() == math::kTelemetrySlots, op, ": telemetry must have ",
              math::kTelemetrySlots,
              " elements (amax, subnormal count, zero count, first "
              "non-finite position), got ",
              t.sym_numel());
}

// The tensor whose device every other argument of an op must share (the first the op writes):
// defined, and its device.
c10::Device device_of(const char* op, const char* name, const Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  return t.device();
}

// The same for a one-element tensor of the given dtype, which is checked as such.
c10::Device scalar_device_of(const char* op, const char* name, const Tensor& t,
                             at::ScalarType dtype) {
  const auto device = device_of(op, name, t);
  check_scalar(op, name, t, dtype, device);
  return device;
}

// An optional one-element tensor: checked where given.
void check_given_scalar(const char* op, const char* name, const OptTensor& t,
                        at::ScalarType dtype, const c10::Device& device) {
  if (given(t)) {
    check_scalar(op, name, *t, dtype, device);
  }
}

}  // namespace

bool unscale_and_check(const ops::UnscaleAndCheck& a) {
  const char* op = a.kName;
  const auto device = scalar_device_of(op, "found_inf", a.found_inf, at::kFloat);
  check_scalar(op, "inv_scale", a.inv_scale, at::kFloat, device);
  check_given_scalar(op, "sum_sq", a.sum_sq, at::kFloat, device);
  TORCH_CHECK(given(a.sum_sq) || !given(a.telemetry), op,
              ": telemetry needs sum_sq (the statistics pass gives both)");
  check_telemetry(op, a.telemetry, device);
  return check_grad_list(op, a.grads, device);
}

bool per_tensor_grad(const Tensor& grad) { return is_per_tensor(facts_of(grad, grad.device())); }

bool grad_stats(const ops::GradStats& a) {
  const char* op = a.kName;
  const auto device = scalar_device_of(op, "found_inf", a.found_inf, at::kFloat);
  check_scalar(op, "sum_sq", a.sum_sq, at::kFloat, device);
  if (given(a.tensor_flags)) {
    const Tensor& f = *a.tensor_flags;
    check_vector(op, "tensor_flags", f, at::kFloat, "float32", device, "found_inf");
    TORCH_CHECK(f.sym_numel() == static_cast<int64_t>(a.grads.size()), op, ": tensor_flags has ",
                f.sym_numel(), " elements but there are ", a.grads.size(), " grads");
  }
  check_telemetry(op, a.telemetry, device);
  return check_grad_list(op, a.grads, device);
}

void update_scale(const ops::UpdateScale& a) {
  const char* op = a.kName;
  const auto device = scalar_device_of(op, "scale", a.scale, at::kFloat);
  check_scalar(op, "growth_tracker", a.growth_tracker, at::kInt, device);
  check_scalar(op, "hysteresis_tracker", a.hysteresis_tracker, at::kInt, device);
  check_scalar(op, "found_inf", a.found_inf, at::kFloat, device);
  hyper::check_scale_options(op, a.growth_factor, a.backoff_factor, a.growth_interval, a.hysteresis,
                             a.min_scale, a.max_scale);
  if (a.amax_target.has_value()) {
    TORCH_CHECK(std::isfinite(*a.amax_target) && *a.amax_target > 0.0, op,
                ": amax_target must be finite and > 0, got ", *a.amax_target);
    TORCH_CHECK(given(a.amax), op, ": amax_target needs amax (this step's largest |gradient|)");
  }
  if (given(a.amax)) {
    TORCH_CHECK(a.amax_target.has_value(), op,
                ": amax is given without amax_target (the amax policy needs both)");
    check_scalar(op, "amax", *a.amax, at::kDouble, device);
  }
}

void record_telemetry(const ops::RecordTelemetry& a) {
  const char* op = a.kName;
  const Tensor& ring = a.ring;
  const auto device = device_of(op, "ring", ring);
  TORCH_CHECK(ring.layout() == at::kStrided && ring.dim() == 2 && ring.is_contiguous() &&
                  ring.scalar_type() == at::kDouble && ring.sym_size(1) == math::kTelemetryColumns,
              op, ": ring must be a contiguous float64 tensor of shape [capacity, ",
              int64_t{math::kTelemetryColumns}, "], got ", ring.scalar_type(), " of shape ",
              ring.sym_sizes());
  TORCH_CHECK(ring.sym_size(0) >= 1, op, ": ring must have at least one row");
  check_scalar(op, "position", a.position, at::kLong, device);
  check_scalar(op, "scale", a.scale, at::kFloat, device);
  check_scalar(op, "found_inf", a.found_inf, at::kFloat, device);
  check_vector(op, "measured", a.measured, at::kDouble, "float64", device, "ring");
  TORCH_CHECK(a.measured.sym_numel() == math::kTelemetrySlots + 1, op, ": measured must have ",
              int64_t{math::kTelemetrySlots + 1},
              " elements (the telemetry slots and a sum of "
              "squares), got ",
              a.measured.sym_numel());
  check_given_scalar(op, "pass_sum_sq", a.pass_sum_sq, at::kFloat, device);
}

void account_step(const ops::AccountStep& a) {
  const char* op = a.kName;
  const auto device = scalar_device_of(op, "step_applied", a.step_applied, at::kFloat);
  check_scalar(op, "skipped_steps", a.skipped_steps, at::kLong, device);
  check_given_scalar(op, "found_inf", a.found_inf, at::kFloat, device);
  if (given(a.found_inf_out)) {
    TORCH_CHECK(given(a.found_inf), op,
                ": found_inf_out is given without found_inf (an unchecked step has no flag)");
    check_scalar(op, "found_inf_out", *a.found_inf_out, at::kFloat, device);
  }
  if (!given(a.grad_norm)) {
    TORCH_CHECK(!given(a.grad_sum_sq) && !given(a.inv_scale), op,
                ": grad_sum_sq and inv_scale only make the norm written into grad_norm, which "
                "is not given");
    return;
  }
  TORCH_CHECK(given(a.grad_sum_sq), op,
              ": grad_norm needs grad_sum_sq (the sum of squares from grad_stats_)");
  check_scalar(op, "grad_sum_sq", *a.grad_sum_sq, at::kFloat, device);
  check_given_scalar(op, "inv_scale", a.inv_scale, at::kFloat, device);
  check_scalar(op, "grad_norm", *a.grad_norm, at::kFloat, device);
}

}  // namespace fusedamp::checks
