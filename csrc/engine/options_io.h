#pragma once
// Serialisation of the options every fusedamp optimizer carries (lr, weight_decay, maximize and
// the engine fields), shared by AdamOptions and SGDOptions::serialize.
#include <fusedamp/optim/options.h>
#include <torch/serialize/archive.h>

#include "option_checks.h"

#include <optional>

namespace fusedamp::optim::detail {

template <typename Options>
void write_common_options(const Options& o, torch::serialize::OutputArchive& a) {
  a.write("lr", c10::IValue(o.lr()));
  a.write("weight_decay", c10::IValue(o.weight_decay()));
  a.write("maximize", c10::IValue(o.maximize()));
  // The mode's code (MasterWeights::Kind); archives before the modes wrote a bool.
  a.write("master_weights", c10::IValue(static_cast<int64_t>(o.master_weights().kind())));
  a.write("state_dtype", c10::IValue(static_cast<int64_t>(o.state_dtype())));
  a.write("rounding_seed", c10::IValue(o.rounding_seed()));
  a.write("skip_nonfinite", c10::IValue(o.skip_nonfinite()));
  a.write("adopt_param_edits", c10::IValue(o.adopt_param_edits()));
  a.write("write_back_grads", c10::IValue(o.write_back_grads()));
  if (o.max_grad_norm()) {
    a.write("max_grad_norm", c10::IValue(*o.max_grad_norm()));
  }
}

template <typename Options>
void read_common_options(Options& o, torch::serialize::InputArchive& a) {
  c10::IValue v;
  a.read("lr", v);
  o.lr(v.toDouble());
  a.read("weight_decay", v);
  o.weight_decay(v.toDouble());
  a.read("maximize", v);
  o.maximize(v.toBool());
  a.read("master_weights", v);
  o.master_weights(v.isBool() ? MasterWeights(v.toBool())
                              : MasterWeights::from_code(static_cast<double>(v.toInt())));
  o.state_dtype(a.try_read("state_dtype", v) ? state_dtype_option(static_cast<double>(v.toInt()))
                                             : at::kFloat);
  o.rounding_seed(a.try_read("rounding_seed", v) ? v.toInt() : 0);
  a.read("skip_nonfinite", v);
  o.skip_nonfinite(v.toBool());
  // Absent from archives written before these options existed: their defaults then.
  o.adopt_param_edits(a.try_read("adopt_param_edits", v) ? v.toBool() : true);
  o.write_back_grads(a.try_read("write_back_grads", v) ? v.toBool() : true);
  o.max_grad_norm(a.try_read("max_grad_norm", v) ? std::optional<double>(v.toDouble())
                                                 : std::nullopt);
}

}  // namespace fusedamp::optim::detail
