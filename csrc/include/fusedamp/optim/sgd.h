#pragma once
// fusedamp::optim::SGD: torch.optim.SGD (momentum, dampening, Nesterov, L2 weight decay) with
// FP32 master weights for FP16/BF16 parameters, one fused sgd_step_ per bucket.
#include <fusedamp/optim/optimizer_of.h>
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

// Option names beyond the shared ones (optimizer.h): momentum, dampening, nesterov.
class SGD : public OptimizerOf<SGDOptions> {
 public:
  explicit SGD(const std::vector<torch::optim::OptimizerParamGroup>& groups,
               SGDOptions defaults = {});
  explicit SGD(std::vector<at::Tensor> params, SGDOptions defaults = {});

 protected:
  const char* kind() const override { return "SGD"; }
  StateSlots known_slots() const override;
  bool set_algorithm_option(SGDOptions& o, const std::string& name, double v) const override;
  std::optional<double> algorithm_option(const SGDOptions& o,
                                         const std::string& name) const override;
  void check_algorithm(const SGDOptions& o, size_t group) const override;
  StateSlots slots_for(const SGDOptions& o) const override;
  void run(const detail::Bucket& b, const SGDOptions& o,
           const ops::StepScalars& s) const override;
};

}  // namespace fusedamp::optim
