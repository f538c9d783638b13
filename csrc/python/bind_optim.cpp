// Bindings of fusedamp::optim::{Optimizer, Adam, AdamW, SGD}: what python/fusedamp/optim.py and
// distributed.py call. torch.optim's param-group dicts are translated into the engine's options
// here (sync_options), so the Python classes keep no table of option names of their own.
#include <fusedamp/optim/adam.h>
#include <fusedamp/optim/lion.h>
#include <fusedamp/optim/sgd.h>
#include <fusedamp/optim/state_conversion.h>
#include <fusedamp/grad_scaler.h>
#include <ATen/record_function.h>

#include <optional>
#include <string>

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

at::Tensor tensor_or_undefined(const std::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}

// A learning rate given as a tensor (torch.optim allows it, e.g. for capturable schedules)
// becomes the engine's lr_tensor, read on the device at every step. A tensor that is not
// already FP32 with one dimension is converted here, at every sync, so that a scheduler's
// in-place update of the user's tensor still reaches the step.
at::Tensor lr_tensor_of(const at::Tensor& lr) {
  const auto t = lr.detach();
  return t.scalar_type() == at::kFloat && t.dim() == 1 ? t : t.to(at::kFloat).reshape({1});
}

// Runs `step` inside the profiler scope torch.optim gives a step ("Optimizer.step#AdamW.step"),
// when optim.py passes the name. Opened here rather than by torch's Python record_function,
// which makes a dispatcher call per step whether or not anything observes it; an
// at::RecordFunction with no callbacks installed costs a flag test.
template <typename Step>
void in_step_scope(const std::optional<std::string>& record_as, const Step& step) {
  if (!record_as) {
    step();
    return;
  }
  RECORD_USER_SCOPE(*record_as);
  step();
}

std::string group_name(size_t i) {
  return "param group " + std::to_string(i);
}


at::ScalarType state_dtype_of(py::handle value, const std::string& where) {
  TORCH_CHECK_VALUE(THPDtype_Check(value.ptr()), where,
                    ": state_dtype must be torch.float32, torch.bfloat16 or torch.int8, got ",
                    py::repr(value).cast<std::string>());
  const auto dtype = reinterpret_cast<THPDtype*>(value.ptr())->scalar_type;
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar, where,
                    ": state_dtype must be torch.float32, torch.bfloat16 or torch.int8, got ",
                    dtype);
  return dtype;
}

// Writes the values of torch.optim param-group dicts into the engine's groups, each value read
// as its option's form says (the engine's option table). Keys the engine does not know (torch's
// foreach/fused/capturable flags, a scheduler's initial_lr, ...) are left to the Python side, as
// torch.optim leaves them; validation happens in check_options().
void sync_options(Optimizer& opt, const py::list& groups) {
  TORCH_CHECK(groups.size() == opt.num_groups(), "fusedamp: ", groups.size(),
              " param groups given, the engine has ", opt.num_groups());
  const std::vector<optim::OptionValue> table = opt.default_option_values();
  const auto form_of = [&](const std::string& name) -> std::optional<optim::OptionForm> {
    for (const auto& row : table) {
      if (name == row.name) {
        return row.form;
      }
    }
    return std::nullopt;
  };
  for (size_t i = 0; i < opt.num_groups(); ++i) {
    const auto group = groups[i].cast<py::dict>();
    for (const auto& item : group) {
      const auto name = item.first.cast<std::string>();
      const py::handle value = item.second;
      if (name == "lr") {  // a tensor lr is the engine's lr_tensor; a number, the lr row's
        const bool tensor = THPVariable_Check(value.ptr());
        opt.set_group_lr_tensor(i, tensor ? lr_tensor_of(value.cast<at::Tensor>()) : at::Tensor());
        if (tensor) {
          continue;
        }
      }
      if (name == "betas") {  // torch's pair; the engine's rows are its entries
        TORCH_CHECK_TYPE(py::isinstance<py::sequence>(value) && py::len(value) == 2,
                         "param group ", i, ": betas must be a pair of numbers, got ",
                         py::str(value).cast<std::string>());
        const auto betas = value.cast<std::pair<double, double>>();
        opt.set_group_option(i, "beta1", betas.first);
        opt.set_group_option(i, "beta2", betas.second);
        continue;
      }
      const auto form = form_of(name);
      if (!form) {
        continue;
      }
      switch (*form) {
        case optim::OptionForm::kMasterWeights:
          opt.set_group_option(
              i, name, static_cast<double>(master_weights_of(value, group_name(i)).kind()));
          continue;
        case optim::OptionForm::kDtype:
          opt.set_group_option(i, name,
                               static_cast<double>(state_dtype_of(value, group_name(i))));
          continue;
        case optim::OptionForm::kNumberOrNone:
          if (value.is_none()) {
            opt.clear_group_option(i, name);
            continue;
          }
          break;
        default:
          break;
      }
      // A value the engine reads, of a type it cannot take: never ignore it silently.
      TORCH_CHECK_TYPE(py::isinstance<py::bool_>(value) || py::isinstance<py::int_>(value) ||
                           py::isinstance<py::float_>(value),
                       "param group ", i, ": '", name, "' must be a number, got ",
                       py::str(value).cast<std::string>());
      opt.set_group_option(i, name, value.cast<double>());
    }
  }
}

