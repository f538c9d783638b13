#pragma once
#include <torch/csrc/Dtype.h>
#include <torch/csrc/utils/pybind.h>

#include <string>

namespace fusedamp::python {
// Each bind_*.cpp adds its classes; bind_all calls them in dependency order.
void bind_all(pybind11::module_& m);
}  // namespace fusedamp::python

namespace fusedamp::optim {
class MasterWeights;
class Optimizer;
}

namespace fusedamp::python {
// The options of `opt`'s kind with the values of its defaults, as fusedamp.optim reads them:
// [(name, default, form)] in the engine's order (its shared options, then its algorithm's;
// beta1 and beta2 apart), form one of "number", "flag", "integer", "master_weights", "dtype",
// "number_or_none" (the default None where none is held).
pybind11::list option_table_of(const optim::Optimizer& opt);

// A master_weights value from Python: True / False, or a mode's name (numbers other than bools
// would hide a typo); throws c10::ValueError naming `where`.
optim::MasterWeights master_weights_of(pybind11::handle value, const std::string& where);
}  // namespace fusedamp::python
