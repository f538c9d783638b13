// fusedamp._C.ops (python/fusedamp/ops.py): fusedamp's operators called from Python the way
// torch's own operators are.
//
// torch.ops.fusedamp.<op> reaches an operator through the dispatcher's boxed path: every element
// of every tensor list becomes an IValue, and is converted back into a vector of tensors for the
// kernel, its reference count taken and dropped on the way. With thousands of tensors per call
// that costs more than the op's checks and kernel together (benchmarks/bench_host_overhead.py).
// Here each list is read straight from its Python objects: every tensor is borrowed (no
// reference count changes; the objects stay alive through a tuple this call holds), and the op
// runs through its typed handle (op_handles.h) with the GIL released, as torch's generated
// bindings call torch._fused_adamw_.
//
// The behaviour is torch.ops': arguments are matched to the op's schema (names, order, keyword-
// only arguments and defaults all come from it) and the same dispatcher entry runs, so the same
// checks, kernels and version-counter bumps happen. A call this path does not take exactly as it
// is goes to torch.ops.fusedamp.<op> with the same arguments, which handles or refuses it as it
// always does: an active __torch_function__ mode or a tensor subclass (both intercept calls in
// Python), anything but a list or tuple of plain tensors where the schema has Tensor[], a number
// that is not a plain Python int / float / bool (a SymInt, a 0-dim tensor, a numpy scalar), a
// missing, unknown or doubly given argument.
#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <deque>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "../op_handles.h"
#include "bindings.h"

namespace fusedamp::python {
namespace {

namespace py = pybind11;
using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;
using Borrow = c10::MaybeOwnedTraits<Tensor>;

// One call's arguments, matched to the op's schema and read by name. Reading an argument that
// this path does not take as it is marks the call for torch.ops (needs_torch_ops) and returns a
// placeholder; nothing runs before every argument has been read.
class SchemaCall {
 public:
  SchemaCall(const char* op_name, const c10::FunctionSchema& schema, const py::args& args,
             const py::kwargs& kwargs)
      : op_name_(op_name), schema_(schema), args_(args), kwargs_(kwargs) {
    const auto& arguments = schema.arguments();
    given_.assign(arguments.size(), py::handle());
    if (at::impl::torch_function_mode_enabled() || args.size() > arguments.size()) {
      to_torch_ops_ = true;
      return;
    }
    for (size_t i = 0; i < args.size(); ++i) {
      if (arguments[i].kwarg_only()) {
        to_torch_ops_ = true;
        return;
      }
      given_[i] = args[i];
    }
    for (const auto& item : kwargs) {
      const auto index = PyUnicode_Check(item.first.ptr())
                             ? schema.argumentIndexWithName(item.first.cast<std::string>())
                             : std::nullopt;
      if (!index.has_value() || given_[*index]) {
        to_torch_ops_ = true;
        return;
      }
      given_[*index] = item.second;
    }
  }

  ~SchemaCall() {
    for (auto& list : lists_) {
      for (auto& t : list) {
        Borrow::destroyBorrow(t);
      }
    }
    for (auto& t : optionals_) {
      if (t.has_value()) {
        Borrow::destroyBorrow(*t);
      }
    }
  }
  SchemaCall(const SchemaCall&) = delete;
  SchemaCall& operator=(const SchemaCall&) = delete;

  bool needs_torch_ops() const { return to_torch_ops_; }

  // The same call through torch.ops.fusedamp.<op>.
  py::object call_torch_ops() const {
    return py::module_::import("torch")
        .attr("ops")
        .attr("fusedamp")
        .attr(op_name_)(*args_, **kwargs_);
  }

  // Tensor[]: a list or tuple of plain tensors.
  TensorList tensors(const char* name) {
    const Given g = given(name);
    if (!g.value) {
      pass_to_torch_ops();  // a required argument is missing: torch.ops says which
      return {};
    }
    return borrow_list(g.value);
  }

  // Tensor[]?: absent or None is nullopt.
  std::optional<TensorList> optional_tensors(const char* name) {
    const Given g = given(name);
    if (!g.value || g.value.is_none()) {
      return std::nullopt;  // the schema's only default for Tensor[]? is None
    }
    return borrow_list(g.value);
  }

