#pragma once
// fusedamp::optim::SGD: torch.optim.SGD (momentum, dampening, Nesterov, L2 weight decay) with
// FP32 master weights for FP16/BF16 parameters, one fused sgd_step_ per bucket.
#include <fusedamp/optim/optimizer_of.h>
#include <fusedamp/optim/options.h>

namespace fusedamp::optim {

struct SGDOptions : public torch::optim::OptimizerCloneableOptions<SGDOptions> {
  FUSEDAMP_LR_OPTION(SGDOptions, 1e-3);
  TORCH_ARG(double, momentum) = 0.0;
  TORCH_ARG(double, dampening) = 0.0;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, nesterov) = false;
  TORCH_ARG(bool, maximize) = false;
  FUSEDAMP_ENGINE_OPTION_FIELDS;
  FUSEDAMP_OPTIONS_OVERRIDES
};

// Option names beyond the shared ones (optimizer.h): momentum, dampening, nesterov.
FUSEDAMP_OPTIMIZER_KIND(SGD, SGDOptions)

}  // namespace fusedamp::optim
