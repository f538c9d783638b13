// fusedamp::optim::SGD: options, their checks, and the fused sgd_step_ per bucket.
#include <fusedamp/optim/sgd.h>

#include <torch/serialize/archive.h>

#include <fusedamp/ops.h>

#include "bucket_plan.h"
#include "optimizer_of_impl.h"
#include "option_checks.h"
#include "step_call.h"

namespace fusedamp::optim {

template <>
struct AlgorithmOf<SGDOptions> {
  static constexpr const char* kName = "SGD";

  // Its options beyond the shared ones (shared_options.h), as rows of option_table.h.
  static constexpr detail::OptionRow<SGDOptions> kOptions[] = {
      FUSEDAMP_OPTION_ROW(SGDOptions, momentum, OptionForm::kNumber),
      FUSEDAMP_OPTION_ROW(SGDOptions, dampening, OptionForm::kNumber),
      FUSEDAMP_OPTION_ROW(SGDOptions, nesterov, OptionForm::kFlag),
  };

  static StateSlots known_slots() {
    return {StateSlot::kMasterParam, StateSlot::kMomentumBuffer, StateSlot::kMomentumScales};
  }

  static StateSlots slots_for(const SGDOptions& o) {
    if (o.momentum() == 0.0) {
      return {};
    }
    const StateSlots buffer{StateSlot::kMomentumBuffer};
    // int8: the buffer as 8-bit codes, and their block scales
    return o.state_dtype() == at::kChar ? buffer.with(StateSlot::kMomentumScales) : buffer;
  }

  static void check(const SGDOptions& o, size_t group) {
    detail::check_sgd_options(kName, o.momentum(), o.dampening(), o.nesterov(), group);
  }

  static ops::SgdStep args(const detail::Bucket& b, const SGDOptions& o,
                           const ops::StepShared& in) {
    ops::SgdStep a;
    detail::fill_step(a, b, o, in);
    a.momentum_buffers = b.state(StateSlot::kMomentumBuffer);
    if (slots_for(o).has(StateSlot::kMomentumScales)) {
      a.momentum_scales = b.state(StateSlot::kMomentumScales);
    }
    a.momentum = o.momentum();
    a.dampening = o.dampening();
    a.nesterov = o.nesterov();
    return a;
  }
};

FUSEDAMP_OPTIONS_SERIALIZED_BY_TABLE(SGDOptions)
template class OptimizerOf<SGDOptions>;

}  // namespace fusedamp::optim
