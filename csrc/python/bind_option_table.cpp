// A kind's options as fusedamp.optim reads them (option_table_of, bindings.h).
#include <fusedamp/optim/optimizer.h>

#include <cstdint>

#include "bindings.h"

namespace fusedamp::python {
namespace {

namespace py = pybind11;

// An option's value as a param group of fusedamp.optim holds it (none: None).
py::object python_value(const optim::OptionValue& option) {
  if (!option.value) {
    return py::none();
  }
  const double v = *option.value;
  switch (option.form) {
    case optim::OptionForm::kFlag:
      return py::bool_(v != 0.0);
    case optim::OptionForm::kInteger:
      return py::int_(static_cast<int64_t>(v));
    case optim::OptionForm::kMasterWeights: {  // True / False, or the mode's name
      const auto mode = optim::MasterWeights::from_code(v);
      if (mode == optim::MasterWeights(true) || mode == optim::MasterWeights(false)) {
        return py::bool_(mode == optim::MasterWeights(true));
      }
      return py::str(mode.info().names[0]);
    }
    case optim::OptionForm::kDtype:
      return py::cast(static_cast<at::ScalarType>(static_cast<int>(v)));
    case optim::OptionForm::kNumber:
    case optim::OptionForm::kNumberOrNone:
      break;
  }
  return py::float_(v);
}

const char* option_form_name(optim::OptionForm form) {
  switch (form) {
    case optim::OptionForm::kFlag:
      return "flag";
    case optim::OptionForm::kInteger:
      return "integer";
    case optim::OptionForm::kMasterWeights:
      return "master_weights";
    case optim::OptionForm::kDtype:
      return "dtype";
    case optim::OptionForm::kNumberOrNone:
      return "number_or_none";
    case optim::OptionForm::kNumber:
      break;
  }
  return "number";
}

}  // namespace

py::list option_table_of(const optim::Optimizer& opt) {
  py::list table;
  for (const auto& option : opt.default_option_values()) {
    table.append(
        py::make_tuple(option.name, python_value(option), option_form_name(option.form)));
  }
  return table;
}

}  // namespace fusedamp::python
