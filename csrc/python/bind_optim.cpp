// Bindings of fusedamp::optim::{Optimizer, Adam, AdamW, SGD}: what the Python classes in
// python/fusedamp/optim.py call. The Python side keeps torch.optim's param_groups and pushes
// their values into the engine before each step (set_group_option: one field write each).
#include <fusedamp/optim/adam.h>
#include <fusedamp/optim/sgd.h>
#include <torch/extension.h>

#include "bindings.h"

namespace fusedamp::python {
namespace {

namespace py = pybind11;
using fusedamp::optim::Optimizer;

std::vector<torch::optim::OptimizerParamGroup> make_groups(
    const std::vector<std::vector<at::Tensor>>& groups) {
  std::vector<torch::optim::OptimizerParamGroup> out;
  out.reserve(groups.size());
  for (const auto& g : groups) {
    out.emplace_back(g);
  }
  return out;
}

py::object maybe(const at::Tensor& t) {
  return t.defined() ? py::cast(t) : py::none();
}

}  // namespace

void bind_optim(py::module_& m) {
  py::class_<Optimizer>(m, "Optimizer")
      .def("step", [](Optimizer& o) { o.step(); }, py::call_guard<py::gil_scoped_release>())
      .def("step_scaled", &Optimizer::step_scaled, py::arg("inv_scale"),
           py::arg("grads_unscaled"), py::call_guard<py::gil_scoped_release>())
      .def("unscale_grads_", &Optimizer::unscale_grads_, py::arg("inv_scale"))
      .def("zero_grad", &Optimizer::zero_grad, py::arg("set_to_none") = true)
      .def("set_group_option", &Optimizer::set_group_option)
      .def("group_option", &Optimizer::group_option)
      .def("set_group_lr_tensor", &Optimizer::set_group_lr_tensor)
      .def("num_groups", &Optimizer::num_groups)
      .def("last_step_applied", [](const Optimizer& o) { return maybe(o.last_step_applied()); })
      .def("skipped_steps", [](const Optimizer& o) { return maybe(o.skipped_steps()); })
      .def("found_inf", [](const Optimizer& o) { return maybe(o.found_inf()); })
      .def("grad_sum_sq", [](const Optimizer& o) { return maybe(o.grad_sum_sq()); })
      .def("param_state", &Optimizer::param_state)
      .def("set_param_state", &Optimizer::set_param_state)
      .def("all_params", &Optimizer::all_params);

  py::class_<optim::Adam, Optimizer>(m, "Adam").def(
      py::init([](const std::vector<std::vector<at::Tensor>>& groups) {
        return std::make_unique<optim::Adam>(make_groups(groups));
      }));
  py::class_<optim::AdamW, optim::Adam>(m, "AdamW")
      .def(py::init([](const std::vector<std::vector<at::Tensor>>& groups) {
        return std::make_unique<optim::AdamW>(make_groups(groups));
      }));
  py::class_<optim::SGD, Optimizer>(m, "SGD").def(
      py::init([](const std::vector<std::vector<at::Tensor>>& groups) {
        return std::make_unique<optim::SGD>(make_groups(groups));
      }));
}

}  // namespace fusedamp::python
