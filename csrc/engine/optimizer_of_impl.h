#pragma once
// The members of OptimizerOf<Options> (include/fusedamp/optim/optimizer_of.h). An algorithm's
// .cpp file specialises AlgorithmOf<Options> and then instantiates OptimizerOf<Options> once:
//   template <> struct AlgorithmOf<MyOptions> {
//     static constexpr const char* kName = "My";               // messages, checkpoints
//     static StateSlots known_slots();                         // what its state dicts hold
//     static StateSlots slots_for(const MyOptions&);           // what a step needs
//     static constexpr detail::OptionRow<MyOptions> kOptions[] = {...};  // its own options
//     static void check(const MyOptions&, size_t group);       // c10::ValueError if invalid
//     static ops::MyStep args(const Bucket&, const MyOptions&,  // its fused op's arguments
//                             const ops::StepShared&);
//   };
//   FUSEDAMP_OPTIONS_SERIALIZED_BY_TABLE(MyOptions)              // serialize() from the rows
//   template class OptimizerOf<MyOptions>;
// kOptions are rows of option_table.h; the options every kind shares are shared_options.h's.
#include <fusedamp/optim/optimizer_of.h>

#include <c10/util/Exception.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bucket_plan.h"
#include "option_checks.h"
#include "option_table.h"
#include "shared_options.h"
#include "step_call.h"

namespace fusedamp::optim {

template <typename Options>
struct AlgorithmOf;

namespace detail {
template <typename Options>
Options& as(torch::optim::OptimizerOptions& o) {
  return static_cast<Options&>(o);
}
template <typename Options>
const Options& as(const torch::optim::OptimizerOptions& o) {
  return static_cast<const Options&>(o);
}
}  // namespace detail

template <typename Options>
OptimizerOf<Options>::OptimizerOf(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                  Options defaults)
    : Optimizer(groups, std::make_unique<Options>(std::move(defaults))) {
  check_options();
}

template <typename Options>
OptimizerOf<Options>::OptimizerOf(std::vector<at::Tensor> params, Options defaults)
    : OptimizerOf({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

template <typename Options>
Options& OptimizerOf<Options>::group_options(size_t group) {
  return detail::as<Options>(checked_group(group));
}

template <typename Options>
const Options& OptimizerOf<Options>::group_options(size_t group) const {
  return detail::as<Options>(checked_group(group));
}

template <typename Options>
const char* OptimizerOf<Options>::kind() const {
  return AlgorithmOf<Options>::kName;
}

template <typename Options>
EngineGroupOptions OptimizerOf<Options>::engine_options(
    const torch::optim::OptimizerOptions& base) const {
  const auto& o = detail::as<Options>(base);
  EngineGroupOptions e;
  e.master_weights = o.master_weights();
  e.state_dtype = o.state_dtype();
  e.rounding_seed = o.rounding_seed();
  e.max_grad_norm = o.max_grad_norm();
  e.skip_nonfinite = o.skip_nonfinite();
  e.lr_tensor = o.lr_tensor();
  e.adopt_param_edits = o.adopt_param_edits();
  e.write_back_grads = o.write_back_grads();
  return e;
}

template <typename Options>
void OptimizerOf<Options>::check_group(const torch::optim::OptimizerOptions& base,
                                       size_t group) const {
  const auto* o = dynamic_cast<const Options*>(&base);
  TORCH_CHECK_VALUE(o != nullptr, "fusedamp::optim::", kind(), ": param group ", group,
                    " holds the options of another optimizer");
  detail::check_common_options(kind(), o->lr(), o->weight_decay(), engine_options(*o), group);
  AlgorithmOf<Options>::check(*o, group);
}

template <typename Options>
StateSlots OptimizerOf<Options>::known_slots() const {
  return AlgorithmOf<Options>::known_slots();
}

template <typename Options>
StateSlots OptimizerOf<Options>::slots_needed(const torch::optim::OptimizerOptions& o) const {
  return AlgorithmOf<Options>::slots_for(detail::as<Options>(o));
}

template <typename Options>
bool OptimizerOf<Options>::set_own_option(torch::optim::OptimizerOptions& base,
                                          const std::string& name, double value) const {
  auto& o = detail::as<Options>(base);
  return detail::set_table_option(detail::SharedOptions<Options>::kRows, o, name, value) ||
         detail::set_table_option(AlgorithmOf<Options>::kOptions, o, name, value);
}

template <typename Options>
std::optional<double> OptimizerOf<Options>::own_option(const torch::optim::OptimizerOptions& base,
                                                       const std::string& name) const {
  const auto& o = detail::as<Options>(base);
  if (auto v = detail::table_option(detail::SharedOptions<Options>::kRows, o, name)) {
    return v;
  }
  return detail::table_option(AlgorithmOf<Options>::kOptions, o, name);
}

template <typename Options>
std::vector<OptionValue> OptimizerOf<Options>::option_values(
    const torch::optim::OptimizerOptions& base) const {
  const auto& o = detail::as<Options>(base);
  std::vector<OptionValue> out;
  detail::append_table_values(detail::SharedOptions<Options>::kRows, o, out);
  detail::append_table_values(AlgorithmOf<Options>::kOptions, o, out);
  return out;
}

template <typename Options>
void OptimizerOf<Options>::set_lr_tensor(torch::optim::OptimizerOptions& o,
                                         const at::Tensor& lr) const {
  detail::as<Options>(o).lr_tensor(lr);
}

template <typename Options>
bool OptimizerOf<Options>::clear_own_option(torch::optim::OptimizerOptions& base,
                                            const std::string& name) const {
  auto& o = detail::as<Options>(base);
  return detail::clear_table_option(detail::SharedOptions<Options>::kRows, o, name) ||
         detail::clear_table_option(AlgorithmOf<Options>::kOptions, o, name);
}

template <typename Options>
std::unique_ptr<torch::optim::OptimizerOptions> OptimizerOf<Options>::make_options() const {
  return std::make_unique<Options>();
}

template <typename Options>
void OptimizerOf<Options>::run_bucket(const detail::Bucket& b,
                                      const torch::optim::OptimizerOptions& o,
                                      const ops::StepShared& in) const {
  detail::call_step(AlgorithmOf<Options>::args(b, detail::as<Options>(o), in), b);
}

template <typename Options>
StepLists OptimizerOf<Options>::row_lists(const detail::Bucket& b,
                                          const torch::optim::OptimizerOptions& o) const {
  return step_of(AlgorithmOf<Options>::args(b, detail::as<Options>(o), ops::StepShared()));
}

}  // namespace fusedamp::optim

// Options::serialize: the options every kind carries (shared_options.h), then the algorithm's
// rows (AlgorithmOf<Options>::kOptions), after its specialisation.
#define FUSEDAMP_OPTIONS_SERIALIZED_BY_TABLE(Options)                             \
  void Options::serialize(torch::serialize::OutputArchive& a) const {            \
    detail::write_table_options(detail::SharedOptions<Options>::kRows, *this, a); \
    detail::write_table_options(AlgorithmOf<Options>::kOptions, *this, a);        \
  }                                                                               \
  void Options::serialize(torch::serialize::InputArchive& a) {                    \
    detail::read_table_options(detail::SharedOptions<Options>::kRows, *this, a);  \
    detail::read_table_options(AlgorithmOf<Options>::kOptions, *this, a);         \
  }
