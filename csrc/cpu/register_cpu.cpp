// CPU implementations of the fusedamp operators: after the checks (kernel_entry.h), read the
// device scalars (on the CPU they are plain memory), run the vectorised kernel for this CPU,
// then update the step counts.
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <fusedamp/math/scale_math.h>
#include <fusedamp/math/step_account_math.h>
#include <fusedamp/math/telemetry_math.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "../ops/kernel_entry.h"
#include "../ops/scratch_vector.h"
#include "checked_rows.h"
#include "cpu_kernels.h"

namespace fusedamp::cpu {

const KernelTable& kernels() {
  static const KernelTable table = [] {
    // at::get_cpu_capability() already honours ATEN_CPU_CAPABILITY.
    const std::string cap = at::get_cpu_capability();
#if defined(FUSEDAMP_HAVE_AVX512)
    if (cap == "AVX512") {
      return AVX512::kernel_table();
    }
#endif
#if defined(FUSEDAMP_HAVE_AVX2)
    if (cap == "AVX512" || cap == "AVX2") {
      return AVX2::kernel_table();
    }
#endif
    return DEFAULT::kernel_table();
  }();
  return table;
}

namespace {

using at::TensorList;

// The rows again through the tensors' mutable accessors, where the checks could not take an
// address without them (StepRows::needs_mutable_access): those give copy-on-write storage its
// own copy first, or raise torch's error.
template <typename Hyper>
void take_mutable_addresses(const Step<Hyper>& step) {
  const auto address = [](const at::Tensor& t) { return t.mutable_data_ptr(); };
  StepRows& rows = *step.rows;
  for (size_t i = 0; i < step.params.size(); ++i) {
    StepRow& row = rows.rows[i];
    row.numel = step.params[i].numel();
    row.param = address(step.params[i]);
    row.grad = address(step.grads[i]);
    row.master = step.master_params.empty() ? nullptr : address(step.master_params[i]);
    for (size_t k = 0; k < step.state.count; ++k) {
      row.state[k] = address(step.state.lists[k][i]);
    }
    if (!step.block_scales.empty()) {  // quantized state: the scales after the state lists
      row.state[step.state.count] = address(step.block_scales[i]);
    }
    row.step = step.steps[i].template mutable_data_ptr<float>();
  }
  rows.needs_mutable_access = false;
}

// The step counts: read before the kernel, advanced after it. The kernel itself only reads
// the "before" values, so an exception in between leaves them untouched. Each count is a
// one-element tensor of its own, so each is a cache miss of its own in both walks (after the
// kernel's walk over thousands of tensors they are out of cache again): the walks ask for the
// count kCountsAhead rows later, so that the misses overlap instead of queueing (perf: the walk
// before the kernel was 5% of a whole AMP step over 10,000 one-element tensors).
constexpr size_t kCountsAhead = 16;

struct StepCounts {
  const std::vector<StepRow>& rows;
  ScratchVector<float> before;

  explicit StepCounts(const std::vector<StepRow>& step_rows)
      : rows(step_rows), before(step_rows.size()) {
    const size_t n = rows.size();
    for (size_t i = 0; i < n; ++i) {
      if (i + kCountsAhead < n) {
        __builtin_prefetch(rows[i + kCountsAhead].step);
      }
      before[i] = *rows[i].step;
    }
  }
  void advance() const {
    const size_t n = rows.size();
    for (size_t i = 0; i < n; ++i) {
      if (i + kCountsAhead < n) {
        __builtin_prefetch(rows[i + kCountsAhead].step, 1);
      }
      *rows[i].step += 1.f;
    }
  }
};

// A step's device scalars are plain memory here: read once, for all tensors. A skipped step
// returns before anything is read or written.
template <typename Hyper, typename Kernel>
void run_step(const Step<Hyper>& step, const Kernel& kernel) {
  const StepScalarPointers scalars = step.scalar_pointers();
  if (scalars.skipped()) {
    return;
  }
  const float lr = scalars.learning_rate();
  TORCH_CHECK(lr >= 0.f && lr - lr == 0.f, step.op, ": lr_tensor holds an invalid lr ", lr);
  if (C10_UNLIKELY(step.rows->needs_mutable_access)) {
    take_mutable_addresses(step);
  }
  const std::vector<StepRow>& rows = step.rows->rows;
  const StepCounts counts(rows);
  kernel(CpuStep{step.params, step.grads, rows.data(), (*counts.before).data(), lr,
                 scalars.grad_multiplier(), step.weight_store(),
                 step.rounding_seeds.empty() ? nullptr : step.rounding_seeds.data(),
                 step.shared->write_back_grads});
  counts.advance();
}

// What the CPU does once kernel_entry.h has checked the arguments.
struct CpuOps {
  static void unscale_and_check(const ops::UnscaleAndCheck& op) {
    const bool want_stats = op.sum_sq && op.sum_sq->defined();
    const bool want_telemetry = op.telemetry && op.telemetry->defined();
    double sq = 0.0;
    GradTelemetry telemetry;
    if (kernels().unscale_and_check(op.grads, *op.inv_scale.const_data_ptr<float>(),
                                    want_stats ? &sq : nullptr,
                                    want_telemetry ? &telemetry : nullptr)) {
      *op.found_inf.data_ptr<float>() = 1.f;
    }
    if (want_stats) {
      write_stats(sq, *op.sum_sq, want_telemetry ? &telemetry : nullptr, op.telemetry);
    }
  }

