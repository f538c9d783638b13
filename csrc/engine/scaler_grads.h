#pragma once
// The gradients as fusedamp::GradScaler handles them for optimizers that do not unscale in
// their step (torch.amp's unscale_ and its check before a fused optimizer's step): one fused
// op per device over every gradient the ops take (sparse gradients as their values; an FP16 one
// coalesced first, as torch does, since values at duplicate indices could overflow only once
// summed), and a per-tensor path for dtypes the ops refuse. Flags are 0-dim FP32 on `target`,
// nonzero where any gradient held inf/NaN; nothing here waits for the device.
// With a telemetry sink the passes go through the sink, which records the gradients (as they
// were before unscaling) in the same pass.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>
#include <fusedamp/telemetry.h>

namespace fusedamp::detail {

// grads *= inv_scale in place for every parameter's .grad; returns the overflow flag.
at::Tensor unscale_grads(at::TensorList params, const at::Tensor& inv_scale,
                         const c10::Device& target, GradTelemetrySink* telemetry = nullptr);
// The same check without changing anything (one read-only pass).
at::Tensor check_grads(at::TensorList params, const c10::Device& target,
                       GradTelemetrySink* telemetry = nullptr);

}  // namespace fusedamp::detail
