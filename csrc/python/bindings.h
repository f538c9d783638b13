#pragma once
#include <torch/extension.h>

namespace fusedamp::python {
// Each bind_*.cpp adds its classes; bind_all calls them in dependency order.
void bind_all(pybind11::module_& m);
}  // namespace fusedamp::python
