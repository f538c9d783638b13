#pragma once
// The row-wise sparse step operators (declared in fusedamp/ops.h, FUSEDAMP_SPARSE_ROW_OPS):
// each one's arguments gathered into one SparseRowsOp, checked once for every backend (before
// anything is touched), and registered for a backend by implement_sparse_row_ops<Backend>(m),
// Backend::sparse_rows_step taking the checked SparseRowsOp.
#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>
#include <fusedamp/math/sparse_rows_math.h>
#include <fusedamp/math/telemetry_math.h>
#include <fusedamp/ops.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

#include "check_rules.h"
#include "kernel_of.h"
#include "static_switch.h"

namespace fusedamp::kernels {

using math::SparseRowsAlgorithm;
using math::SparseRowsHyper;

// The step's FP32 coefficient (math/sparse_rows_math.h), from the step count after it: SGD
// -lr, Adagrad -clr, SparseAdam -step_size, row-wise Adagrad lr. Formed on the host by the CPU
// and on the device by CUDA, which keeps the step count there.
C10_HOST_DEVICE inline float step_coefficient(SparseRowsAlgorithm algorithm,
                                              const SparseRowsHyper& h, double step_after) {
  switch (algorithm) {
    case SparseRowsAlgorithm::kAdagrad:
      return math::adagrad_neg_clr(h.lr, h.lr_decay, step_after);
    case SparseRowsAlgorithm::kAdam:
      return math::sparse_adam_neg_step_size(h.lr, h.beta1, h.beta2, step_after);
    case SparseRowsAlgorithm::kRowWiseAdagrad:
      return static_cast<float>(h.lr);
    default:
      return static_cast<float>(-h.lr);
  }
}

// How a table's weights may be kept between sparse steps: the table itself (FP32, or stepped in
// its FP16/BF16 dtype), an FP32 master, a BF16 table's int16 or int8 split remainders, BF16
// stochastic rounding. The kernels are instantiated for these stores only.
using SparseRowStores =
    WeightStoreSwitchOf<MasterModes::kOff, MasterModes::kFp32, MasterModes::kSplit,
                        MasterModes::kSplit8, MasterModes::kStochastic>;

// Whether a table of T kept as kStore is stepped (a float32 table is its own master).
template <typename T>
constexpr bool sparse_store_fits(WeightStore store) {
  return weight_store_fits<T>(store) && (store == MasterModes::kOff || !std::is_same_v<T, float>);
}

// A table's master, what its store keeps beside it: the FP32 master of an FP16/BF16 table, or
// a BF16 table's split remainders (int16, int8). Checked by the operators and, before any table
// is written, by the engine.
inline void check_sparse_master(const char* op, const at::Tensor& t, const at::Tensor& m) {
  const MasterModeInfo* info = master_mode_keeping(m.scalar_type(), t.scalar_type());
  const bool kept = info != nullptr && t.scalar_type() != at::kFloat &&
                    master_mode_fits(*info, t.scalar_type()) &&
                    SparseRowStores::holds(info->mode);
  TORCH_CHECK(kept, op, ": a ", t.scalar_type(), " table's master must be float32 (the master "
              "of a float16/bfloat16 table) or int16/int8 (a bfloat16 table's split remainders); "
              "got ", m.scalar_type());
  TORCH_CHECK(m.layout() == at::kStrided && m.sizes() == t.sizes() && m.is_contiguous() &&
                  m.device() == t.device(),
              op, ": master must be a contiguous tensor of the table's shape ", t.sizes(),
              " on its device");
  TORCH_CHECK(!m.is_alias_of(t), op, ": master shares memory with the table");
}

// A table rounded stochastically (a rounding_seed: any 64 bits, the table's own stream) is a
// bfloat16 one without a master. Checked by the operators and, before any table is written, by
// the engine.
inline void check_sparse_seed(const char* op, const at::Tensor& t, bool has_master, bool seeded) {
  TORCH_CHECK(!seeded || (t.scalar_type() == at::kBFloat16 && !has_master), op,
              ": rounding_seed (master_weights='stochastic') takes a bfloat16 table without a "
              "master; got a torch.", c10::getDtypeNames(t.scalar_type()).first, " table",
              has_master ? " with a master" : "");
}

struct SparseRowsOp {
  const char* op;
  SparseRowsAlgorithm algorithm;
  at::Tensor table;
  std::optional<at::Tensor> master;
  at::Tensor indices;             // [nnz] or [1, nnz], int64: a sparse gradient's _indices()
  at::Tensor values;              // [nnz, dim]: its _values(), duplicates included
  std::vector<at::Tensor> state;  // per algorithm: [rows, dim] FP32 tensors, or [rows] (row-wise)
  at::Tensor step;
  std::optional<at::Tensor> inv_scale;
  std::optional<at::Tensor> found_inf;
  SparseRowsHyper hyper;
  std::optional<int64_t> rounding_seed;

