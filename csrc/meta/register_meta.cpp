// Kernels that only validate: the Meta kernels, and the CompositeExplicitAutograd fallback.
//
// Meta: the ops mutate their inputs in place and return nothing, so shape propagation
// (torch.compile, export, FakeTensor) needs only the argument checks.
//
// Fallback: reached when no backend kernel matches — a call with nothing but empty lists
// (no tensor for the dispatcher to choose a device by; DESIGN.md promises a no-op), sparse
// tensors, or a device without fusedamp kernels. It runs the same checks, so sparse input
// gets the same clear message as everywhere, and refuses real work it cannot do.
#include <torch/library.h>

#include "../op_checks.h"

namespace fusedamp::meta {
namespace {

using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;

enum class Mode { kMeta, kFallback };

template <Mode mode>
void refuse_work(const char* op, TensorList tensors) {
  if constexpr (mode == Mode::kFallback) {
    TORCH_CHECK(tensors.empty(), op, ": no kernel for tensors on ", tensors[0].device(),
                " (fusedamp has CPU, CUDA and Meta kernels)");
  }
}

template <Mode mode>
void unscale_and_check(TensorList grads, const Tensor& found_inf, const Tensor& inv_scale) {
  const char* op = "fusedamp::unscale_and_check_";
  checks::unscale_and_check(op, grads, found_inf, inv_scale);
  refuse_work<mode>(op, grads);
}

template <Mode mode>
void grad_stats(TensorList grads, const Tensor& found_inf, const Tensor& sum_sq,
                const OptTensor& tensor_flags) {
  const char* op = "fusedamp::grad_stats_";
  checks::grad_stats(op, grads, found_inf, sum_sq, tensor_flags);
  refuse_work<mode>(op, grads);
}

template <Mode mode>
void update_scale(const Tensor& scale, const Tensor& growth_tracker,
                  const Tensor& hysteresis_tracker, const Tensor& found_inf, double growth_factor,
                  double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                  std::optional<double> min_scale, std::optional<double> max_scale) {
  const char* op = "fusedamp::update_scale_";
  checks::update_scale(op, scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor,
                       backoff_factor, growth_interval, hysteresis, min_scale, max_scale);
  refuse_work<mode>(op, scale);
}

template <Mode mode>
void adam_step(TensorList params, TensorList master_params, TensorList grads,
               TensorList exp_avgs, TensorList exp_avg_sqs, TensorList steps, double lr,
               double beta1, double beta2, double eps, double weight_decay, bool, bool,
               const OptTensor& lr_tensor, const OptTensor& inv_scale, const OptTensor& found_inf,
               const OptTensor& grad_sum_sq, std::optional<double> max_grad_norm) {
  const char* op = "fusedamp::adam_step_";
  checks::adam_step(op, params, master_params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1,
                    beta2, eps, weight_decay, lr_tensor, inv_scale, found_inf, grad_sum_sq,
                    max_grad_norm);
  refuse_work<mode>(op, params);
}

template <Mode mode>
void sgd_step(TensorList params, TensorList master_params, TensorList grads,
              TensorList momentum_buffers, TensorList steps, double lr, double momentum,
              double dampening, double weight_decay, bool nesterov, bool,
              const OptTensor& lr_tensor, const OptTensor& inv_scale, const OptTensor& found_inf,
              const OptTensor& grad_sum_sq, std::optional<double> max_grad_norm) {
  const char* op = "fusedamp::sgd_step_";
  checks::sgd_step(op, params, master_params, grads, momentum_buffers, steps, lr, momentum,
                   dampening, weight_decay, nesterov, lr_tensor, inv_scale, found_inf, grad_sum_sq,
                   max_grad_norm);
  refuse_work<mode>(op, params);
}

}  // namespace
}  // namespace fusedamp::meta

#define FUSEDAMP_REGISTER_CHECK_ONLY(m, MODE)                                        \
  m.impl("unscale_and_check_", &fusedamp::meta::unscale_and_check<MODE>);           \
  m.impl("grad_stats_", &fusedamp::meta::grad_stats<MODE>);                         \
  m.impl("update_scale_", &fusedamp::meta::update_scale<MODE>);                     \
  m.impl("adam_step_", &fusedamp::meta::adam_step<MODE>);                           \
  m.impl("sgd_step_", &fusedamp::meta::sgd_step<MODE>)

TORCH_LIBRARY_IMPL(fusedamp, Meta, m) {
  FUSEDAMP_REGISTER_CHECK_ONLY(m, fusedamp::meta::Mode::kMeta);
}

TORCH_LIBRARY_IMPL(fusedamp, CompositeExplicitAutograd, m) {
  FUSEDAMP_REGISTER_CHECK_ONLY(m, fusedamp::meta::Mode::kFallback);
}
