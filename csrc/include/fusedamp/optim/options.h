#pragma once
// Fields every fusedamp optimizer's options carry, on top of the algorithm's own
// hyper-parameters (declared with TORCH_ARG, so they chain like torch::optim's options):
//   master_weights  keep an FP32 master copy of FP16/BF16 parameters (default true)
//   max_grad_norm   clip the global gradient norm (all groups' grads) to this value, fused
//                   into the step (clip_grad_norm_'s formula); nullopt: no clipping
//   skip_nonfinite  without a loss scaler, skip the step when a gradient holds inf/NaN
//                   (with a scaler every step is checked anyway)
//   lr_tensor       an FP32 one-element device tensor that overrides lr (CUDA-graph friendly)
//   adopt_param_edits  masters follow edits of the model's weights: where a weight is no longer
//                   its master's rounding, the step starts from the weight (default true;
//                   +2 B/param read at FP16)
//   write_back_grads   after a scaled or clipped step, .grad holds the gradient the update used
//                   (unscaled, clipped), as torch's fused optimizers leave it (default true;
//                   +2 B/param written at FP16)
#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <optional>

#define FUSEDAMP_ENGINE_OPTION_FIELDS                            \
  TORCH_ARG(bool, master_weights) = true;                        \
  TORCH_ARG(std::optional<double>, max_grad_norm) = std::nullopt; \
  TORCH_ARG(bool, skip_nonfinite) = true;                        \
  TORCH_ARG(bool, adopt_param_edits) = true;                     \
  TORCH_ARG(bool, write_back_grads) = true;                      \
  TORCH_ARG(at::Tensor, lr_tensor)

// The torch::optim::OptimizerOptions overrides every fusedamp options struct has (the struct
// names its learning rate lr_; serialize() is defined next to the algorithm).
#define FUSEDAMP_OPTIONS_OVERRIDES                                                 \
 public:                                                                          \
  void serialize(torch::serialize::InputArchive& archive) override;              \
  void serialize(torch::serialize::OutputArchive& archive) const override;       \
  double get_lr() const override {                                                \
    return lr_;                                                                   \
  }                                                                               \
  void set_lr(const double lr) override {                                         \
    lr_ = lr;                                                                     \
  }
