// fusedamp::optim::sparse_step: the order of a step over embedding tables with sparse
// gradients (fusedamp/optim/sparse_step.h): every table checked, one inf/NaN flag over all of
// them, the dense parameters' step seeded with it, then one row-wise operator per table.
#include <fusedamp/optim/sparse_step.h>

#include <ATen/ops/aminmax.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/zeros.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <fusedamp/master_modes.h>
#include <fusedamp/math/stochastic_rounding_math.h>
#include <fusedamp/ops.h>
#include <fusedamp/optim/optimizer.h>
#include <fusedamp/optim/options.h>
#include <fusedamp/optim/param_state.h>

#include "../ops/sparse_rows_args.h"

#include <sstream>
#include <tuple>
#include <utility>

namespace fusedamp::optim {
namespace {

using OptTensor = std::optional<at::Tensor>;

// Shapes and dtypes as the Python user writes them ((2, 3), torch.float16): the messages
// name the tensors of a torch.optim-style optimizer.
std::string python_shape(at::IntArrayRef sizes) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < sizes.size(); ++i) {
    out << (i ? ", " : "") << sizes[i];
  }
  out << (sizes.size() == 1 ? ",)" : ")");
  return out.str();
}

std::string python_dtype(at::ScalarType dtype) {
  return "torch." + c10::getDtypeNames(dtype).first;
}

// The number of state tensors each algorithm's operator takes (SGD: its momentum buffer
// exactly where momentum is not 0).
size_t state_count(SparseAlgorithm algorithm, const SparseHyper& h) {
  switch (algorithm) {
    case SparseAlgorithm::kSgd:
      return h.momentum != 0.0 ? 1 : 0;
    case SparseAlgorithm::kAdam:
      return 2;
    default:
      return 1;
  }
}

void check_table(SparseAlgorithm algorithm, const SparseTable& t, const std::string& who) {
  const at::Tensor& p = t.param;
  TORCH_CHECK_VALUE(t.hyper.lr >= 0.0, who, ": invalid learning rate ", t.hyper.lr);
  const size_t states = state_count(algorithm, t.hyper);
  TORCH_CHECK(t.state.size() == states, who, ": expected ", states,
              " state tensors for a table, got ", t.state.size());
  const bool has_master = t.master && t.master->defined();
  kernels::check_sparse_seed(who.c_str(), p, has_master, t.rounding_seed.has_value());
  // The group's seed, a user's option (the table's own is derived from it: any 64 bits).
  TORCH_CHECK(!t.rounding_seed || *t.rounding_seed >= 0, who, ": invalid rounding_seed ",
              t.rounding_seed.value_or(0));
  if (has_master) {
    kernels::check_sparse_master(who.c_str(), p, *t.master);
  }
  const at::Tensor& g = p.grad();
  TORCH_CHECK(g.defined(), who, ": a parameter of shape ", python_shape(p.sizes()),
              " has no gradient");
  TORCH_CHECK(g.is_sparse(), who,
              " takes sparse gradients (nn.Embedding/EmbeddingBag with sparse=True); a "
              "parameter of shape ",
              python_shape(p.sizes()),
              " has a dense one (a parameter's gradient must stay sparse from step to step)");
  TORCH_CHECK(p.dim() == 2 && g.sparse_dim() == 1 && g.dense_dim() == 1, who,
              ": only row-wise sparse gradients of 2-D tables are supported (sparse_dim 1, "
              "dense_dim 1, as nn.Embedding's); got a gradient with sparse_dim ",
              g.sparse_dim(), ", dense_dim ", g.dense_dim(), " for a parameter of shape ",
              python_shape(p.sizes()));
  TORCH_CHECK(g.sizes() == p.sizes() && g.scalar_type() == p.scalar_type() &&
                  g.device() == p.device(),
              who, ": the gradient (", python_dtype(g.scalar_type()), ", ",
              python_shape(g.sizes()), ", ", g.device(), ") does not match its parameter (",
              python_dtype(p.scalar_type()), ", ", python_shape(p.sizes()), ", ", p.device(),
              ")");
  const at::Tensor indices = g._indices();
  if (indices.numel() > 0 && indices.device().is_cpu()) {
    // Every table before any is written (the operator checks its own table only). On CUDA the
    // indices are data on the device: the operator asserts there, as torch's indexing does,
    // where a check here would synchronise the host.
    const auto [low_t, high_t] = at::aminmax(indices);
    const int64_t low = low_t.item<int64_t>();
    const int64_t high = high_t.item<int64_t>();
    TORCH_CHECK(low >= 0 && high < p.size(0), who, ": gradient index ", low < 0 ? low : high,
                " is out of range for a table of ", p.size(0), " rows; nothing was modified");
  }
}