  bool has_master() const { return master && master->defined(); }
  // How the table's weights are kept (checked: check_sparse_master, a seed, or neither).
  WeightStore store() const {
    return master_mode_of_step(has_master(),
                               has_master() ? master->scalar_type() : c10::ScalarType::Undefined,
                               table.scalar_type(), rounding_seed.has_value(), false);
  }
};

inline bool given(const std::optional<at::Tensor>& t) { return t && t->defined(); }

// A one-element float32 tensor on the table's device (the dense ops' rule, check_rules.h).
inline void check_float_scalar(const SparseRowsOp& a, const at::Tensor& t, const char* name) {
  checks::rules::check_scalar(a.op, name, t, at::kFloat, a.table.device());
}

// The ranges are the dense steps' (hyper_params.h); the messages name the op's arguments.
inline void check_hyper(const SparseRowsOp& a) {
  const SparseRowsHyper& h = a.hyper;
  const auto finite_non_negative = [&](double v, const char* name) {
    TORCH_CHECK(hyper::finite_nonneg(v), a.op, ": invalid ", name, " ", v);
  };
  finite_non_negative(h.lr, "lr");
  finite_non_negative(h.eps, "eps");
  finite_non_negative(h.lr_decay, "lr_decay");
  finite_non_negative(h.momentum, "momentum");
  TORCH_CHECK(hyper::valid_dampening(h.dampening), a.op, ": invalid dampening ", h.dampening);
  TORCH_CHECK(hyper::valid_nesterov(h.nesterov, h.momentum, h.dampening), a.op,
              ": Nesterov momentum requires a momentum and zero dampening");
  if (a.algorithm == SparseRowsAlgorithm::kAdam) {
    TORCH_CHECK(hyper::valid_beta(h.beta1), a.op, ": invalid beta1 ", h.beta1);
    TORCH_CHECK(hyper::valid_beta(h.beta2), a.op, ": invalid beta2 ", h.beta2);
  }
}

// A sparse gradient's indices and values, as nn.Embedding's: [nnz] (or [1, nnz]) int64 rows
// and [nnz, dim] float values, on `device`; dim < 0: any width.
inline void check_lookups(const char* op, const at::Tensor& idx, const at::Tensor& v,
                          int64_t dim, const c10::Device& device) {
  TORCH_CHECK(idx.layout() == at::kStrided && idx.scalar_type() == at::kLong &&
                  (idx.dim() == 1 || (idx.dim() == 2 && idx.size(0) == 1)),
              op,
              ": indices must be int64 of shape [nnz] or [1, nnz] (one sparse dimension: "
              "the rows), got ",
              idx.scalar_type(), " of shape ", idx.sizes());
  TORCH_CHECK(v.layout() == at::kStrided && v.dim() == 2, op,
              ": values must be [nnz, dim] (a row-wise sparse gradient: one sparse and one "
              "dense dimension), got shape ",
              v.sizes());
  const int64_t nnz = idx.size(idx.dim() - 1);
  TORCH_CHECK(v.size(0) == nnz && (dim < 0 || v.size(1) == dim), op, ": values must be [", nnz,
              ", ", dim < 0 ? v.size(1) : dim, "] for ", nnz, " indices",
              dim < 0 ? "" : " into a table of that width", ", got ", v.sizes());
  const at::ScalarType vt = v.scalar_type();
  TORCH_CHECK(vt == at::kFloat || vt == at::kHalf || vt == at::kBFloat16, op,
              ": values must be float32, float16 or bfloat16, got ", vt);
  TORCH_CHECK(idx.device() == device && v.device() == device, op,
              ": indices and values must be on the table's device ", device);
  TORCH_CHECK(nnz < (int64_t{1} << 31), op, ": at most 2^31 - 1 lookups per step");
}

// sparse_rows_sum_'s arguments (it writes the values in place: they must be contiguous).
inline void check_sparse_rows_sum(const ops::SparseRowsSum& a) {
  const char* op = a.kShortName;
  const at::Tensor& values = a.values;
  check_lookups(op, a.indices, values, -1, values.device());
  TORCH_CHECK(values.is_contiguous(), op, ": values must be contiguous (unscaled in place)");
  TORCH_CHECK(a.num_rows >= 0, op, ": num_rows must be >= 0, got ", a.num_rows);
  checks::rules::check_scalar(op, "found_inf", a.found_inf, at::kFloat, values.device());
  if (given(a.inv_scale)) {
    checks::rules::check_scalar(op, "inv_scale", *a.inv_scale, at::kFloat, values.device());
  }
  if (given(a.telemetry)) {
    const at::Tensor& t = *a.telemetry;
    TORCH_CHECK(t.layout() == at::kStrided && t.scalar_type() == at::kDouble &&
                    t.numel() == math::kTelemetrySlots && t.is_contiguous() &&
                    t.device() == values.device(),
                op, ": telemetry must be a contiguous float64 tensor of ",
                math::kTelemetrySlots, " elements on the values' device");
  }
  if (given(a.sum_sq)) {
    checks::rules::check_scalar(op, "sum_sq", *a.sum_sq, at::kFloat, values.device());
  }
  TORCH_CHECK(!given(a.telemetry) || given(a.sum_sq), op, ": telemetry is gathered with sum_sq");
  TORCH_CHECK_VALUE(a.position >= 0, "fusedamp::", op, ": position must be >= 0, got ",
                    a.position);
}

// Everything the kernels assume, checked before any of them runs. The index range is checked
// by the backend as it buckets the lookups (also before anything is written).
inline void check_sparse_rows(const SparseRowsOp& a) {
  const at::Tensor& t = a.table;
  TORCH_CHECK(t.layout() == at::kStrided && t.dim() == 2, a.op,
              ": table must be a dense 2-D tensor [rows, dim], got ", t.layout(), " of shape ",
              t.sizes());
  const at::ScalarType dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, a.op,
              ": table must be float32, float16 or bfloat16, got ", dt);
  TORCH_CHECK(t.is_contiguous(), a.op, ": table must be contiguous");
  check_sparse_seed(a.op, t, a.has_master(), a.rounding_seed.has_value());
  if (a.has_master()) {
    check_sparse_master(a.op, t, *a.master);
  }
  check_lookups(a.op, a.indices, a.values, t.size(1), t.device());
  const bool row_wise = a.algorithm == SparseRowsAlgorithm::kRowWiseAdagrad;
  for (const at::Tensor& s : a.state) {
    const bool shape_ok =
        row_wise ? (s.dim() == 1 && s.size(0) == t.size(0)) : s.sizes() == t.sizes();
    TORCH_CHECK(s.layout() == at::kStrided && s.scalar_type() == at::kFloat && shape_ok &&
                    s.is_contiguous() && s.device() == t.device(),
                a.op, ": the state must be contiguous float32 tensors of shape ",
                row_wise ? "[rows]" : "the table's", " (", t.sizes(), ") on its device, got ",
                s.scalar_type(), " of shape ", s.sizes());
    TORCH_CHECK(!s.is_alias_of(t) && !(a.has_master() && s.is_alias_of(*a.master)), a.op,
                ": a state tensor shares memory with the table or its master");
  }
  for (size_t i = 0; i < a.state.size(); ++i) {
    for (size_t j = i + 1; j < a.state.size(); ++j) {
      TORCH_CHECK(!a.state[i].is_alias_of(a.state[j]), a.op, ": state tensors share memory");
    }
  }
  check_float_scalar(a, a.step, "step");
  if (given(a.inv_scale)) {
    check_float_scalar(a, *a.inv_scale, "inv_scale");
  }
  if (given(a.found_inf)) {
    check_float_scalar(a, *a.found_inf, "found_inf");
  }
  check_hyper(a);
}

