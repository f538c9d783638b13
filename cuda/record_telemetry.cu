// CUDA: a loss scaler's telemetry record of one iteration (record_telemetry_) as a one-thread
// kernel: one launch where the record took three copy kernels (and the pass's sum an add).
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <fusedamp/math/telemetry_math.h>

#include "cuda_kernels.h"

namespace fusedamp::cuda {
namespace {

__global__ void record_telemetry_kernel(double* row, const float* scale, const float* found_inf,
                                        const double* measured, const float* pass_sum_sq) {
  math::write_telemetry_row(row, *scale, *found_inf, measured, pass_sum_sq);
}

}  // namespace

void record_telemetry(const ops::RecordTelemetry& op) {
  record_telemetry_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(
      op.ring.data_ptr<double>() + op.slot * math::kTelemetryColumns,
      op.scale.const_data_ptr<float>(), op.found_inf.const_data_ptr<float>(),
      op.measured.const_data_ptr<double>(), input_or_null<float>(op.pass_sum_sq));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fusedamp::cuda