// What a table's operator is given as its gradient: the lookups as autograd made them, or
// (CPU) the rows looked up and their lookups' FP32 sums.
struct Lookups {
  at::Tensor indices;
  at::Tensor values;
};

// The inf/NaN check over every table's lookups, into one flag (created where the caller gave
// none and a check is asked for), before any table is written; under a loss scale the values
// are unscaled in place, as torch leaves .grad. A CPU table's check is fused into the one read
// of its lookups that sums them per row (sparse_rows_sum_), and its operator then reads each
// row's sum once; a table elsewhere gets one multi-tensor pass over its values (as the loss
// scaler's unscale_), and its operator sums the lookups. Either way the rows' sums and the
// operator's bits are the same.
at::Tensor check_values(const std::vector<SparseTable>& tables, const SparseStepOptions& o,
                        GradTelemetrySink* telemetry, std::vector<Lookups>& lookups) {
  at::Tensor flag = o.found_inf;
  const at::Tensor& first = tables.front().param;
  const bool check = flag.defined() || o.grad_scale.defined() || o.skip_nonfinite;
  if (!flag.defined() && check) {
    flag = at::zeros({}, first.options().dtype(at::kFloat));
  }
  const at::Tensor inv_scale = o.grad_scale.defined()
                                   ? o.grad_scale.to(at::kDouble).reciprocal().to(at::kFloat)
                                   : at::Tensor();
  std::vector<at::Tensor> elsewhere, elsewhere_params;
  // The CPU tables' values, as the op reads them: it unscales them in place, so they must be
  // contiguous (other ones go through a contiguous copy that comes back into the gradient).
  std::vector<size_t> on_cpu;
  std::vector<at::Tensor> cpu_params, cpu_given, cpu_values;
  lookups.resize(tables.size());
  for (size_t i = 0; i < tables.size(); ++i) {
    const SparseTable& t = tables[i];
    const at::Tensor& g = t.param.grad();
    if (!t.param.is_cpu()) {
      lookups[i] = {g._indices(), g._values()};
      elsewhere.push_back(g._values());
      elsewhere_params.push_back(t.param);
      continue;
    }
    const at::Tensor given = g._values();
    on_cpu.push_back(i);
    cpu_params.push_back(t.param);
    cpu_given.push_back(given);
    cpu_values.push_back(given.is_contiguous() ? given : given.contiguous());
  }
  if (!on_cpu.empty()) {
    // Where no check is asked for, a flag that no step reads.
    const at::Tensor found = check ? flag : at::zeros({}, first.options().dtype(at::kFloat));
    const OptTensor inv = inv_scale.defined() ? OptTensor(inv_scale) : std::nullopt;
    // Every CPU table's op, each at its position in one telemetry pass over all their values.
    const auto sum_rows = [&](const OptTensor& slots, const OptTensor& sum_sq) {
      for (size_t k = 0; k < on_cpu.size(); ++k) {
        const SparseTable& t = tables[on_cpu[k]];
        auto [rows, sums] =
            ops::sparse_rows_sum_({t.param.grad()._indices(), cpu_values[k], t.param.size(0),
                                   found, inv, slots, sum_sq, static_cast<int64_t>(k)});
        lookups[on_cpu[k]] = {std::move(rows), std::move(sums)};
      }
    };
    if (telemetry != nullptr) {
      // The values' statistics, gathered in the same read straight into the record's slots.
      const at::Tensor sum_sq = at::zeros({1}, first.options().dtype(at::kFloat));
      telemetry->grad_stats_by(cpu_params, cpu_values, found, sum_sq, [&](const OptTensor& slots) {
        sum_rows(slots, slots ? OptTensor(sum_sq) : std::nullopt);
      });
    } else {
      sum_rows(std::nullopt, std::nullopt);
    }
    if (inv) {
      for (size_t k = 0; k < on_cpu.size(); ++k) {
        if (!cpu_values[k].is_same(cpu_given[k])) {
          cpu_given[k].copy_(cpu_values[k]);
        }
      }
    }
  }
  if (!check || elsewhere.empty()) {
    return flag;
  }
  const at::Tensor sum_sq = at::zeros({1}, flag.options());
  if (!inv_scale.defined()) {
    if (telemetry != nullptr) {
      telemetry->grad_stats(elsewhere_params, elsewhere, flag, sum_sq);
    } else {
      ops::grad_stats_({elsewhere, flag, sum_sq});
    }
    return flag;
  }
  if (telemetry != nullptr) {  // .grad unscaled, as torch leaves it
    telemetry->unscale_and_check(elsewhere_params, elsewhere, flag, inv_scale);
  } else {
    ops::unscale_and_check_({elsewhere, flag, inv_scale});
  }
  // The values as the ops will sum them: under a scale below 1 an FP16/BF16 value can overflow
  // only once unscaled (the CPU's fused pass checks the unscaled values too).
  ops::grad_stats_({elsewhere, flag, sum_sq});
  return flag;
}

