// fusedamp._C.ops (python/fusedamp/ops.py): fusedamp's operators called from Python the way
// torch's own operators are.
//
// torch.ops.fusedamp.<op> reaches an operator through the dispatcher's boxed path: every element
// of every tensor list becomes an IValue, and is converted back into a vector of tensors for the
// kernel, its reference count taken and dropped on the way. With thousands of tensors per call
// that costs more than the op's checks and kernel together (benchmarks/bench_host_overhead.py).
// Here each list is read straight from its Python objects: every tensor is borrowed (no
// reference count changes; the objects stay alive through a tuple this call holds), and the op
// runs through its typed handle (ops/handles.h) with the GIL released, as torch's generated
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

#include <deque>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "../ops/handles.h"
#include "bindings.h"

namespace fusedamp::python {
namespace {

namespace py = pybind11;
using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;
using Borrow = c10::MaybeOwnedTraits<Tensor>;

// One call's arguments, matched to the op's schema. Reading an argument that this path does not
// take as it is marks the call for torch.ops (needs_torch_ops); nothing runs before every
// argument has been read.
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

  // Argument `index` into `field`, which holds the schema's default (the declaration's initial
  // value) where the argument is not given.
  template <typename T>
  void read(size_t index, T& field) {
    const py::handle value = given_[index];
    if (!value) {
      if (!schema_.arguments()[index].default_value().has_value()) {
        pass_to_torch_ops();  // a required argument is missing: torch.ops says which
      }
      return;
    }
    read_value(value, field);
  }

 private:
  // Tensor[]: a list or tuple of plain tensors.
  void read_value(py::handle value, TensorList& field) { field = borrow_list(value); }

  // Tensor[]?: None is nullopt.
  void read_value(py::handle value, std::optional<TensorList>& field) {
    if (value.is_none()) {
      field = std::nullopt;
    } else {
      field = borrow_list(value);
    }
  }

  void read_value(py::handle value, Tensor& field) {
    if (!THPVariable_CheckExact(value.ptr())) {
      pass_to_torch_ops();
      return;
    }
    field = THPVariable_Unpack(value.ptr());
  }

  void read_value(py::handle value, OptTensor& field) {
    if (value.is_none()) {
      field = std::nullopt;
    } else if (!THPVariable_CheckExact(value.ptr())) {
      pass_to_torch_ops();
    } else {
      field = THPVariable_Unpack(value.ptr());
    }
  }

  void read_value(py::handle value, double& field) { field = number_of(value).value_or(0.0); }

  void read_value(py::handle value, std::optional<double>& field) {
    field = value.is_none() ? std::nullopt : number_of(value);
  }

  void read_value(py::handle value, int64_t& field) { field = integer_of(value).value_or(0); }

  void read_value(py::handle value, bool& field) {
    if (!PyBool_Check(value.ptr())) {
      pass_to_torch_ops();
      return;
    }
    field = value.ptr() == Py_True;
  }

  // int[]?: None is nullopt; an empty list is an empty list (not None).
  void read_value(py::handle value, c10::OptionalIntArrayRef& field) {
    if (value.is_none()) {
      field = std::nullopt;
      return;
    }
    if (!PyList_Check(value.ptr()) && !PyTuple_Check(value.ptr())) {
      pass_to_torch_ops();
      return;
    }
    const py::sequence items = py::reinterpret_borrow<py::sequence>(value);
    auto& out = ints_.emplace_back();
    out.reserve(items.size());
    for (const auto item : items) {
      const auto v = integer_of(item);
      if (!v.has_value()) {
        return;  // passed to torch.ops by integer_of
      }
      out.push_back(*v);
    }
    field = c10::IntArrayRef(out);
  }

  // The call goes through torch.ops; the field keeps a placeholder that is never used.
  void pass_to_torch_ops() { to_torch_ops_ = true; }

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
  std::deque<std::vector<int64_t>> ints_;
  bool to_torch_ops_ = false;
};

// Op called from Python: its arguments read into its declaration, then the op with the GIL
// released (it may run long on the CPU; a thread of the caller's may meanwhile use Python), or
// the call through torch.ops.
template <typename Op>
py::object entry(const py::args& args, const py::kwargs& kwargs) {
  SchemaCall call(Op::kShortName, ops::handle<Op>().schema(), args, kwargs);
  Op op;
  op.for_each_field([&](auto& field, size_t index, const char*) { call.read(index, field); });
  if (call.needs_torch_ops()) {
    return call.call_torch_ops();
  }
  {
    py::gil_scoped_release no_gil;
    ops::call(op);
  }
  return py::none();
}

// The op's schema as its docstring, beside what this entry is.
template <typename Op>
const char* doc_of() {
  static const std::string doc = [] {
    std::ostringstream out;
    out << ops::handle<Op>().schema() << "\n\ntorch.ops.fusedamp." << Op::kShortName
        << " from Python without torch.ops' boxing of every list element (see fusedamp.ops). "
           "Same arguments, defaults, checks and effects.";
    return out.str();
  }();
  return doc.c_str();  // pybind11 keeps the pointer: the string lives as long as the module
}

template <typename... Ops>
void define_entries(py::module_& m, ops::OpList<Ops...>) {
  (m.def(Ops::kShortName, &entry<Ops>, doc_of<Ops>()), ...);
}

}  // namespace

void bind_ops(py::module_& m) {
  auto ops = m.def_submodule(
      "ops",
      "fusedamp's operators from Python, each torch.ops.fusedamp.<op> without torch.ops' "
      "boxing of every list element (see python/fusedamp/ops.py).");
  define_entries(ops, fusedamp::ops::AllOps{});
}

}  // namespace fusedamp::python
