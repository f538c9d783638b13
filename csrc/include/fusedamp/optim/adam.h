#pragma once
// fusedamp::optim::Adam and AdamW: torch.optim.Adam/AdamW (no amsgrad) on FP32 state with FP32
// master weights for FP16/BF16 parameters, one fused adam_step_ per bucket.
#include <fusedamp/optim/optimizer_of.h>
#include <fusedamp/optim/options.h>

#include <tuple>

namespace fusedamp::optim {

struct AdamOptions : public torch::optim::OptimizerCloneableOptions<AdamOptions> {
  AdamOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor): as torch::optim
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  // true: AdamW's p *= 1 - lr * wd; false: L2 (g += wd * p).
  TORCH_ARG(bool, decoupled_weight_decay) = false;
  TORCH_ARG(bool, maximize) = false;
  FUSEDAMP_ENGINE_OPTION_FIELDS;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr_; }
  void set_lr(const double lr) override { lr_ = lr; }
};

// AdamW's defaults: weight_decay 1e-2, decoupled.
struct AdamWOptions : public AdamOptions {
  AdamWOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor)
};

// Option names beyond the shared ones (optimizer.h): beta1, beta2, eps.
class Adam : public OptimizerOf<AdamOptions> {
 public:
  explicit Adam(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                AdamOptions defaults = {});
  explicit Adam(std::vector<at::Tensor> params, AdamOptions defaults = {});

 protected:
  const char* kind() const override { return "Adam"; }
  StateSlots known_slots() const override;
  bool set_algorithm_option(AdamOptions& o, const std::string& name, double v) const override;
  std::optional<double> algorithm_option(const AdamOptions& o,
                                         const std::string& name) const override;
  void check_algorithm(const AdamOptions& o, size_t group) const override;
  StateSlots slots_for(const AdamOptions& o) const override;
  void run(const detail::Bucket& b, const AdamOptions& o,
           const ops::StepScalars& s) const override;
};

// Adam with decoupled weight decay: every group's decoupled_weight_decay is forced on.
class AdamW : public Adam {
 public:
  explicit AdamW(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                 AdamOptions defaults = AdamWOptions());
  explicit AdamW(std::vector<at::Tensor> params, AdamOptions defaults = AdamWOptions());
};

}  // namespace fusedamp::optim
