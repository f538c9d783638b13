// grad_stats_ for grads the fused kernels do not walk (see op_prelude.h grad_stats_split).
#include <ATen/ATen.h>

#include <vector>

#include "op_prelude.h"

namespace fusedamp::prelude {

void grad_stats_split(void (*fused_stats)(const GradStats&), TensorList grads,
                      const Tensor& found_inf, const Tensor& sum_sq,
                      const OptTensor& tensor_flags) {
  const bool want_flags = tensor_flags.has_value() && tensor_flags->defined();
  std::vector<Tensor> fused;
  std::vector<int64_t> fused_positions;
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor& g = grads[i];
    if (!checks::per_tensor_grad(g)) {
      fused.push_back(g);
      fused_positions.push_back(static_cast<int64_t>(i));
      continue;
    }
    // 1 where g holds inf/NaN, 0-dim FP32: OR-ed in, never reset, into one-element tensors
    // of either shape (found_inf may be 0-dim or [1]; a 0-dim value broadcasts into both).
    const Tensor nonfinite = at::isfinite(g).logical_not().any().to(at::kFloat);
    found_inf.copy_(at::maximum(found_inf, nonfinite));
    sum_sq.add_(g.to(at::kDouble).square().sum().to(at::kFloat));
    if (want_flags) {
      Tensor flag = tensor_flags->narrow(0, static_cast<int64_t>(i), 1);
      flag.copy_(at::maximum(flag, nonfinite));
    }
  }
  if (fused.empty()) {
    return;
  }
  if (!want_flags) {
    fused_stats(GradStats{fused, found_inf, sum_sq, std::nullopt});
    return;
  }
  // The kernel flags by list position: give it a list of its own, then OR each flag back in
  // place (one small op per grad, but no host-to-device copy of positions, which would sync).
  const Tensor fused_flags = at::zeros({static_cast<int64_t>(fused.size())},
                                       tensor_flags->options());
  fused_stats(GradStats{fused, found_inf, sum_sq, fused_flags});
  for (size_t k = 0; k < fused.size(); ++k) {
    Tensor flag = tensor_flags->narrow(0, fused_positions[k], 1);
    flag.copy_(at::maximum(flag, fused_flags.narrow(0, static_cast<int64_t>(k), 1)));
  }
}

}  // namespace fusedamp::prelude