template <typename Backend>
void run_sparse_rows(const SparseRowsOp& a) {
  check_sparse_rows(a);
  Backend::sparse_rows_step(a);
}

// Each operator's declaration (fusedamp/ops.h) as the one SparseRowsOp its checks and kernels
// take: the algorithm's state in the kernels' order and its hyper-parameters.
inline SparseRowsOp rows_op(const ops::SparseSgdStep& a) {
  TORCH_CHECK(given(a.momentum_buffer) == (a.momentum != 0.0), a.kShortName,
              ": a momentum buffer is given exactly when momentum != 0");
  std::vector<at::Tensor> state;
  if (given(a.momentum_buffer)) {
    state.push_back(*a.momentum_buffer);
  }
  SparseRowsHyper h{a.lr, a.momentum, a.dampening, a.nesterov, 0., 0., 0., 0., a.maximize};
  return {a.kShortName, SparseRowsAlgorithm::kSgd, a.table, a.master, a.indices, a.values,
          std::move(state), a.step, a.shared.inv_scale, a.shared.found_inf, h,
          a.shared.rounding_seed};
}

inline SparseRowsOp rows_op(const ops::SparseAdagradStep& a) {
  SparseRowsHyper h{a.lr, 0., 0., false, a.lr_decay, a.eps, 0., 0., a.maximize};
  return {a.kShortName, SparseRowsAlgorithm::kAdagrad, a.table, a.master, a.indices, a.values,
          {a.state_sum}, a.step, a.shared.inv_scale, a.shared.found_inf, h,
          a.shared.rounding_seed};
}

