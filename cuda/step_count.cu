// CUDA: the per-tensor step counts of adam_step_ / sgd_step_ advance after the step kernel
// (which read them for the bias corrections and SGD's first step) and only if the step was
// not skipped. Memory traffic: one FP32 read-modify-write per tensor.
// atomicAdd: a caller may pass the same step tensor for several parameters; the CPU backend
// then adds 1 once per entry, and so does this kernel (the sum is exact below 2^24).
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>

#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"

namespace fusedamp::cuda {
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
  const auto stream = at::cuda::getCurrentCUDAStream();
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
