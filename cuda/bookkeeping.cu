// CUDA: the step's bookkeeping on the device — the loss scale, what an optimizer step records,
// the scaler's telemetry row and the per-tensor step counts. Each is a tiny kernel (one thread,
// or one thread per tensor) that keeps its values on the device; they share one file because
// each costs a compile of torch's headers and little else.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <fusedamp/math/scale_math.h>
#include <fusedamp/math/step_account_math.h>
#include <fusedamp/math/telemetry_math.h>

#include <algorithm>

#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"

namespace fusedamp::cuda {

// The loss-scale state machine (update_scale_) as a one-thread kernel, so the scale, the
// trackers and found_inf never leave the device. Memory traffic: 4 scalars read (5 with amax),
// 3 written. The factors are double (math::ScaleHyper), as in torch's CUDA _amp_update_scale_,
// so with hysteresis 1 and no bounds the scale sequence is torch's bit for bit.
namespace {

__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker,
                                    int32_t* hysteresis_tracker, const float* found_inf,
                                    const double* amax, math::ScaleHyper h) {
  float s = *scale;
  int32_t g = *growth_tracker;
  int32_t hy = *hysteresis_tracker;
  math::update_scale(s, g, hy, *found_inf != 0.f, h, amax != nullptr ? *amax : -1.0);
  *scale = s;
  *growth_tracker = g;
  *hysteresis_tracker = hy;
}

}  // namespace

void update_scale(const ops::UpdateScale& op, const math::ScaleHyper& h) {
  update_scale_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      op.scale.data_ptr<float>(), op.growth_tracker.data_ptr<int32_t>(),
      op.hysteresis_tracker.data_ptr<int32_t>(), op.found_inf.const_data_ptr<float>(),
      input_or_null<double>(op.amax), h);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// What an optimizer records after a step (account_step_) as a one-thread kernel, so the
// step's flag, the counters and the gradient norm never leave the device: one launch where the
// same bookkeeping took six (eq, ne, add, copy, sqrt and mul from the engine).
namespace {

__global__ void account_step_kernel(float* step_applied, int64_t* skipped_steps,
                                    const float* found_inf, float* found_inf_out,
                                    const float* grad_sum_sq, const float* inv_scale,
                                    float* grad_norm) {
  // Every input is read before anything is written: found_inf_out may be found_inf itself.
  const float found = found_inf != nullptr ? *found_inf : 0.f;
  const float norm = grad_norm != nullptr
                         ? math::unscaled_grad_norm(*grad_sum_sq,
                                                    inv_scale != nullptr ? *inv_scale : 1.f)
                         : 0.f;
  *step_applied = math::step_applied(found);
  *skipped_steps += math::steps_skipped(found);
  if (found_inf_out != nullptr) {
    *found_inf_out = found;
  }
  if (grad_norm != nullptr) {
    *grad_norm = norm;
  }
}

}  // namespace

void account_step(const ops::AccountStep& op) {
  account_step_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      op.step_applied.data_ptr<float>(), op.skipped_steps.data_ptr<int64_t>(),
      input_or_null<float>(op.found_inf), output_or_null<float>(op.found_inf_out),
      input_or_null<float>(op.grad_sum_sq), input_or_null<float>(op.inv_scale),
      output_or_null<float>(op.grad_norm));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// A loss scaler's telemetry record of one iteration (record_telemetry_) as a one-thread
// kernel: one launch where the record took three copy kernels (and the pass's sum an add).
namespace {

__global__ void record_telemetry_kernel(double* ring, int64_t rows, int64_t* position,
                                        const float* scale, const float* found_inf,
                                        const double* measured, const float* pass_sum_sq) {
  const int64_t p = *position;
  math::write_telemetry_row(ring + math::telemetry_row(p, rows) * math::kTelemetryColumns,
                            *scale, *found_inf, measured, pass_sum_sq);
  *position = p + 1;
}

}  // namespace

void record_telemetry(const ops::RecordTelemetry& op) {
  record_telemetry_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
      op.ring.data_ptr<double>(), op.ring.size(0), op.position.data_ptr<int64_t>(),
      op.scale.const_data_ptr<float>(), op.found_inf.const_data_ptr<float>(),
      op.measured.const_data_ptr<double>(), input_or_null<float>(op.pass_sum_sq));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The per-tensor step counts of adam_step_ / sgd_step_ advance after the step kernel
// (which read them for the bias corrections and SGD's first step) and only if the step was
// not skipped. Memory traffic: one FP32 read-modify-write per tensor.
// atomicAdd: a caller may pass the same step tensor for several parameters; the CPU backend
// then adds 1 once per entry, and so does this kernel (the sum is exact below 2^24).
namespace {

__global__ void __launch_bounds__(kThreads)
    advance_steps_kernel(const __grid_constant__ PtrBatch b, const float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.f) {
    return;
  }
  for (int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); i < b.n;
       i += static_cast<int>(gridDim.x * blockDim.x)) {
    atomicAdd(b.ptr[i], 1.f);
  }
}

}  // namespace

void advance_steps(at::TensorList steps, const float* found_inf) {
  const auto stream = c10::cuda::getCurrentCUDAStream();
  PtrBatch b;
  for (size_t first = 0; first < steps.size(); first += PtrBatch::kMax) {
    const size_t n = std::min<size_t>(PtrBatch::kMax, steps.size() - first);
    for (size_t i = 0; i < n; ++i) {
      b.ptr[i] = steps[first + i].data_ptr<float>();
    }
    b.n = static_cast<int32_t>(n);
    const unsigned blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
    advance_steps_kernel<<<blocks, kThreads, 0, stream>>>(b, found_inf);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace fusedamp::cuda