// A value whose identity tells its content: Python's immutable scalars, strings, dtypes and
// tuples of them. A list or a tensor may change in place under the same identity.
bool immutable_value(py::handle value) {
  if (value.is_none() || PyFloat_CheckExact(value.ptr()) || PyLong_CheckExact(value.ptr()) ||
      PyBool_Check(value.ptr()) || PyUnicode_CheckExact(value.ptr()) ||
      THPDtype_Check(value.ptr())) {
    return true;
  }
  if (PyTuple_CheckExact(value.ptr())) {
    for (const auto& item : py::reinterpret_borrow<py::tuple>(value)) {
      if (!immutable_value(item)) {
        return false;
      }
    }
    return true;
  }
  return false;
}

// The group's items as a tuple of (key, value) pairs (holding them, so that an identity seen
// again is the same object), or None where a value may change in place.
py::object snapshot_of(const py::dict& group) {
  py::tuple items(group.size());
  size_t k = 0;
  for (const auto& item : group) {
    if (!immutable_value(item.second) && !(item.first.cast<std::string>() == "params")) {
      return py::none();
    }
    items[k++] = py::make_tuple(item.first, item.second);
  }
  return std::move(items);
}

// Whether `group` holds exactly the objects of `snapshot` (same keys, same values, same order).
bool same_as(const py::dict& group, py::handle snapshot) {
  if (snapshot.is_none() || static_cast<size_t>(PyTuple_GET_SIZE(snapshot.ptr())) !=
                                static_cast<size_t>(PyDict_Size(group.ptr()))) {
    return false;
  }
  Py_ssize_t position = 0;
  PyObject* key = nullptr;
  PyObject* value = nullptr;
  Py_ssize_t k = 0;
  while (PyDict_Next(group.ptr(), &position, &key, &value)) {
    PyObject* pair = PyTuple_GET_ITEM(snapshot.ptr(), k++);
    if (PyTuple_GET_ITEM(pair, 0) != key || PyTuple_GET_ITEM(pair, 1) != value) {
      return false;
    }
  }
  return true;
}

