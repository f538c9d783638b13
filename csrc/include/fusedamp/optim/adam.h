#pragma once
// fusedamp::optim::Adam and AdamW: torch.optim.Adam/AdamW (with amsgrad) on FP32 state with
// FP32 master weights for FP16/BF16 parameters, one fused adam_step_ per bucket.
#include <fusedamp/optim/optimizer_of.h>
#include <fusedamp/optim/options.h>

#include <tuple>

namespace fusedamp::optim {

struct AdamOptions : public torch::optim::OptimizerCloneableOptions<AdamOptions> {
  FUSEDAMP_LR_OPTION(AdamOptions, 1e-3);
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  // true: AdamW's p *= 1 - lr * wd; false: L2 (g += wd * p).
  TORCH_ARG(bool, decoupled_weight_decay) = false;
  TORCH_ARG(bool, maximize) = false;
  // true: the denominator uses the running maximum of exp_avg_sq (state max_exp_avg_sq).
  TORCH_ARG(bool, amsgrad) = false;
  FUSEDAMP_ENGINE_OPTION_FIELDS;
  FUSEDAMP_OPTIONS_OVERRIDES
};

// AdamW's defaults: weight_decay 1e-2, decoupled.
struct AdamWOptions : public AdamOptions {
  AdamWOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor)
};

// Option names beyond the shared ones (optimizer.h): beta1, beta2, eps, decoupled_weight_decay,
// amsgrad.
FUSEDAMP_OPTIMIZER_KIND(Adam, AdamOptions)

// Adam with decoupled weight decay: every group's decoupled_weight_decay is forced on.
class AdamW : public Adam {
 public:
  explicit AdamW(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                 AdamOptions defaults = AdamWOptions());
  explicit AdamW(std::vector<at::Tensor> params, AdamOptions defaults = AdamWOptions());
};

}  // namespace fusedamp::optim