  const Tensor& tensor(const char* name) {
    const Given g = given(name);
    if (!g.value || !THPVariable_CheckExact(g.value.ptr())) {
      pass_to_torch_ops();
      return kUndefined;
    }
    return THPVariable_Unpack(g.value.ptr());
  }

  const OptTensor& optional_tensor(const char* name) {
    const Given g = given(name);
    if (!g.value || g.value.is_none()) {
      return kNoTensor;
    }
    if (!THPVariable_CheckExact(g.value.ptr())) {
      pass_to_torch_ops();
      return kNoTensor;
    }
    return optionals_.emplace_back(Borrow::createBorrow(THPVariable_Unpack(g.value.ptr())));
  }

  // float
  double real(const char* name) {
    const Given g = given(name);
    if (!g.value) {
      return g.default_value().has_value() ? g.default_value()->toDouble() : missing(0.0);
    }
    return number_of(g.value).value_or(0.0);
  }

  // float?
  std::optional<double> optional_real(const char* name) {
    const Given g = given(name);
    if (!g.value) {
      const auto& d = g.default_value();
      return d.has_value() && !d->isNone() ? std::optional<double>(d->toDouble()) : std::nullopt;
    }
    if (g.value.is_none()) {
      return std::nullopt;
    }
    return number_of(g.value);
  }

  // int
  int64_t integer(const char* name) {
    const Given g = given(name);
    if (!g.value) {
      return g.default_value().has_value() ? g.default_value()->toInt() : missing(int64_t{0});
    }
    return integer_of(g.value).value_or(0);
  }

  // bool
  bool flag(const char* name) {
    const Given g = given(name);
    if (!g.value) {
      return g.default_value().has_value() ? g.default_value()->toBool() : missing(false);
    }
    if (!PyBool_Check(g.value.ptr())) {
      pass_to_torch_ops();
      return false;
    }
    return g.value.ptr() == Py_True;
  }

  // int[]?: absent or None is nullopt; an empty list is an empty list (not None).
  c10::OptionalIntArrayRef optional_ints(const char* name) {
    const Given g = given(name);
    if (!g.value || g.value.is_none()) {
      return std::nullopt;  // the schema's only default for int[]? is None
    }
    if (!PyList_Check(g.value.ptr()) && !PyTuple_Check(g.value.ptr())) {
      pass_to_torch_ops();
      return std::nullopt;
    }
    const py::sequence items = py::reinterpret_borrow<py::sequence>(g.value);
    auto& out = ints_.emplace_back();
    out.reserve(items.size());
    for (const auto item : items) {
      const auto v = integer_of(item);
      if (!v.has_value()) {
        return std::nullopt;  // passed to torch.ops by integer_of
      }
      out.push_back(*v);
    }
    return c10::IntArrayRef(out);
  }

 private:
  static inline const Tensor kUndefined{};
  static inline const OptTensor kNoTensor{};

  // An argument as given (null: not given) and its schema entry, from one lookup by name.
  struct Given {
    py::handle value;
    const c10::Argument& argument;
    const std::optional<c10::IValue>& default_value() const { return argument.default_value(); }
  };

  Given given(const char* name) const {
    const auto index = schema_.argumentIndexWithName(name);
    TORCH_INTERNAL_ASSERT(index.has_value(), op_name_, " has no argument ", name);
    return {given_[*index], schema_.arguments()[*index]};
  }

  // The call goes through torch.ops; the caller returns a placeholder that is never used.
  void pass_to_torch_ops() { to_torch_ops_ = true; }

  // A required argument without a default is missing: torch.ops says which.
  template <typename T>
  T missing(T placeholder) {
    pass_to_torch_ops();
    return placeholder;
  }

