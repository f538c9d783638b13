// CUDA: what an optimizer records after a step (account_step_) as a one-thread kernel, so the
// step's flag, the counters and the gradient norm never leave the device: one launch where the
// same bookkeeping took seven (eq, ne, add, copy, sqrt and mul from the engine, and the
// history's indexed copy from Python).
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
                                    float* grad_norm_slot) {
  // Every input is read before anything is written: found_inf_out may be found_inf itself.
  const float found = found_inf != nullptr ? *found_inf : 0.f;
  const float norm = grad_norm_slot != nullptr
                         ? math::unscaled_grad_norm(*grad_sum_sq,
                                                    inv_scale != nullptr ? *inv_scale : 1.f)
                         : 0.f;
  *step_applied = math::step_applied(found);
  *skipped_steps += math::steps_skipped(found);
  if (found_inf_out != nullptr) {
    *found_inf_out = found;
  }
  if (grad_norm_slot != nullptr) {
    *grad_norm_slot = norm;
  }
}

template <typename T>
T* mutable_data(const at::Tensor* t) {
  return t != nullptr ? t->data_ptr<T>() : nullptr;
}

template <typename T>
const T* data(const at::Tensor* t) {
  return t != nullptr ? t->const_data_ptr<T>() : nullptr;
}

}  // namespace

void account_step(const at::Tensor& step_applied, const at::Tensor& skipped_steps,
                  const at::Tensor* found_inf, const at::Tensor* found_inf_out,
                  const at::Tensor* grad_sum_sq, const at::Tensor* inv_scale,
                  const at::Tensor* grad_norms, int64_t grad_norm_slot) {
  float* const norm_out =
      grad_norms != nullptr ? grad_norms->data_ptr<float>() + grad_norm_slot : nullptr;
  account_step_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(
      step_applied.data_ptr<float>(), skipped_steps.data_ptr<int64_t>(), data<float>(found_inf),
      mutable_data<float>(found_inf_out), data<float>(grad_sum_sq), data<float>(inv_scale),
      norm_out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fusedamp::cuda