// sync_options, skipping the groups whose dicts hold the same objects as at the last call with
// the same `synced` list (the optimizer's own; snapshots of the groups it last wrote): a step
// pushes an option to the engine only when it changed. Values that may change in place (a
// list, an lr tensor) are pushed at every call.
void sync_changed_options(Optimizer& opt, const py::list& groups, py::list synced) {
  const size_t n = groups.size();
  bool all_same = static_cast<size_t>(synced.size()) == n && n == opt.num_groups();
  for (size_t i = 0; all_same && i < n; ++i) {
    all_same = same_as(groups[i].cast<py::dict>(), synced[i]);
  }
  if (all_same) {
    return;
  }
  // Forgotten first: a sync that raises leaves no snapshot behind.
  PyList_SetSlice(synced.ptr(), 0, PyList_GET_SIZE(synced.ptr()), nullptr);
  sync_options(opt, groups);
  for (size_t i = 0; i < n; ++i) {
    synced.append(snapshot_of(groups[i].cast<py::dict>()));
  }
}

// Checks torch.optim param-group dicts as optimizer `Kind` would, without any parameter: what a
// front end calls before it changes anything (e.g. the sharded optimizer repacks the model).
template <typename Kind>
void validate_groups(const py::list& groups) {
  Kind opt(make_groups(std::vector<std::vector<at::Tensor>>(groups.size())));
  sync_options(opt, groups);
  opt.check_options();
}

// Optimizer `Kind` under `name`: built from lists of parameters (one per param group), its
// validate() and option_table() (option_table_of: its options with the kind's defaults).
template <typename Kind, typename Base>
void bind_kind(py::module_& m, const char* name) {
  py::class_<Kind, Base>(m, name)
      .def(py::init([](const std::vector<std::vector<at::Tensor>>& groups) {
        return std::make_unique<Kind>(make_groups(groups));
      }))
      .def_static("validate", &validate_groups<Kind>)
      .def_static("option_table", [] {
        return option_table_of(Kind(make_groups(std::vector<std::vector<at::Tensor>>(1))));
      });
}

}  // namespace

// A param group's master_weights: True / False, or a mode's name (numbers other than bools
// would hide a typo).
optim::MasterWeights master_weights_of(py::handle value, const std::string& where) {
  TORCH_CHECK_VALUE(py::isinstance<py::bool_>(value) || py::isinstance<py::str>(value),
                    where, ": master_weights must be ", optim::MasterWeights::choices(),
                    "; got ", py::repr(value).cast<std::string>());
  return py::isinstance<py::bool_>(value)
             ? optim::MasterWeights(value.cast<bool>())
             : optim::MasterWeights::from_name(value.cast<std::string>());
}

