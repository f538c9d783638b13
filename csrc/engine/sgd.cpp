// fusedamp::optim::SGD: options, their checks, and the fused sgd_step_ per bucket.
#include <fusedamp/optim/sgd.h>

#include <torch/serialize/archive.h>

#include <fusedamp/ops.h>

#include "bucket_plan.h"
#include "optimizer_of_impl.h"
#include "option_checks.h"
#include "options_io.h"
#include "step_call.h"

namespace fusedamp::optim {

SGDOptions::SGDOptions(double lr) : lr_(lr) {}

void SGDOptions::serialize(torch::serialize::OutputArchive& a) const {
  detail::write_common_options(*this, a);
  a.write("momentum", c10::IValue(momentum_));
  a.write("dampening", c10::IValue(dampening_));
  a.write("nesterov", c10::IValue(nesterov_));
}

void SGDOptions::serialize(torch::serialize::InputArchive& a) {
  detail::read_common_options(*this, a);
  c10::IValue v;
  a.read("momentum", v);
  momentum_ = v.toDouble();
  a.read("dampening", v);
  dampening_ = v.toDouble();
  a.read("nesterov", v);
  nesterov_ = v.toBool();
}

template <>
struct AlgorithmOf<SGDOptions> {
  static constexpr const char* kName = "SGD";

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

  static bool set_option(SGDOptions& o, const std::string& name, double v) {
    if (name == "momentum") {
      o.momentum(v);
    } else if (name == "dampening") {
      o.dampening(v);
    } else if (name == "nesterov") {
      o.nesterov(detail::flag_option(name, v));
    } else {
      return false;
    }
    return true;
  }

  static std::optional<double> option(const SGDOptions& o, const std::string& name) {
    if (name == "momentum") return o.momentum();
    if (name == "dampening") return o.dampening();
    if (name == "nesterov") return o.nesterov() ? 1.0 : 0.0;
    return std::nullopt;
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

template class OptimizerOf<SGDOptions>;

}  // namespace fusedamp::optim
