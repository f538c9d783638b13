#pragma once
// OptimizerOf<Options>: what every fusedamp optimizer kind shares, written once — typed access
// to a group's options, the options every kind carries (lr, weight_decay, maximize and the
// engine fields of FUSEDAMP_ENGINE_OPTION_FIELDS), and the engine's hooks. Its members are
// defined in the library (csrc/engine/optimizer_of_impl.h) and instantiated once per kind next
// to that kind's algorithm (csrc/engine/adam.cpp, sgd.cpp), so an algorithm adds only its own:
// its named hyper-parameters, their checks, the state it needs and its fused op.
#include <fusedamp/optim/optimizer.h>
#include <fusedamp/optim/options.h>

namespace fusedamp::optim {

template <typename Options>
class OptimizerOf : public Optimizer {
 public:
  // Options given to a group are checked here: an invalid one is a c10::ValueError.
  explicit OptimizerOf(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                       Options defaults = {});
  explicit OptimizerOf(std::vector<at::Tensor> params, Options defaults = {});

  Options& group_options(size_t group);
  const Options& group_options(size_t group) const;

 private:
  const char* kind() const final;
  EngineGroupOptions engine_options(const torch::optim::OptimizerOptions& o) const final;
  void check_group(const torch::optim::OptimizerOptions& o, size_t group) const final;
  StateSlots known_slots() const final;
  StateSlots slots_needed(const torch::optim::OptimizerOptions& o) const final;
  bool set_own_option(torch::optim::OptimizerOptions& o, const std::string& name,
                      double value) const final;
  std::optional<double> own_option(const torch::optim::OptimizerOptions& o,
                                   const std::string& name) const final;
  std::vector<OptionValue> option_values(const torch::optim::OptimizerOptions& o) const final;
  void set_lr_tensor(torch::optim::OptimizerOptions& o, const at::Tensor& lr) const final;
  bool clear_own_option(torch::optim::OptimizerOptions& o,
                        const std::string& name) const final;
  std::unique_ptr<torch::optim::OptimizerOptions> make_options() const final;
  void run_bucket(const detail::Bucket& b, const torch::optim::OptimizerOptions& o,
                  const ops::StepShared& in) const final;
  StepLists row_lists(const detail::Bucket& b,
                      const torch::optim::OptimizerOptions& o) const final;
};

}  // namespace fusedamp::optim

// An optimizer kind: OptimizerOf<Options> under its own name, instantiated once in the library
// (next to its algorithm, csrc/engine/).
#define FUSEDAMP_OPTIMIZER_KIND(Kind, Options)          \
  extern template class OptimizerOf<Options>;            \
  class Kind : public OptimizerOf<Options> {             \
   public:                                               \
    using OptimizerOf::OptimizerOf;                      \
  };
