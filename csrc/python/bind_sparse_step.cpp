// Binding of fusedamp::optim::sparse_step (fusedamp/optim/sparse_step.h): what
// python/fusedamp/sparse_optim.py and sparse_sgd.py relay. Python owns the tables' state dicts
// (each table's master made by the engine, new_sparse_master) and passes, per table, the
// parameter, its master, its state tensors, its step count and its group's options as a dict
// of torch.optim's names.
#include <ATen/record_function.h>
#include <fusedamp/grad_scaler.h>
#include <fusedamp/ops.h>
#include <fusedamp/optim/optimizer.h>
#include <fusedamp/optim/options.h>
#include <fusedamp/optim/sparse_step.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings.h"

namespace fusedamp::python {
namespace {

namespace py = pybind11;
using optim::SparseAlgorithm;
using optim::SparseHyper;
using optim::SparseTable;

// The algorithm of the operator Python names (fusedamp/ops.h FUSEDAMP_SPARSE_ROW_OPS).
SparseAlgorithm algorithm_of(const std::string& op_name) {
#define FUSEDAMP_SPARSE_ALGORITHM_OF(Op, op, Algorithm) \
  if (op_name == #op) {                                 \
    return SparseAlgorithm::Algorithm;                  \
  }
  FUSEDAMP_SPARSE_ROW_OPS(FUSEDAMP_SPARSE_ALGORITHM_OF)
#undef FUSEDAMP_SPARSE_ALGORITHM_OF
  TORCH_CHECK_VALUE(false, "fusedamp: no sparse step operator '", op_name, "'");
}

// A group's options, by torch.optim's names ("betas" a pair); those the algorithm does not take
// are absent.
struct NumberOption {
  const char* name;
  double SparseHyper::*field;
};
constexpr NumberOption kNumbers[] = {{"lr", &SparseHyper::lr},
                                     {"momentum", &SparseHyper::momentum},
                                     {"dampening", &SparseHyper::dampening},
                                     {"lr_decay", &SparseHyper::lr_decay},
                                     {"eps", &SparseHyper::eps}};

SparseHyper hyper_of(const py::dict& options) {
  SparseHyper h;
  for (const auto& item : options) {
    const auto name = item.first.cast<std::string>();
    const py::handle v = item.second;
    bool known = true;
    if (name == "rounding_seed" || name == "index") {
      continue;  // the table's, not the algorithm's (table_of)
    } else if (name == "nesterov") {
      h.nesterov = v.cast<bool>();
    } else if (name == "maximize") {
      h.maximize = v.cast<bool>();
    } else if (name == "betas") {
      std::tie(h.beta1, h.beta2) = v.cast<std::pair<double, double>>();
    } else {
      known = false;
      for (const NumberOption& o : kNumbers) {
        if (name == o.name) {
          h.*o.field = v.cast<double>();
          known = true;
        }
      }
    }
    TORCH_CHECK_VALUE(known, "fusedamp: unknown sparse step option '", name, "'");
  }
  return h;
}

// A table as the engine takes it; options may hold its stochastic-rounding group seed
// ("rounding_seed", None where the table is not rounded stochastically) and its index among
// its optimizer's parameters ("index").
SparseTable table_of(const at::Tensor& param, const std::optional<at::Tensor>& master,
                     const std::vector<at::Tensor>& state, const at::Tensor& step,
                     const py::dict& options) {
  SparseTable t{param, master, state, step, hyper_of(options)};
  if (options.contains("rounding_seed") && !options["rounding_seed"].is_none()) {
    t.rounding_seed = options["rounding_seed"].cast<int64_t>();
  }
  if (options.contains("index")) {
    t.index = options["index"].cast<int64_t>();
  }
  return t;
}

at::Tensor defined_or_not(const std::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}

}  // namespace

void bind_sparse_step(py::module_& m) {
  m.def(
      "sparse_step",
      [](const std::string& algorithm, const std::vector<at::Tensor>& params,
         const std::vector<std::optional<at::Tensor>>& masters,
         const std::vector<std::vector<at::Tensor>>& states, const std::vector<at::Tensor>& steps,
         const std::vector<py::dict>& options, const std::optional<at::Tensor>& grad_scale,
         const std::optional<at::Tensor>& found_inf, bool skip_nonfinite, const std::string& who,
         optim::Optimizer* dense, GradScaler* telemetry_of,
         const std::optional<std::string>& record_as) -> py::object {
        const size_t n = params.size();
        TORCH_CHECK(masters.size() == n && states.size() == n && steps.size() == n &&
                        options.size() == n,
                    who, ": one master, state list, step count and options per table");
        std::vector<SparseTable> tables(n);
        for (size_t i = 0; i < n; ++i) {
          tables[i] = table_of(params[i], masters[i], states[i], steps[i], options[i]);
        }
        optim::SparseStepOptions o;
        o.algorithm = algorithm_of(algorithm);
        o.grad_scale = defined_or_not(grad_scale);
        o.found_inf = defined_or_not(found_inf);
        o.skip_nonfinite = skip_nonfinite;
        o.who = who;
        GradTelemetrySink* sink = telemetry_of ? telemetry_of->telemetry_sink() : nullptr;
        at::Tensor flag;
        {
          py::gil_scoped_release no_gil;
          if (record_as) {
            RECORD_USER_SCOPE(*record_as);
            flag = optim::sparse_step(tables, o, dense, sink);
          } else {
            flag = optim::sparse_step(tables, o, dense, sink);
          }
        }
        return flag.defined() ? py::cast(flag) : py::none();
      },
      py::arg("algorithm"), py::arg("params"), py::arg("masters"), py::arg("states"),
      py::arg("steps"), py::arg("options"), py::arg("grad_scale"), py::arg("found_inf"),
      py::arg("skip_nonfinite"), py::arg("who"), py::arg("dense") = nullptr,
      py::arg("telemetry_of") = nullptr, py::arg("record_as") = py::none(),
      "One step of embedding tables with sparse gradients (fusedamp/optim/sparse_step.h); "
      "returns the inf/NaN flag it was decided by, or None.");
  m.def(
      "check_sparse_master_weights",
      [](py::handle master_weights, const std::string& who) {
        optim::check_sparse_master_weights(master_weights_of(master_weights, who), who);
      },
      py::arg("master_weights"), py::arg("who"),
      "Raises ValueError where the sparse steps do not take this master_weights.");
  m.def(
      "new_sparse_master",
      [](const at::Tensor& table, py::handle master_weights, const std::string& who) {
        const auto kept =
            optim::new_sparse_master(table, master_weights_of(master_weights, who), who);
        return kept ? py::object(py::make_tuple(kept->first, kept->second))
                    : py::object(py::none());
      },
      py::arg("table"), py::arg("master_weights"), py::arg("who"),
      "A table's master for its first step under master_weights: (its state's name, the "
      "tensor), or None where the table keeps none.");
}

}  // namespace fusedamp::python
