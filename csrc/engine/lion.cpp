// fusedamp::optim::Lion: options, their checks, and the fused lion_step_ per bucket.
#include <fusedamp/optim/lion.h>

#include <torch/serialize/archive.h>

#include <fusedamp/ops.h>

#include "bucket_plan.h"
#include "optimizer_of_impl.h"
#include "option_checks.h"
#include "step_call.h"

namespace fusedamp::optim {

template <>
struct AlgorithmOf<LionOptions> {
  static constexpr const char* kName = "Lion";

  // Its options beyond the shared ones (shared_options.h), as rows of option_table.h.
  static constexpr detail::OptionRow<LionOptions> kOptions[] = {
      detail::beta_row<LionOptions, 0>(), detail::beta_row<LionOptions, 1>()};

  static StateSlots known_slots() { return {StateSlot::kMasterParam, StateSlot::kExpAvg}; }

  static StateSlots slots_for(const LionOptions&) { return {StateSlot::kExpAvg}; }

  static void check(const LionOptions& o, size_t group) {
    detail::check_lion_options(kName, std::get<0>(o.betas()), std::get<1>(o.betas()),
                               o.state_dtype(), group);
  }

  static ops::LionStep args(const detail::Bucket& b, const LionOptions& o,
                            const ops::StepShared& in) {
    ops::LionStep a;
    detail::fill_step(a, b, o, in);
    a.exp_avgs = b.state(StateSlot::kExpAvg);
    a.beta1 = std::get<0>(o.betas());
    a.beta2 = std::get<1>(o.betas());
    return a;
  }
};

FUSEDAMP_OPTIONS_SERIALIZED_BY_TABLE(LionOptions)
template class OptimizerOf<LionOptions>;

}  // namespace fusedamp::optim