inline SparseRowsOp rows_op(const ops::SparseAdamStep& a) {
  SparseRowsHyper h{a.lr, 0., 0., false, 0., a.eps, a.beta1, a.beta2, a.maximize};
  return {a.kShortName, SparseRowsAlgorithm::kAdam, a.table, a.master, a.indices, a.values,
          {a.exp_avg, a.exp_avg_sq}, a.step, a.shared.inv_scale, a.shared.found_inf, h,
          a.shared.rounding_seed};
}

inline SparseRowsOp rows_op(const ops::SparseRowWiseAdagradStep& a) {
  SparseRowsHyper h{a.lr, 0., 0., false, 0., a.eps, 0., 0., a.maximize};
  return {a.kShortName, SparseRowsAlgorithm::kRowWiseAdagrad, a.table, a.master, a.indices,
          a.values, {a.row_sum}, a.step, a.shared.inv_scale, a.shared.found_inf, h,
          a.shared.rounding_seed};
}

// What the dispatcher's kernels (kernel_of.h) hand each operator's declaration to.
template <typename Backend>
struct SparseRowsEntry {
  template <typename Op>
  static void run(const Op& op) {
    run_sparse_rows<Backend>(rows_op(op));
  }
};

// Inside TORCH_LIBRARY_IMPL(fusedamp, <dispatch key>, m): the row-wise step operators.
template <typename Backend>
void implement_sparse_row_ops(torch::Library& m) {
#define FUSEDAMP_IMPLEMENT_SPARSE_ROW_OP(Op, op, Algorithm) \
  m.impl(#op, &KernelOf<ops::Op>::template kernel<SparseRowsEntry<Backend>>);
  FUSEDAMP_SPARSE_ROW_OPS(FUSEDAMP_IMPLEMENT_SPARSE_ROW_OP)
#undef FUSEDAMP_IMPLEMENT_SPARSE_ROW_OP
}

}  // namespace fusedamp::kernels
