// CUDA implementations of the fusedamp operators: validate (the checks every backend shares,
// before anything is touched), select the tensors' device, enqueue the kernels on the current
// stream. No value ever comes back to the host (no .item(), no D2H copy, no synchronisation),
// so every op can be captured in a CUDA graph; the device scalars (found_inf, inv_scale,
// lr_tensor, grad_sum_sq, step counts) are read by the kernels themselves.
//
// One difference from the CPU backend follows from that: the CPU rejects an lr_tensor holding
// a negative or non-finite value, which on the GPU would need a synchronisation. Here the
// value is used as it is.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <fusedamp/math/adam_math.h>
#include <fusedamp/math/scale_math.h>
#include <fusedamp/math/sgd_math.h>
#include <torch/library.h>

#include "../csrc/op_checks.h"
#include "cuda_kernels.h"

namespace fusedamp::cuda {
namespace {

using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;

const float* ptr_or_null(const OptTensor& t) {
  return t && t->defined() ? t->const_data_ptr<float>() : nullptr;
}

StepScalars step_scalars(double lr, const OptTensor& lr_tensor, const OptTensor& inv_scale,
                         const OptTensor& found_inf, const OptTensor& grad_sum_sq,
                         std::optional<double> max_grad_norm) {
  StepScalars s;
  s.lr = ptr_or_null(lr_tensor);
  s.inv_scale = ptr_or_null(inv_scale);
  s.found_inf = ptr_or_null(found_inf);
  s.grad_sum_sq = ptr_or_null(grad_sum_sq);
  s.max_grad_norm = static_cast<float>(max_grad_norm.value_or(0.0));
  s.lr_host = static_cast<float>(lr);
  return s;
}

void unscale_and_check_cuda(TensorList grads, const Tensor& found_inf, const Tensor& inv_scale) {
  checks::unscale_and_check("fusedamp::unscale_and_check_", grads, found_inf, inv_scale);
  const c10::cuda::CUDAGuard guard(found_inf.device());
  unscale_and_check(grads, found_inf, inv_scale);
}

void grad_stats_cuda(TensorList grads, const Tensor& found_inf, const Tensor& sum_sq,
                     const OptTensor& tensor_flags) {
  checks::grad_stats("fusedamp::grad_stats_", grads, found_inf, sum_sq, tensor_flags);
  const c10::cuda::CUDAGuard guard(found_inf.device());
  grad_stats(grads, found_inf, sum_sq, tensor_flags);
}

void update_scale_cuda(const Tensor& scale, const Tensor& growth_tracker,
                       const Tensor& hysteresis_tracker, const Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval,
                       int64_t hysteresis, std::optional<double> min_scale,
                       std::optional<double> max_scale) {
  checks::update_scale("fusedamp::update_scale_", scale, growth_tracker, hysteresis_tracker,
                       found_inf, growth_factor, backoff_factor, growth_interval, hysteresis,
                       min_scale, max_scale);
  const c10::cuda::CUDAGuard guard(scale.device());
  // FP32 factors, as torch's CUDA _amp_update_scale_ uses.
  const math::ScaleHyper<float> h{static_cast<float>(growth_factor),
                                  static_cast<float>(backoff_factor),
                                  static_cast<int32_t>(growth_interval),
                                  static_cast<int32_t>(hysteresis),
                                  static_cast<float>(min_scale.value_or(0.0)),
                                  static_cast<float>(max_scale.value_or(0.0))};
  update_scale(scale, growth_tracker, hysteresis_tracker, found_inf, h);
}

void adam_step_cuda(TensorList params, TensorList master_params, TensorList grads,
                    TensorList exp_avgs, TensorList exp_avg_sqs, TensorList steps, double lr,
                    double beta1, double beta2, double eps, double weight_decay,
                    bool decoupled_weight_decay, bool maximize, const OptTensor& lr_tensor,
                    const OptTensor& inv_scale, const OptTensor& found_inf,
                    const OptTensor& grad_sum_sq, std::optional<double> max_grad_norm) {
  const char* op = "fusedamp::adam_step_";
  if (!checks::adam_step(op, params, master_params, grads, exp_avgs, exp_avg_sqs, steps, lr,
                         beta1, beta2, eps, weight_decay, lr_tensor, inv_scale, found_inf,
                         grad_sum_sq, max_grad_norm)) {
    return;
  }
  const c10::cuda::CUDAGuard guard(params[0].device());
  const auto h = math::make_adam_hyper(lr, beta1, beta2, eps, weight_decay,
                                       decoupled_weight_decay, maximize);
  adam(params, master_params, grads, exp_avgs, exp_avg_sqs, steps, h,
       step_scalars(lr, lr_tensor, inv_scale, found_inf, grad_sum_sq, max_grad_norm));
}

void sgd_step_cuda(TensorList params, TensorList master_params, TensorList grads,
                   TensorList momentum_buffers, TensorList steps, double lr, double momentum,
                   double dampening, double weight_decay, bool nesterov, bool maximize,
                   const OptTensor& lr_tensor, const OptTensor& inv_scale,
                   const OptTensor& found_inf, const OptTensor& grad_sum_sq,
                   std::optional<double> max_grad_norm) {
  const char* op = "fusedamp::sgd_step_";
  if (!checks::sgd_step(op, params, master_params, grads, momentum_buffers, steps, lr, momentum,
                        dampening, weight_decay, nesterov, lr_tensor, inv_scale, found_inf,
                        grad_sum_sq, max_grad_norm)) {
    return;
  }
  const c10::cuda::CUDAGuard guard(params[0].device());
  const auto h = math::make_sgd_hyper(lr, momentum, dampening, weight_decay, nesterov, maximize);
  sgd(params, master_params, grads, momentum_buffers, steps, h,
      step_scalars(lr, lr_tensor, inv_scale, found_inf, grad_sum_sq, max_grad_norm));
}

}  // namespace
}  // namespace fusedamp::cuda

TORCH_LIBRARY_IMPL(fusedamp, CUDA, m) {
  using namespace fusedamp::cuda;
  m.impl("unscale_and_check_", &unscale_and_check_cuda);
  m.impl("grad_stats_", &grad_stats_cuda);
  m.impl("update_scale_", &update_scale_cuda);
  m.impl("adam_step_", &adam_step_cuda);
  m.impl("sgd_step_", &sgd_step_cuda);
}
