// CPU implementation of the row-wise sparse step operators (ops/sparse_rows_args.h checks
// them): a skipped step (found_inf set) returns before anything is read or written; the
// lookups are bucketed by row, every index checked against the table before the kernel writes
// anything; the step count advances after the kernel. And sparse_rows_sum_, the same
// bucketing and per-row FP32 sums, with the unscale and inf/NaN check fused into that pass.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "cpu_kernels.h"
#include "sparse_rows.h"

namespace fusedamp::cpu {
namespace {

// The lookups grouped by row: slot_of[k] for lookup k, rows[slot] in first-lookup order, and
// row_slot (the table's row count long, -1 where a row was not looked up) kept between steps
// and cleared of this step's rows on the way out, so that a step costs O(lookups) beyond the
// first.
class RowBuckets {
 public:
  RowBuckets(const int64_t* indices, int64_t nnz, int64_t num_rows, const char* op)
      : row_slot_(slots_of_rows()) {
    if (static_cast<int64_t>(row_slot_.size()) < num_rows) {
      row_slot_.resize(static_cast<size_t>(num_rows), -1);
    }
    slot_of.resize(static_cast<size_t>(nnz));
    for (int64_t k = 0; k < nnz; ++k) {
      const int64_t r = indices[k];
      if (C10_UNLIKELY(r < 0 || r >= num_rows)) {
        clear();
        TORCH_CHECK(false, op, ": index ", r, " (lookup ", k, ") is out of range for a table "
                    "of ", num_rows, " rows; nothing was modified");
      }
      int32_t& slot = row_slot_[static_cast<size_t>(r)];
      if (slot < 0) {
        slot = static_cast<int32_t>(rows.size());
        rows.push_back(r);
      }
      slot_of[static_cast<size_t>(k)] = slot;
    }
  }
  ~RowBuckets() { clear(); }
  RowBuckets(const RowBuckets&) = delete;
  RowBuckets& operator=(const RowBuckets&) = delete;

  const int32_t* row_slot() const { return row_slot_.data(); }

  std::vector<int32_t> slot_of;
  std::vector<int64_t> rows;