  TensorList borrow_list(py::handle value) {
    if (!PyList_Check(value.ptr()) && !PyTuple_Check(value.ptr())) {
      pass_to_torch_ops();
      return {};
    }
    // A tuple of the objects (the list itself if it is a tuple) keeps every tensor alive for the
    // call, whatever another thread does to a list while the GIL is released.
    py::tuple owner = PyTuple_Check(value.ptr())
                          ? py::reinterpret_borrow<py::tuple>(value)
                          : py::reinterpret_steal<py::tuple>(PyList_AsTuple(value.ptr()));
    if (!owner) {
      throw py::error_already_set();
    }
    const size_t n = owner.size();
    auto& out = lists_.emplace_back();
    out.reserve(n);  // no reallocation below: a borrowed tensor is never copied or destroyed
    for (size_t i = 0; i < n; ++i) {
      PyObject* item = PyTuple_GET_ITEM(owner.ptr(), static_cast<Py_ssize_t>(i));
      if (!THPVariable_CheckExact(item)) {
        pass_to_torch_ops();
        return {};
      }
      out.push_back(Borrow::createBorrow(THPVariable_Unpack(item)));
    }
    owners_.push_back(std::move(owner));
    return out;
  }

  std::optional<double> number_of(py::handle value) {
    if (PyFloat_CheckExact(value.ptr())) {
      return PyFloat_AS_DOUBLE(value.ptr());
    }
    if (PyLong_CheckExact(value.ptr())) {
      const double v = PyLong_AsDouble(value.ptr());
      if (!(v == -1.0 && PyErr_Occurred())) {
        return v;
      }
      PyErr_Clear();  // too large for a double: torch.ops says so
    }
    pass_to_torch_ops();
    return std::nullopt;
  }

  std::optional<int64_t> integer_of(py::handle value) {
    if (PyLong_CheckExact(value.ptr())) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
      if (overflow == 0 && !(v == -1 && PyErr_Occurred())) {
        return static_cast<int64_t>(v);
      }
      PyErr_Clear();
    }
    pass_to_torch_ops();
    return std::nullopt;
  }

