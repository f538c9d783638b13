// CUDA: what an optimizer records after a step (account_step_) as a one-thread kernel, so the
// step's flag, the counters and the gradient norm never leave the device: one launch where the
// same bookkeeping took six (eq, ne, add, copy, sqrt and mul from the engine).
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <fusedamp/math/step_account_math.h>

#include "cuda_kernels.h"

namespace fusedamp::cuda {
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
  account_step_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(
      op.step_applied.data_ptr<float>(), op.skipped_steps.data_ptr<int64_t>(),
      input_or_null<float>(op.found_inf), output_or_null<float>(op.found_inf_out),
      input_or_null<float>(op.grad_sum_sq), input_or_null<float>(op.inv_scale),
      output_or_null<float>(op.grad_norm));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fusedamp::cuda