 private:
  static std::vector<int32_t>& slots_of_rows() {
    thread_local std::vector<int32_t> slots;
    return slots;
  }
  void clear() {
    for (const int64_t r : rows) {
      row_slot_[static_cast<size_t>(r)] = -1;
    }
    rows.clear();
  }
  std::vector<int32_t>& row_slot_;
};

struct CpuSparseRows {
  static void sparse_rows_step(const kernels::SparseRowsOp& a) {
    if (kernels::given(a.found_inf) && *a.found_inf->const_data_ptr<float>() != 0.f) {
      return;
    }
    const at::Tensor indices = a.indices.contiguous();
    const at::Tensor values = a.values.contiguous();
    const int64_t nnz = values.size(0);
    const RowBuckets buckets(indices.const_data_ptr<int64_t>(), nnz, a.table.size(0), a.op);

    const kernels::SparseRowsHyper& h = a.hyper;
    const float step_before = *a.step.const_data_ptr<float>();
    const double step_after = static_cast<double>(step_before) + 1.0;
    const float inv_scale =
        kernels::given(a.inv_scale) ? *a.inv_scale->const_data_ptr<float>() : 1.f;
    SparseRowsStep s{};
    s.algorithm = a.algorithm;
    s.table_dtype = a.table.scalar_type();
    s.values_dtype = values.scalar_type();
    s.table = a.table.mutable_data_ptr();
    s.master = a.has_master() ? a.master->mutable_data_ptr() : nullptr;
    s.store = a.store();
    s.rounding_seed = static_cast<uint64_t>(a.rounding_seed.value_or(0));
    s.counter = static_cast<uint32_t>(step_before);
    s.num_rows = a.table.size(0);
    s.dim = a.table.size(1);
    s.values = values.const_data_ptr();
    s.nnz = nnz;
    s.slot_of = buckets.slot_of.data();
    s.rows = buckets.rows.data();
    s.num_slots = static_cast<int64_t>(buckets.rows.size());
    s.row_slot = buckets.row_slot();
    s.state0 = a.state.empty() ? nullptr : a.state[0].mutable_data_ptr<float>();
    s.state1 = a.state.size() > 1 ? a.state[1].mutable_data_ptr<float>() : nullptr;
    s.grad_mult = h.maximize ? -inv_scale : inv_scale;
    s.momentum = static_cast<float>(h.momentum);
    s.one_minus_dampening = static_cast<float>(1.0 - h.dampening);
    s.nesterov = h.nesterov;
    s.first_step = step_before == 0.f;
    s.eps = static_cast<float>(h.eps);
    s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
    s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
    s.neg_lr = kernels::step_coefficient(a.algorithm, h, step_after);
    // torch's SparseAdam leaves a step without lookups alone (its count still advances).
    if (nnz > 0 || (a.algorithm == SparseAlgorithm::kSgd && !a.state.empty())) {
      kernels().sparse_rows(s);
    }
    *a.step.mutable_data_ptr<float>() = static_cast<float>(step_after);
  }
};

// sparse_rows_sum_: (the rows looked up, in first-lookup order; their lookups summed in FP32).
ops::RowsAndSums sparse_rows_sum(const ops::SparseRowsSum& a) {
  kernels::check_sparse_rows_sum(a);
  const at::Tensor& values = a.values;
  const at::Tensor idx = a.indices.contiguous();
  const int64_t nnz = values.size(0);
  const int64_t dim = values.size(1);
  const RowBuckets buckets(idx.const_data_ptr<int64_t>(), nnz, a.num_rows, a.kShortName);
  const auto num_slots = static_cast<int64_t>(buckets.rows.size());
  at::Tensor rows = at::empty({num_slots}, idx.options());
  std::copy(buckets.rows.begin(), buckets.rows.end(), rows.mutable_data_ptr<int64_t>());
  at::Tensor sums = at::empty({num_slots, dim}, values.options().dtype(at::kFloat));
  SparseRowsSumPass s{};
  s.values_dtype = values.scalar_type();
  s.values = values.mutable_data_ptr();
  s.nnz = nnz;
  s.dim = dim;
  s.slot_of = buckets.slot_of.data();
  s.sums = sums.mutable_data_ptr<float>();
  s.unscale = kernels::given(a.inv_scale);
  s.inv_scale = s.unscale ? *a.inv_scale->const_data_ptr<float>() : 1.f;
  s.stats = kernels::given(a.sum_sq);
  const SparseRowsSumResult r = kernels().sparse_rows_sum(s);
  if (r.nonfinite) {
    *a.found_inf.mutable_data_ptr<float>() = 1.f;
  }
  if (s.stats) {
    const GradTelemetry stats{r.amax, r.n_small - r.n_zero, r.n_zero,
                              r.nonfinite ? a.position : -1};
    write_stats(r.sum_sq, *a.sum_sq, kernels::given(a.telemetry) ? &stats : nullptr,
                a.telemetry);
  }
  return {rows, sums};
}

// What the dispatcher's kernel (kernel_of.h) hands sparse_rows_sum_'s declaration to.
struct SparseRowsSumEntry {
  static ops::RowsAndSums run(const ops::SparseRowsSum& a) { return sparse_rows_sum(a); }
};

}  // namespace
}  // namespace fusedamp::cpu

TORCH_LIBRARY_IMPL(fusedamp, CPU, m) {
  fusedamp::kernels::implement_sparse_row_ops<fusedamp::cpu::CpuSparseRows>(m);
  m.impl(fusedamp::ops::SparseRowsSum::kShortName,
         &fusedamp::kernels::KernelOf<fusedamp::ops::SparseRowsSum>::kernel<
             fusedamp::cpu::SparseRowsSumEntry>);
}
