#include "bindings.h"

namespace fusedamp::python {

void bind_optim(pybind11::module_& m);
void bind_grad_scaler(pybind11::module_& m);
void bind_ops(pybind11::module_& m);
void bind_sparse_step(pybind11::module_& m);

void bind_all(pybind11::module_& m) {
  bind_optim(m);
  bind_grad_scaler(m);
  bind_ops(m);
  bind_sparse_step(m);
}

}  // namespace fusedamp::python