// The table's operator; it returns before writing anything where `flag` is set.
void apply_table(SparseAlgorithm algorithm, const SparseTable& t, const Lookups& lookups,
                 const OptTensor& flag) {
  // Stepped through a view of its data (Python's p.data), as torch's optimizers step under
  // no_grad: the parameter's autograd history is not touched.
  const at::Tensor table = t.param.variable_data();
  const at::Tensor& indices = lookups.indices;
  const at::Tensor& values = lookups.values;
  const SparseHyper& h = t.hyper;
  ops::SparseRowsShared shared;
  shared.found_inf = flag;
  if (t.rounding_seed) {
    shared.rounding_seed = math::param_rounding_seed(*t.rounding_seed, t.index);
  }
  switch (algorithm) {
    case SparseAlgorithm::kSgd:
      ops::sparse_sgd_step_({table, t.master, indices, values,
                             t.state.empty() ? OptTensor() : OptTensor(t.state[0]), t.step, h.lr,
                             h.momentum, h.dampening, h.nesterov, h.maximize, shared});
      return;
    case SparseAlgorithm::kAdagrad:
      ops::sparse_adagrad_step_({table, t.master, indices, values, t.state[0], t.step, h.lr,
                                 h.lr_decay, h.eps, h.maximize, shared});
      return;
    case SparseAlgorithm::kAdam:
      ops::sparse_adam_step_({table, t.master, indices, values, t.state[0], t.state[1], t.step,
                              h.lr, h.beta1, h.beta2, h.eps, h.maximize, shared});
      return;
    case SparseAlgorithm::kRowWiseAdagrad:
      ops::sparse_rowwise_adagrad_step_({table, t.master, indices, values, t.state[0], t.step,
                                         h.lr, h.eps, h.maximize, shared});
      return;
  }
}

// The tables' gradients taken off their parameters while the dense engine steps (it would
// refuse them), and given back however that step ends.
class HiddenGrads {
 public:
  explicit HiddenGrads(const std::vector<SparseTable>& tables) {
    for (const SparseTable& t : tables) {
      hidden_.emplace_back(t.param, t.param.grad());
      t.param.mutable_grad() = at::Tensor();
    }
  }
  ~HiddenGrads() {
    for (auto& [param, grad] : hidden_) {
      param.mutable_grad() = std::move(grad);
    }
  }
  HiddenGrads(const HiddenGrads&) = delete;
  HiddenGrads& operator=(const HiddenGrads&) = delete;

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> hidden_;
};

