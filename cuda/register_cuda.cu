// CUDA implementations of the fusedamp operators: after the checks every backend shares
// (op_prelude.h, before anything is touched), select the tensors' device and enqueue the
// kernels on the current stream. No value ever comes back to the host (no .item(), no D2H
// copy, no synchronisation), so every op can be captured in a CUDA graph; the device scalars
// (found_inf, inv_scale, lr_tensor, grad_sum_sq, step counts) are read by the kernels
// themselves.
//
// One difference from the CPU backend follows from that: the CPU rejects an lr_tensor holding
// a negative or non-finite value, which on the GPU would need a synchronisation. Here the
// value is used as it is.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../csrc/op_prelude.h"
#include "cuda_kernels.h"

namespace fusedamp::cuda {
namespace {

// What CUDA does once op_prelude.h has checked the arguments: select the tensors' device and
// enqueue the kernels.
struct CudaOps {
  static void unscale_and_check(const prelude::UnscaleAndCheck& op) {
    const c10::cuda::CUDAGuard guard(op.found_inf.device());
    cuda::unscale_and_check(op.grads, op.found_inf, op.inv_scale, op.sum_sq, op.telemetry);
  }

  static void grad_stats(const prelude::GradStats& op) {
    const c10::cuda::CUDAGuard guard(op.found_inf.device());
    cuda::grad_stats(op.grads, op.found_inf, op.sum_sq, op.tensor_flags, op.telemetry);
  }

  static void update_scale(const prelude::UpdateScale& op) {
    const c10::cuda::CUDAGuard guard(op.scale.device());
    cuda::update_scale(op.scale, op.growth_tracker, op.hysteresis_tracker, op.found_inf, op.amax,
                       op.hyper(), op.scale_history, op.scale_history_slot);
  }

  static void record_telemetry(const prelude::RecordTelemetry& op) {
    const c10::cuda::CUDAGuard guard(op.ring.device());
    cuda::record_telemetry(op.ring, op.slot, op.scale, op.found_inf, op.measured,
                           op.pass_sum_sq);
  }

  static void account_step(const prelude::AccountStep& op) {
    const c10::cuda::CUDAGuard guard(op.step_applied.device());
    cuda::account_step(op.step_applied, op.skipped_steps, op.found_inf, op.found_inf_out,
                       op.grad_sum_sq, op.inv_scale, op.grad_norms, op.grad_norm_slot);
  }

  static void adam_step(const prelude::AdamStep& step) {
    const c10::cuda::CUDAGuard guard(step.params[0].device());
    adam(step.params, step.master_params, step.grads, step.exp_avgs, step.exp_avg_sqs,
         step.max_exp_avg_sqs, step.steps, step.rounding_seeds, step.hyper,
         step.scalars.pointers(), step.weight_store(), step.write_back_grads);
  }

  static void sgd_step(const prelude::SgdStep& step) {
    const c10::cuda::CUDAGuard guard(step.params[0].device());
    sgd(step.params, step.master_params, step.grads, step.momentum_buffers, step.steps,
        step.hyper, step.rounding_seeds, step.scalars.pointers(), step.weight_store(),
        step.write_back_grads);
  }
};

}  // namespace
}  // namespace fusedamp::cuda

TORCH_LIBRARY_IMPL(fusedamp, CUDA, m) {
  fusedamp::prelude::implement_ops<fusedamp::cuda::CudaOps>(m);
}