  const char* op_name_;
  const c10::FunctionSchema& schema_;
  py::args args_;
  py::kwargs kwargs_;
  std::vector<py::handle> given_;          // per schema argument; null: not given
  std::vector<py::tuple> owners_;          // keep the borrowed tensors' objects alive
  std::deque<std::vector<Tensor>> lists_;  // borrowed; a deque never moves its elements
  std::deque<OptTensor> optionals_;        // borrowed
  std::deque<std::vector<int64_t>> ints_;
  bool to_torch_ops_ = false;
};

// The op's schema as its docstring, beside what this entry is.
std::string doc_of(const char* op_name, const c10::FunctionSchema& schema) {
  std::ostringstream out;
  out << schema << "\n\ntorch.ops.fusedamp." << op_name
      << " from Python without torch.ops' boxing of every list element (see fusedamp.ops). "
         "Same arguments, defaults, checks and effects.";
  return out.str();
}

// Once every argument is read: the op with the GIL released (it may run long on the CPU; a
// thread of the caller's may meanwhile use Python), or the call through torch.ops.
template <typename RunOp>
py::object finish(const SchemaCall& call, const RunOp& run_op) {
  if (call.needs_torch_ops()) {
    return call.call_torch_ops();
  }
  {
    py::gil_scoped_release no_gil;
    run_op();
  }
  return py::none();
}

py::object unscale_and_check(const py::args& args, const py::kwargs& kwargs) {
  const auto& op = op_handles::unscale_and_check();
  SchemaCall call("unscale_and_check_", op.schema(), args, kwargs);
  const TensorList grads = call.tensors("grads");
  const Tensor& found_inf = call.tensor("found_inf");
  const Tensor& inv_scale = call.tensor("inv_scale");
  const OptTensor& sum_sq = call.optional_tensor("sum_sq");
  const OptTensor& telemetry = call.optional_tensor("telemetry");
  return finish(call, [&] { op.call(grads, found_inf, inv_scale, sum_sq, telemetry); });
}

py::object grad_stats(const py::args& args, const py::kwargs& kwargs) {
  const auto& op = op_handles::grad_stats();
  SchemaCall call("grad_stats_", op.schema(), args, kwargs);
  const TensorList grads = call.tensors("grads");
  const Tensor& found_inf = call.tensor("found_inf");
  const Tensor& sum_sq = call.tensor("sum_sq");
  const OptTensor& tensor_flags = call.optional_tensor("tensor_flags");
  const OptTensor& telemetry = call.optional_tensor("telemetry");
  return finish(call, [&] { op.call(grads, found_inf, sum_sq, tensor_flags, telemetry); });
}

py::object update_scale(const py::args& args, const py::kwargs& kwargs) {
  const auto& op = op_handles::update_scale();
  SchemaCall call("update_scale_", op.schema(), args, kwargs);
  const Tensor& scale = call.tensor("scale");
  const Tensor& growth_tracker = call.tensor("growth_tracker");
  const Tensor& hysteresis_tracker = call.tensor("hysteresis_tracker");
  const Tensor& found_inf = call.tensor("found_inf");
  const double growth_factor = call.real("growth_factor");
  const double backoff_factor = call.real("backoff_factor");
  const int64_t growth_interval = call.integer("growth_interval");
  const int64_t hysteresis = call.integer("hysteresis");
  const auto min_scale = call.optional_real("min_scale");
  const auto max_scale = call.optional_real("max_scale");
  const OptTensor& amax = call.optional_tensor("amax");
  const auto amax_target = call.optional_real("amax_target");
  const OptTensor& scale_history = call.optional_tensor("scale_history");
  const int64_t scale_history_slot = call.integer("scale_history_slot");
  return finish(call, [&] {
    op.call(scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor, backoff_factor,
            growth_interval, hysteresis, min_scale, max_scale, amax, amax_target, scale_history,
            scale_history_slot);
  });
}

py::object record_telemetry(const py::args& args, const py::kwargs& kwargs) {
  const auto& op = op_handles::record_telemetry();
  SchemaCall call("record_telemetry_", op.schema(), args, kwargs);
  const Tensor& ring = call.tensor("ring");
  const int64_t slot = call.integer("slot");
  const Tensor& scale = call.tensor("scale");
  const Tensor& found_inf = call.tensor("found_inf");
  const Tensor& measured = call.tensor("measured");
  const OptTensor& pass_sum_sq = call.optional_tensor("pass_sum_sq");
  return finish(call, [&] { op.call(ring, slot, scale, found_inf, measured, pass_sum_sq); });
}

py::object account_step(const py::args& args, const py::kwargs& kwargs) {
  const auto& op = op_handles::account_step();
  SchemaCall call("account_step_", op.schema(), args, kwargs);
  const Tensor& step_applied = call.tensor("step_applied");
  const Tensor& skipped_steps = call.tensor("skipped_steps");
  const OptTensor& found_inf = call.optional_tensor("found_inf");
  const OptTensor& found_inf_out = call.optional_tensor("found_inf_out");
  const OptTensor& grad_sum_sq = call.optional_tensor("grad_sum_sq");
  const OptTensor& inv_scale = call.optional_tensor("inv_scale");
  const OptTensor& grad_norms = call.optional_tensor("grad_norms");
  const int64_t grad_norm_slot = call.integer("grad_norm_slot");
  return finish(call, [&] {
    op.call(step_applied, skipped_steps, found_inf, found_inf_out, grad_sum_sq, inv_scale,
            grad_norms, grad_norm_slot);
  });
}

// The device scalars and modes adam_step_ and sgd_step_ share, read in schema order.
struct StepTail {
  const OptTensor* lr_tensor;
  const OptTensor* inv_scale;
  const OptTensor* found_inf;
  const OptTensor* grad_sum_sq;
  std::optional<double> max_grad_norm;
  bool adopt_param_edits;
  bool write_back_grads;

