#pragma once
// fusedamp::optim::Lion: Lion (Chen et al. 2023; math/lion_math.h: the sign of an
// interpolated momentum, decoupled weight decay) on FP32 or BF16 state with the master-weight
// modes of every optimizer, one fused lion_step_ per bucket. torch.optim has no Lion; its
// state dict holds `exp_avg` (and `step`), as lucidrains/lion-pytorch's.
#include <fusedamp/optim/optimizer_of.h>
#include <fusedamp/optim/options.h>

#include <tuple>

namespace fusedamp::optim {

struct LionOptions : public torch::optim::OptimizerCloneableOptions<LionOptions> {
  FUSEDAMP_LR_OPTION(LionOptions, 1e-4);
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.99);
  TORCH_ARG(double, weight_decay) = 0.0;  // decoupled: p *= 1 - lr * wd
  TORCH_ARG(bool, maximize) = false;
  FUSEDAMP_ENGINE_OPTION_FIELDS;
  FUSEDAMP_OPTIONS_OVERRIDES
};

// Option names beyond the shared ones (optimizer.h): beta1, beta2. state_dtype int8 is
// refused (Lion's exp_avg has no 8-bit format).
FUSEDAMP_OPTIMIZER_KIND(Lion, LionOptions)

}  // namespace fusedamp::optim
