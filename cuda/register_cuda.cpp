// CUDA implementations of the fusedamp operators: after the checks every backend shares
// (ops/kernel_entry.h, before anything is touched), select the tensors' device and enqueue the
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

#include "../csrc/ops/kernel_entry.h"
#include "../csrc/ops/sparse_rows_args.h"
#include "cuda_kernels.h"

namespace fusedamp::cuda {
namespace {

// What CUDA does once kernel_entry.h has checked the arguments: select the tensors' device and
// enqueue the kernels.
struct CudaOps {
  static void unscale_and_check(const ops::UnscaleAndCheck& op) {
    const c10::cuda::CUDAGuard guard(op.found_inf.device());
    cuda::unscale_and_check(op.grads, op.found_inf, op.inv_scale, op.sum_sq, op.telemetry);
  }

  static void grad_stats(const ops::GradStats& op) {
    const c10::cuda::CUDAGuard guard(op.found_inf.device());
    cuda::grad_stats(op.grads, op.found_inf, op.sum_sq, op.tensor_flags, op.telemetry);
  }

  static void update_scale(const ops::UpdateScale& op) {
    const c10::cuda::CUDAGuard guard(op.scale.device());
    cuda::update_scale(op, kernels::scale_hyper(op));
  }

  static void record_telemetry(const ops::RecordTelemetry& op) {
    const c10::cuda::CUDAGuard guard(op.ring.device());
    cuda::record_telemetry(op);
  }

  static void account_step(const ops::AccountStep& op) {
    const c10::cuda::CUDAGuard guard(op.step_applied.device());
    cuda::account_step(op);
  }

  template <typename Algorithm>
  static void step(const Step<typename Algorithm::Hyper>& step) {
    const c10::cuda::CUDAGuard guard(step.params[0].device());
    cuda::step<Algorithm>(step, step.scalar_pointers());
  }

  // The row-wise sparse steps (ops/sparse_rows_args.h has checked them). An index out of the
  // table's range is found on the device: a device-side assert, where the CPU raises.
  static void sparse_rows_step(const kernels::SparseRowsOp& op) {
    const c10::cuda::CUDAGuard guard(op.table.device());
    cuda::sparse_rows_step(op);
  }
};

}  // namespace
}  // namespace fusedamp::cuda

TORCH_LIBRARY_IMPL(fusedamp, CUDA, m) {
  fusedamp::kernels::implement_ops<fusedamp::cuda::CudaOps>(m);
  fusedamp::kernels::implement_sparse_row_ops<fusedamp::cuda::CudaOps>(m);
}
