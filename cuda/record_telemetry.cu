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

void record_telemetry(const at::Tensor& ring, int64_t slot, const at::Tensor& scale,
                      const at::Tensor& found_inf, const at::Tensor& measured,
                      const at::Tensor* pass_sum_sq) {
  record_telemetry_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(
      ring.data_ptr<double>() + slot * math::kTelemetryColumns, scale.const_data_ptr<float>(),
      found_inf.const_data_ptr<float>(), measured.const_data_ptr<double>(),
      pass_sum_sq != nullptr ? pass_sum_sq->const_data_ptr<float>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fusedamp::cuda