void bind_optim(py::module_& m) {
  py::class_<Optimizer>(m, "Optimizer")
      .def(
          "step",
          [](Optimizer& o, const std::optional<std::string>& record_as) {
            in_step_scope(record_as, [&] { o.step(); });
          },
          py::arg("record_as") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def(
          "step_amp",
          [](Optimizer& o, const std::optional<at::Tensor>& grad_scale,
             const std::optional<at::Tensor>& found_inf, GradScaler* telemetry_of,
             const std::optional<std::string>& record_as) {
            GradTelemetrySink* sink = telemetry_of ? telemetry_of->telemetry_sink() : nullptr;
            py::gil_scoped_release no_gil;
            in_step_scope(record_as, [&] {
              o.step_amp(tensor_or_undefined(grad_scale), tensor_or_undefined(found_inf), sink);
            });
          },
          py::arg("grad_scale"), py::arg("found_inf"), py::arg("telemetry_of") = nullptr,
          py::arg("record_as") = py::none())
      .def(
          "step_released",
          [](Optimizer& o, const at::Tensor& param, const std::optional<at::Tensor>& grad_scale,
             const std::optional<at::Tensor>& found_inf_sum, GradScaler* telemetry_of) {
            GradTelemetrySink* sink = telemetry_of ? telemetry_of->telemetry_sink() : nullptr;
            py::gil_scoped_release no_gil;
            o.step_released(param, tensor_or_undefined(grad_scale),
                            tensor_or_undefined(found_inf_sum), sink);
          },
          py::arg("param"), py::arg("grad_scale"), py::arg("found_inf_sum"),
          py::arg("telemetry_of") = nullptr)
      // The phases, for front ends that put collectives between them (distributed.py).
      .def("gather_grads", &Optimizer::gather_grads)
      .def(
          "compute_grad_stats",
          [](Optimizer& o, const std::optional<at::Tensor>& seed, ShardedGradStats* shards) {
            return o.compute_grad_stats(tensor_or_undefined(seed), shards);
          },
          py::arg("seed_found_inf") = py::none(), py::arg("shards") = nullptr)
      .def(
          "apply_update",
          [](Optimizer& o, const std::optional<at::Tensor>& grad_scale,
             const std::optional<at::Tensor>& found_inf, bool scaled) {
            o.apply_update(tensor_or_undefined(grad_scale), tensor_or_undefined(found_inf),
                           scaled);
          },
          py::arg("grad_scale"), py::arg("found_inf"), py::arg("scaled"))
      .def("zero_grad", &Optimizer::zero_grad, py::arg("set_to_none") = true)
      .def("sync_options", &sync_options)
      .def("sync_changed_options", &sync_changed_options)
      .def("check_options", &Optimizer::check_options)
      .def("set_group_option", &Optimizer::set_group_option)
      .def("group_option", &Optimizer::group_option)
      .def("set_group_lr_tensor", &Optimizer::set_group_lr_tensor)
      .def("set_group_max_grad_norm", &Optimizer::set_group_max_grad_norm)
      .def("num_groups", &Optimizer::num_groups)
      .def("bucket_builds", &Optimizer::bucket_builds)
      .def("last_step_applied", [](const Optimizer& o) { return maybe(o.last_step_applied()); })
      .def("skipped_steps", [](const Optimizer& o) { return maybe(o.skipped_steps()); })
      .def("set_skipped_steps", &Optimizer::set_skipped_steps)
      .def("found_inf", [](const Optimizer& o) { return maybe(o.found_inf()); })
      .def("grad_sum_sq", [](const Optimizer& o) { return maybe(o.grad_sum_sq()); })
      .def("grad_norm", [](const Optimizer& o) { return maybe(o.grad_norm()); })
      .def("param_state", &Optimizer::param_state)
      .def("master_weight",
           [](const Optimizer& o, const at::Tensor& p) { return maybe(o.master_weight(p)); })
      .def("set_param_state", &Optimizer::set_param_state, py::arg("param"), py::arg("state"),
           py::arg("copy") = true)
      .def("load_param_states", &Optimizer::load_param_states)
      .def("all_params", &Optimizer::all_params);

  m.def(
      "master_weights_fit",
      [](py::handle master_weights, py::object dtype) {
        const auto mode = master_weights_of(master_weights, "master_weights_fit");
        TORCH_CHECK_TYPE(THPDtype_Check(dtype.ptr()), "master_weights_fit: dtype must be a "
                         "torch.dtype, got ", py::repr(dtype).cast<std::string>());
        return mode.fits(reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type);
      },
      py::arg("master_weights"), py::arg("dtype"));
  m.def(
      "convert_param_state",
      [](const at::Tensor& weight, const Optimizer::StateDict& state, py::handle master_weights,
         py::handle state_dtype, size_t index) {
        const char* who = "convert_param_state";
        auto converted = optim::convert_param_state(weight, state,
                                                    master_weights_of(master_weights, who),
                                                    state_dtype_of(state_dtype, who), index);
        return py::make_tuple(converted.weight, converted.state);
      },
      py::arg("weight"), py::arg("state"), py::arg("master_weights"), py::arg("state_dtype"),
      py::arg("index") = 0);

  m.def("moment_scales_shape", &optim::moment_scales_shape, py::arg("param"));
  m.def("momentum_scales_shape", &optim::momentum_scales_shape, py::arg("param"));

  bind_kind<optim::Adam, Optimizer>(m, "Adam");
  bind_kind<optim::AdamW, optim::Adam>(m, "AdamW");
  bind_kind<optim::SGD, Optimizer>(m, "SGD");
  bind_kind<optim::Lion, Optimizer>(m, "Lion");
}

}  // namespace fusedamp::python
