// Kernels that only validate: the Meta kernels, and the CompositeExplicitAutograd fallback.
//
// Meta: the ops mutate their inputs in place and return nothing, so shape propagation
// (torch.compile, export, FakeTensor) needs only the argument checks.
//
// Fallback: reached when no backend kernel matches — a call with nothing but empty lists
// (no tensor for the dispatcher to choose a device by; DESIGN.md promises a no-op), sparse
// tensors, or a device without fusedamp kernels. It runs the same checks, so sparse input
// gets the same clear message as everywhere, and refuses real work it cannot do.
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "../ops/kernel_entry.h"

namespace fusedamp::meta {
namespace {

enum class Mode { kMeta, kFallback };

// What is left to do once kernel_entry.h has checked the arguments: nothing for Meta; for the
// fallback, refuse any real work (the step ops come here only with non-empty lists).
template <Mode mode>
struct CheckOnlyOps {
  static void refuse_work(const char* op, at::TensorList tensors) {
    if constexpr (mode == Mode::kFallback) {
      TORCH_CHECK(tensors.empty(), op, ": no kernel for tensors on ", tensors[0].device(),
                  " (fusedamp has CPU, CUDA and Meta kernels)");
    }
  }

  static void unscale_and_check(const ops::UnscaleAndCheck& op) {
    refuse_work(op.kName, op.grads);
  }
  static void grad_stats(const ops::GradStats& op) {
    refuse_work(op.kName, op.grads);
  }
  static void update_scale(const ops::UpdateScale& op) {
    refuse_work(op.kName, op.scale);
  }
  static void record_telemetry(const ops::RecordTelemetry& op) {
    refuse_work(op.kName, op.ring);
  }
  static void account_step(const ops::AccountStep& op) {
    refuse_work(op.kName, op.step_applied);
  }
  template <typename Algorithm>
  static void step(const Step<typename Algorithm::Hyper>& step) {
    refuse_work(step.op, step.params);
  }
};

}  // namespace
}  // namespace fusedamp::meta

TORCH_LIBRARY_IMPL(fusedamp, Meta, m) {
  fusedamp::kernels::implement_ops<fusedamp::meta::CheckOnlyOps<fusedamp::meta::Mode::kMeta>>(m);
}

TORCH_LIBRARY_IMPL(fusedamp, CompositeExplicitAutograd, m) {
  fusedamp::kernels::implement_ops<
      fusedamp::meta::CheckOnlyOps<fusedamp::meta::Mode::kFallback>>(m);
}
