// CPU implementations of the fusedamp operators: validate, read the device scalars (on the CPU
// they are plain memory), run the vectorised kernel for this CPU, then update the step counts.
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <fusedamp/math/clip_math.h>
#include <fusedamp/math/scale_math.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>

#include "../op_checks.h"
#include "cpu_kernels.h"

namespace fusedamp::cpu {

const KernelTable& kernels() {
  static const KernelTable table = [] {
    // at::get_cpu_capability() already honours ATEN_CPU_CAPABILITY.
    const std::string cap = at::get_cpu_capability();
#if defined(FUSEDAMP_HAVE_AVX512)
    if (cap == "AVX512") {
      return KernelTable{AVX512::unscale_and_check, AVX512::grad_stats, AVX512::adam,
                         AVX512::sgd};
    }
#endif
#if defined(FUSEDAMP_HAVE_AVX2)
    if (cap == "AVX512" || cap == "AVX2") {
      return KernelTable{AVX2::unscale_and_check, AVX2::grad_stats, AVX2::adam, AVX2::sgd};
    }
#endif
    return KernelTable{DEFAULT::unscale_and_check, DEFAULT::grad_stats, DEFAULT::adam,
                       DEFAULT::sgd};
  }();
  return table;
}

namespace {

using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;

float read(const OptTensor& t, float fallback) {
  return (t && t->defined()) ? *t->const_data_ptr<float>() : fallback;
}

void unscale_and_check_cpu(TensorList grads, const Tensor& found_inf, const Tensor& inv_scale) {
  checks::unscale_and_check("fusedamp::unscale_and_check_", grads, found_inf, inv_scale);
  if (kernels().unscale_and_check(grads, *inv_scale.const_data_ptr<float>())) {
    *found_inf.data_ptr<float>() = 1.f;
  }
}

void grad_stats_cpu(TensorList grads, const Tensor& found_inf, const Tensor& sum_sq,
                    const OptTensor& tensor_flags) {
  checks::grad_stats("fusedamp::grad_stats_", grads, found_inf, sum_sq, tensor_flags);
  const bool want_flags = tensor_flags && tensor_flags->defined();
  std::vector<char> flags(want_flags ? grads.size() : 0, 0);
  double sq = 0.0;
  const bool any = kernels().grad_stats(grads, &sq, want_flags ? &flags : nullptr);
  *sum_sq.data_ptr<float>() += static_cast<float>(sq);
  if (any) {
    *found_inf.data_ptr<float>() = 1.f;
  }
  if (want_flags) {
    float* f = tensor_flags->data_ptr<float>();
    for (size_t i = 0; i < flags.size(); ++i) {
      if (flags[i]) {
        f[i] = 1.f;
      }
    }
  }
}

void update_scale_cpu(const Tensor& scale, const Tensor& growth_tracker,
                      const Tensor& hysteresis_tracker, const Tensor& found_inf,
                      double growth_factor, double backoff_factor, int64_t growth_interval,
                      int64_t hysteresis, std::optional<double> min_scale,
                      std::optional<double> max_scale) {
  checks::update_scale("fusedamp::update_scale_", scale, growth_tracker, hysteresis_tracker,
                       found_inf, growth_factor, backoff_factor, growth_interval, hysteresis,
                       min_scale, max_scale);
  math::ScaleHyper<double> h{growth_factor,
                             backoff_factor,
                             static_cast<int32_t>(growth_interval),
                             static_cast<int32_t>(hysteresis),
                             static_cast<float>(min_scale.value_or(0.0)),
                             static_cast<float>(max_scale.value_or(0.0))};
  math::update_scale(*scale.data_ptr<float>(), *growth_tracker.data_ptr<int32_t>(),
                     *hysteresis_tracker.data_ptr<int32_t>(),
                     *found_inf.const_data_ptr<float>() != 0.f, h);
}

// The step counts: read before the kernel, advanced after it. The kernel itself only reads
// the "before" values, so an exception in between leaves them untouched. Each step tensor's
// pointer is looked up once for both.
struct StepCounts {
  std::vector<float*> ptr;
  std::vector<float> before;

  explicit StepCounts(TensorList steps) : ptr(steps.size()), before(steps.size()) {
    for (size_t i = 0; i < steps.size(); ++i) {
      ptr[i] = steps[i].data_ptr<float>();
      before[i] = *ptr[i];
    }
  }
  void advance() const {
    for (float* p : ptr) {
      *p += 1.f;
    }
  }
};

void adam_step_cpu(TensorList params, TensorList master_params, TensorList grads,
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
  if (read(found_inf, 0.f) != 0.f) {
    return;  // skipped step: nothing changes
  }
  const float lr_now = lr_tensor && lr_tensor->defined() ? read(lr_tensor, 0.f)
                                                         : static_cast<float>(lr);
  TORCH_CHECK(lr_now >= 0.f && lr_now - lr_now == 0.f, op, ": lr_tensor holds an invalid lr ",
              lr_now);
  const float mult = math::grad_multiplier(read(inv_scale, 1.f), read(grad_sum_sq, 0.f),
                                           static_cast<float>(max_grad_norm.value_or(0.0)));
  const auto h = math::make_adam_hyper(lr, beta1, beta2, eps, weight_decay,
                                       decoupled_weight_decay, maximize);
  const StepCounts counts(steps);
  kernels().adam(params, master_params, grads, exp_avgs, exp_avg_sqs, counts.before.data(), h,
                 lr_now, mult);
  counts.advance();
}

void sgd_step_cpu(TensorList params, TensorList master_params, TensorList grads,
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
  if (read(found_inf, 0.f) != 0.f) {
    return;
  }
  const float lr_now = lr_tensor && lr_tensor->defined() ? read(lr_tensor, 0.f)
                                                         : static_cast<float>(lr);
  TORCH_CHECK(lr_now >= 0.f && lr_now - lr_now == 0.f, op, ": lr_tensor holds an invalid lr ",
              lr_now);
  const float mult = math::grad_multiplier(read(inv_scale, 1.f), read(grad_sum_sq, 0.f),
                                           static_cast<float>(max_grad_norm.value_or(0.0)));
  const auto h = math::make_sgd_hyper(lr, momentum, dampening, weight_decay, nesterov, maximize);
  const StepCounts counts(steps);
  kernels().sgd(params, master_params, grads, momentum_buffers, counts.before.data(), h, lr_now,
                mult);
  counts.advance();
}

}  // namespace
}  // namespace fusedamp::cpu

TORCH_LIBRARY_IMPL(fusedamp, CPU, m) {
  using namespace fusedamp::cpu;
  m.impl("unscale_and_check_", &unscale_and_check_cpu);
  m.impl("grad_stats_", &grad_stats_cpu);
  m.impl("update_scale_", &update_scale_cpu);
  m.impl("adam_step_", &adam_step_cpu);
  m.impl("sgd_step_", &sgd_step_cpu);
}