  static void grad_stats(const ops::GradStats& op) {
    const bool want_flags = op.tensor_flags && op.tensor_flags->defined();
    std::vector<char> flags(want_flags ? op.grads.size() : 0, 0);
    double sq = 0.0;
    const bool want_telemetry = op.telemetry && op.telemetry->defined();
    GradTelemetry telemetry;
    const bool any = kernels().grad_stats(op.grads, &sq, want_flags ? &flags : nullptr,
                                          want_telemetry ? &telemetry : nullptr);
    write_stats(sq, op.sum_sq, want_telemetry ? &telemetry : nullptr, op.telemetry);
    if (any) {
      *op.found_inf.data_ptr<float>() = 1.f;
    }
    if (want_flags) {
      float* f = op.tensor_flags->data_ptr<float>();
      for (size_t i = 0; i < flags.size(); ++i) {
        if (flags[i]) {
          f[i] = 1.f;
        }
      }
    }
  }

  static void update_scale(const ops::UpdateScale& op) {
    math::update_scale(*op.scale.data_ptr<float>(), *op.growth_tracker.data_ptr<int32_t>(),
                       *op.hysteresis_tracker.data_ptr<int32_t>(),
                       *op.found_inf.const_data_ptr<float>() != 0.f, kernels::scale_hyper(op),
                       op.amax && op.amax->defined() ? *op.amax->const_data_ptr<double>() : -1.0);
  }

  static void record_telemetry(const ops::RecordTelemetry& op) {
    int64_t& position = *op.position.data_ptr<int64_t>();
    const int64_t row = math::telemetry_row(position, op.ring.size(0));
    math::write_telemetry_row(
        op.ring.data_ptr<double>() + row * math::kTelemetryColumns,
        *op.scale.const_data_ptr<float>(), *op.found_inf.const_data_ptr<float>(),
        op.measured.const_data_ptr<double>(),
        op.pass_sum_sq && op.pass_sum_sq->defined() ? op.pass_sum_sq->const_data_ptr<float>()
                                                     : nullptr);
    position += 1;
  }

  static void account_step(const ops::AccountStep& op) {
    const auto given = [](const std::optional<at::Tensor>& t) { return t && t->defined(); };
    // Every input is read before anything is written: found_inf_out may be found_inf itself.
    const float found = given(op.found_inf) ? *op.found_inf->const_data_ptr<float>() : 0.f;
    const float norm =
        given(op.grad_norm)
            ? math::unscaled_grad_norm(
                  *op.grad_sum_sq->const_data_ptr<float>(),
                  given(op.inv_scale) ? *op.inv_scale->const_data_ptr<float>() : 1.f)
            : 0.f;
    *op.step_applied.data_ptr<float>() = math::step_applied(found);
    *op.skipped_steps.data_ptr<int64_t>() += math::steps_skipped(found);
    if (given(op.found_inf_out)) {
      *op.found_inf_out->data_ptr<float>() = found;
    }
    if (given(op.grad_norm)) {
      *op.grad_norm->data_ptr<float>() = norm;
    }
  }

  // The step kernels walk the element addresses the checks take (step_lists.h).
  static constexpr bool kTakesRows = true;

  // Every algorithm's step: its kernel for this CPU over the rows, with its state lists'
  // dtype (FP32 where it has none) and number.
  template <typename Algorithm>
  static void step(const Step<typename Algorithm::Hyper>& step) {
    const size_t lists = step.state.count;
    const at::ScalarType state_dtype =
        lists != 0 ? step.state.lists[0][0].scalar_type() : at::kFloat;
    run_step(step, [&](const CpuStep& cpu_step) {
      kernels().step<Algorithm>()(cpu_step, state_dtype, lists, step.hyper);
    });
  }
};

}  // namespace

template <typename Op>
void step_on_checked_rows(const Op& args, StepRows& rows) {
  kernels::run_step_on_checked_rows(args, rows, &CpuOps::step<AlgorithmOf<Op>>);
}

void grad_stats_on_checked_rows(const ops::GradStats& op, const std::vector<GradSpan>& grads) {
  TORCH_INTERNAL_ASSERT(op.grads.empty() && !(op.tensor_flags && op.tensor_flags->defined()));
  checks::grad_stats(op);
  const bool want_telemetry = op.telemetry && op.telemetry->defined();
  double sq = 0.0;
  GradTelemetry telemetry;
  const bool any = kernels().grad_stats_spans(grads.data(), grads.size(), &sq,
                                              want_telemetry ? &telemetry : nullptr);
  write_stats(sq, op.sum_sq, want_telemetry ? &telemetry : nullptr, op.telemetry);
  if (any) {
    *op.found_inf.data_ptr<float>() = 1.f;
  }
}

#define FUSEDAMP_CPU_STEP_ON_CHECKED_ROWS(Algorithm, Op, op, kernels) \
  template void step_on_checked_rows(const ops::Op& args, StepRows& rows);
FUSEDAMP_STEP_ALGORITHMS(FUSEDAMP_CPU_STEP_ON_CHECKED_ROWS)
#undef FUSEDAMP_CPU_STEP_ON_CHECKED_ROWS

}  // namespace fusedamp::cpu

TORCH_LIBRARY_IMPL(fusedamp, CPU, m) {
  fusedamp::kernels::implement_ops<fusedamp::cpu::CpuOps>(m);
}