  explicit StepTail(SchemaCall& call)
      : lr_tensor(&call.optional_tensor("lr_tensor")),
        inv_scale(&call.optional_tensor("inv_scale")),
        found_inf(&call.optional_tensor("found_inf")),
        grad_sum_sq(&call.optional_tensor("grad_sum_sq")),
        max_grad_norm(call.optional_real("max_grad_norm")),
        adopt_param_edits(call.flag("adopt_param_edits")),
        write_back_grads(call.flag("write_back_grads")) {}
};

py::object adam_step(const py::args& args, const py::kwargs& kwargs) {
  const auto& op = op_handles::adam_step();
  SchemaCall call("adam_step_", op.schema(), args, kwargs);
  const TensorList params = call.tensors("params");
  const TensorList master_params = call.tensors("master_params");
  const TensorList grads = call.tensors("grads");
  const TensorList exp_avgs = call.tensors("exp_avgs");
  const TensorList exp_avg_sqs = call.tensors("exp_avg_sqs");
  const TensorList steps = call.tensors("steps");
  const double lr = call.real("lr");
  const double beta1 = call.real("beta1");
  const double beta2 = call.real("beta2");
  const double eps = call.real("eps");
  const double weight_decay = call.real("weight_decay");
  const bool decoupled_weight_decay = call.flag("decoupled_weight_decay");
  const bool maximize = call.flag("maximize");
  const StepTail tail(call);
  const auto max_exp_avg_sqs = call.optional_tensors("max_exp_avg_sqs");
  const auto rounding_seeds = call.optional_ints("rounding_seeds");
  return finish(call, [&] {
    op.call(params, master_params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps,
            weight_decay, decoupled_weight_decay, maximize, *tail.lr_tensor, *tail.inv_scale,
            *tail.found_inf, *tail.grad_sum_sq, tail.max_grad_norm, tail.adopt_param_edits,
            tail.write_back_grads, max_exp_avg_sqs, rounding_seeds);
  });
}

py::object sgd_step(const py::args& args, const py::kwargs& kwargs) {
  const auto& op = op_handles::sgd_step();
  SchemaCall call("sgd_step_", op.schema(), args, kwargs);
  const TensorList params = call.tensors("params");
  const TensorList master_params = call.tensors("master_params");
  const TensorList grads = call.tensors("grads");
  const TensorList momentum_buffers = call.tensors("momentum_buffers");
  const TensorList steps = call.tensors("steps");
  const double lr = call.real("lr");
  const double momentum = call.real("momentum");
  const double dampening = call.real("dampening");
  const double weight_decay = call.real("weight_decay");
  const bool nesterov = call.flag("nesterov");
  const bool maximize = call.flag("maximize");
  const StepTail tail(call);
  const auto rounding_seeds = call.optional_ints("rounding_seeds");
  return finish(call, [&] {
    op.call(params, master_params, grads, momentum_buffers, steps, lr, momentum, dampening,
            weight_decay, nesterov, maximize, *tail.lr_tensor, *tail.inv_scale, *tail.found_inf,
            *tail.grad_sum_sq, tail.max_grad_norm, tail.adopt_param_edits, tail.write_back_grads,
            rounding_seeds);
  });
}

}  // namespace

void bind_ops(py::module_& m) {
  auto ops = m.def_submodule(
      "ops",
      "fusedamp's operators from Python, each torch.ops.fusedamp.<op> without torch.ops' "
      "boxing of every list element (see python/fusedamp/ops.py).");
  // pybind11 keeps a pointer to each docstring: they live as long as the module.
  static const std::string docs[] = {
      doc_of("unscale_and_check_", op_handles::unscale_and_check().schema()),
      doc_of("grad_stats_", op_handles::grad_stats().schema()),
      doc_of("update_scale_", op_handles::update_scale().schema()),
      doc_of("record_telemetry_", op_handles::record_telemetry().schema()),
      doc_of("account_step_", op_handles::account_step().schema()),
      doc_of("adam_step_", op_handles::adam_step().schema()),
      doc_of("sgd_step_", op_handles::sgd_step().schema())};
  ops.def("unscale_and_check_", &unscale_and_check, docs[0].c_str());
  ops.def("grad_stats_", &grad_stats, docs[1].c_str());
  ops.def("update_scale_", &update_scale, docs[2].c_str());
  ops.def("record_telemetry_", &record_telemetry, docs[3].c_str());
  ops.def("account_step_", &account_step, docs[4].c_str());
  ops.def("adam_step_", &adam_step, docs[5].c_str());
  ops.def("sgd_step_", &sgd_step, docs[6].c_str());
}

}  // namespace fusedamp::python
