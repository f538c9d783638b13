#pragma once
// fusedamp::optim::SGD: torch.optim.SGD (momentum, dampening, Nesterov, L2 weight decay) with
// FP32 master weights for FP16/BF16 parameters, one fused sgd_step_ per bucket.
#include <fusedamp/optim/optimizer.h>
#include <fusedamp/optim/options.h>

namespace fusedamp::optim {

struct SGDOptions : public torch::optim::OptimizerCloneableOptions<SGDOptions> {
  SGDOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor): as torch::optim
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, momentum) = 0.0;
  TORCH_ARG(double, dampening) = 0.0;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, nesterov) = false;
  TORCH_ARG(bool, maximize) = false;
  FUSEDAMP_ENGINE_OPTION_FIELDS;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr_; }
  void set_lr(const double lr) override { lr_ = lr; }
};

class SGD : public Optimizer {
 public:
  explicit SGD(const std::vector<torch::optim::OptimizerParamGroup>& groups,
               SGDOptions defaults = {});
  explicit SGD(std::vector<at::Tensor> params, SGDOptions defaults = {});

  SGDOptions& group_options(size_t group);
  const SGDOptions& group_options(size_t group) const;

  // names: lr, momentum, dampening, weight_decay, max_grad_norm (<= 0: off),
  // and as 0/1: nesterov, maximize, master_weights, skip_nonfinite
  void set_group_option(size_t group, const std::string& name, double value) override;
  double group_option(size_t group, const std::string& name) const override;
  void set_group_lr_tensor(size_t group, const at::Tensor& lr) override;

 protected:
  const char* kind() const override { return "SGD"; }
  EngineGroupOptions engine_options(const torch::optim::OptimizerOptions& o) const override;
  void check_options(const torch::optim::OptimizerOptions& o, size_t group) const override;
  std::pair<const char*, const char*> slot_names() const override;
  int slots_needed(const torch::optim::OptimizerOptions& o) const override;
  void run_step(const Bucket& b, const torch::optim::OptimizerOptions& o,
                const ops::StepScalars& s) override;
  std::unique_ptr<torch::optim::OptimizerOptions> make_options() const override;
};

}  // namespace fusedamp::optim
