#include "bindings.h"

namespace fusedamp::python {
void bind_all(pybind11::module_& m) {
  (void)m;  // the engine's bindings are added here as they land
}
}  // namespace fusedamp::python