void check_with_dense(const std::vector<SparseTable>& tables, const Optimizer& dense,
                      const std::string& who) {
  for (const SparseTable& t : tables) {
    TORCH_CHECK(dense.param_state(t.param).empty(), who, ": a parameter of shape ",
                python_shape(t.param.sizes()),
                " had a dense gradient in an earlier step and has a sparse one now");
  }
}

}  // namespace

void check_sparse_tables(const std::vector<SparseTable>& tables,
                         const SparseStepOptions& options) {
  for (const SparseTable& t : tables) {
    check_table(options.algorithm, t, options.who);
    TORCH_CHECK(t.param.device() == tables.front().param.device(), options.who,
                ": every table of a step must be on one device; got ",
                tables.front().param.device(), " and ", t.param.device());
  }
  const at::Tensor& flag = options.found_inf;
  TORCH_CHECK(!flag.defined() || tables.empty() || flag.device() == tables.front().param.device(),
              options.who, ": found_inf must be on the tables' device");
}

void check_sparse_master_weights(const MasterWeights& mode, const std::string& who) {
  TORCH_CHECK_VALUE(kernels::SparseRowStores::holds(mode.kind()), who,
                    ": master_weights=", mode.name(),
                    " is not supported for sparse tables, which take ",
                    MasterWeights::choices(&kernels::SparseRowStores::holds));
}

std::optional<std::pair<const char*, at::Tensor>> new_sparse_master(const at::Tensor& table,
                                                                    const MasterWeights& mode,
                                                                    const std::string& who) {
  check_sparse_master_weights(mode, who);
  const MasterModeInfo& info = mode.info();
  const at::ScalarType dtype = table.scalar_type();
  if (dtype != at::kHalf && dtype != at::kBFloat16) {
    return std::nullopt;
  }
  switch (info.kept) {
    case MasterKept::kFp32Master:
      return std::make_pair(kMasterParam, table.detach().to(at::kFloat));
    case MasterKept::kRemainder:
      return std::make_pair(kParamRemainder,
                            at::zeros(table.sizes(), table.options().dtype(info.kept_dtype)));
    default:
      return std::nullopt;
  }
}

at::Tensor sparse_step(const std::vector<SparseTable>& tables, const SparseStepOptions& options,
                       Optimizer* dense, GradTelemetrySink* telemetry) {
  at::NoGradGuard no_grad;
  if (tables.empty()) {
    return options.found_inf;
  }
  check_sparse_tables(tables, options);
  if (dense != nullptr) {
    check_with_dense(tables, *dense, options.who);
  }
  std::vector<Lookups> lookups;
  at::Tensor flag = check_values(tables, options, telemetry, lookups);
  if (dense != nullptr) {
    if (!flag.defined()) {
      flag = at::zeros({}, tables.front().param.options().dtype(at::kFloat));
    }
    const HiddenGrads hidden(tables);
    bool dense_grads = false;
    for (const at::Tensor& p : dense->all_params()) {
      dense_grads = dense_grads || p.grad().defined();
    }
    if (dense_grads) {
      // Its scaled step checks the dense gradients seeded with the tables' finding and leaves
      // the combined flag in `flag`.
      const at::Tensor scale =
          options.grad_scale.defined() ? options.grad_scale : at::ones_like(flag);
      dense->step_amp(scale, flag, telemetry);
    }
  }
  const OptTensor flag_arg = flag.defined() ? OptTensor(flag) : std::nullopt;
  for (size_t i = 0; i < tables.size(); ++i) {
    apply_table(options.algorithm, tables[i], lookups[i], flag_arg);
  }
  return flag;
}

}  // namespace fusedamp::optim
