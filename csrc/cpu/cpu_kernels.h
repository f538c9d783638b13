#pragma once
// The CPU hot loops. Each kernel file is compiled once per instruction set (DEFAULT, AVX2,
// AVX512; see CMakeLists.txt) into its own namespace; kernels() picks the best one the
// running CPU supports, honouring ATEN_CPU_CAPABILITY like torch does. Arguments have been
// validated (ops/checks.h) before any of these is called.
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <fusedamp/math/telemetry_math.h>
#include <fusedamp/ops.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "../ops/static_switch.h"
#include "../ops/step_lists.h"
#include "../ops/tensor_prefetch.h"
#include "checked_rows.h"

namespace fusedamp::cpu {

// A checked tensor's elements as T*: TensorImpl's inline accessor (which still checks the
// dtype), instead of the out-of-line Tensor::data_ptr<T>() — one call per tensor and list
// that showed up in host-time profiles of steps over many small tensors.
template <typename T>
C10_ALWAYS_INLINE T* elements_of(const at::Tensor& t) {
  return t.unsafeGetTensorImpl()->mutable_data_dtype_initialized<T>();
}

// What every CPU step kernel is given, whatever its algorithm: the lists (whose first tensors
// name the dtypes) and each position's element addresses (ops/step_lists.h; the master
// addresses are masters, remainders or compensations, as `store` says), the per-tensor step
// counts read before the update (the kernels never write them), the learning rate and the
// gradient multiplier (inverse scale times clip coefficient) read from the device scalars, and
// the step's modes (ops.h StepModes).
struct CpuStep {
  at::TensorList params;
  at::TensorList grads;
  const StepRow* rows;  // params.size() of them
  const float* steps_before;
  float lr;
  float grad_mult;
  WeightStore store;
  const int64_t* rounding_seeds;  // kStochastic: one per tensor; nullptr otherwise
  bool write_back_grads;
};

// Called as a step kernel reaches position i (at its first chunk): prefetches the elements of
// the row kRowsAhead positions later.
constexpr size_t kRowsAhead = 8;
C10_ALWAYS_INLINE void prefetch_elements_ahead(const CpuStep& step, int64_t i, int64_t begin) {
  const size_t ahead = static_cast<size_t>(i) + kRowsAhead;
  if (begin == 0 && ahead < step.params.size()) {
    prefetch_row_elements(step.rows[ahead]);
  }
}

// step_switch (static_switch.h) over a CpuStep's lists and modes: body(param, grad, kStore,
// more...).
template <typename Body, typename... More>
void step_switch(const CpuStep& step, Body&& body, const More&... more) {
  fusedamp::step_switch(step.params, step.grads, step.store, std::forward<Body>(body), more...);
}

// grad_stats's telemetry of one call (see math/telemetry_math.h).
struct GradTelemetry {
  double amax = 0.0;
  double n_subnormal = 0.0;
  double n_zero = 0.0;
  int64_t first_nonfinite = -1;  // list position; -1: none
};

// A statistics pass's results into the op's tensors (math::TelemetrySlot's combination rules).
inline void write_stats(double sq, const at::Tensor& sum_sq, const GradTelemetry* telemetry,
                        const std::optional<at::Tensor>& telemetry_out) {
  *sum_sq.data_ptr<float>() += static_cast<float>(sq);
  if (telemetry == nullptr) {
    return;
  }
  double* t = telemetry_out->data_ptr<double>();
  t[math::kAmax] = std::max(t[math::kAmax], telemetry->amax);
  t[math::kSubnormal] += telemetry->n_subnormal;
  t[math::kZero] += telemetry->n_zero;
  if (telemetry->first_nonfinite >= 0) {
    t[math::kFirstNonfinite] =
        std::min(t[math::kFirstNonfinite], static_cast<double>(telemetry->first_nonfinite));
  }
}

// A step algorithm's kernel (its descriptor's Hyper): the rows' state addresses are its
// state lists (state_lists of them, of state_dtype; FP32 where there are none), and with
// 8-bit state (state_dtype int8) the one after them their block scales.
template <typename Algorithm>
using StepKernel = void (*)(const CpuStep& step, at::ScalarType state_dtype, size_t state_lists,
                            const typename Algorithm::Hyper& h);

template <typename List>
struct StepKernelsOf;
template <typename... Algorithms>
struct StepKernelsOf<ops::detail::TypeList<Algorithms...>> {
  using type = std::tuple<StepKernel<Algorithms>...>;
};
// One kernel per algorithm of ops.h's FUSEDAMP_STEP_ALGORITHMS.
using StepKernels = typename StepKernelsOf<ops::StepAlgorithms>::type;

struct SparseRowsStep;  // sparse_rows.h: one row-wise sparse step, checked and bucketed
struct SparseRowsSumPass;  // sparse_rows.h: a sparse gradient's lookups, bucketed, to sum per row
struct SparseRowsSumResult;

struct KernelTable {
  // grads *= inv_scale; returns true if any element was non-finite. With sum_sq, also what
  // grad_stats adds to *sum_sq and *telemetry (optional), of the values before unscaling.
  bool (*unscale_and_check)(at::TensorList grads, float inv_scale, double* sum_sq,
                            GradTelemetry* telemetry);
  // Adds the sum of squares to *sum_sq; sets flags[i] = true where grads[i] is non-finite;
  // fills *telemetry when given. Returns true if any element was non-finite.
  bool (*grad_stats)(at::TensorList grads, double* sum_sq, std::vector<char>* flags,
                     GradTelemetry* telemetry);
  // grad_stats over gradients given by their elements (no flags), with the same results.
  bool (*grad_stats_spans)(const GradSpan* grads, size_t count, double* sum_sq,
                           GradTelemetry* telemetry);
  StepKernels steps;
  // The row-wise step of an embedding table from its sparse gradient (sparse_rows_kernel.cpp).
  void (*sparse_rows)(const SparseRowsStep& step);
  // A sparse gradient's lookups summed per row in FP32, unscaled first, with the values'
  // statistics where asked (sparse_rows_kernel.cpp).
  SparseRowsSumResult (*sparse_rows_sum)(const SparseRowsSumPass& sum);

  template <typename Algorithm>
  StepKernel<Algorithm> step() const {
    return std::get<StepKernel<Algorithm>>(steps);
  }
};

// Each instruction set's kernels: step<Algorithm> is defined for every algorithm of the list,
// by its own kernel file (own: cpu/<algorithm>_kernel.cpp) or by cpu/step_kernel.cpp
// (generic).
#define FUSEDAMP_DECLARE_CPU_STEP_KERNEL(Algorithm, Op, op, kernels)                         \
  template <>                                                                                \
  void step<math::Algorithm>(const CpuStep& s, at::ScalarType state_dtype, size_t state_lists, \
                             const math::Algorithm::Hyper& h);
#define FUSEDAMP_DECLARE_CPU_KERNELS(NS)                                                     \
  namespace NS {                                                                             \
  bool unscale_and_check(at::TensorList grads, float inv_scale, double* sum_sq,              \
                         GradTelemetry* telemetry);                                          \
  bool grad_stats(at::TensorList grads, double* sum_sq, std::vector<char>* flags,           \
                  GradTelemetry* telemetry);                                                 \
  bool grad_stats_spans(const GradSpan* grads, size_t count, double* sum_sq,                \
                        GradTelemetry* telemetry);                                           \
  template <typename Algorithm>                                                              \
  void step(const CpuStep& s, at::ScalarType state_dtype, size_t state_lists,               \
            const typename Algorithm::Hyper& h);                                             \
  FUSEDAMP_STEP_ALGORITHMS(FUSEDAMP_DECLARE_CPU_STEP_KERNEL)                                 \
  void sparse_rows_step(const SparseRowsStep& step);                                         \
  SparseRowsSumResult sparse_rows_sum(const SparseRowsSumPass& sum);                         \
  /* the table's entries, in the list's order */                                             \
  template <typename... Algorithms>                                                          \
  StepKernels step_kernels(ops::detail::TypeList<Algorithms...>) {                           \
    return StepKernels{&step<Algorithms>...};                                                \
  }                                                                                          \
  inline KernelTable kernel_table() {                                                        \
    return KernelTable{unscale_and_check, grad_stats, grad_stats_spans,                     \
                       step_kernels(ops::StepAlgorithms{}), sparse_rows_step,                \
                       sparse_rows_sum};                                                     \
  }                                                                                          \
  }

#if defined(CPU_CAPABILITY)  // a kernel file, compiled for one instruction set: its own
FUSEDAMP_DECLARE_CPU_KERNELS(CPU_CAPABILITY)
#else  // the library, which chooses among them (kernels())
FUSEDAMP_DECLARE_CPU_KERNELS(DEFAULT)
#if defined(FUSEDAMP_HAVE_AVX2)
FUSEDAMP_DECLARE_CPU_KERNELS(AVX2)
#endif
#if defined(FUSEDAMP_HAVE_AVX512)
FUSEDAMP_DECLARE_CPU_KERNELS(AVX512)
#endif
#endif

// The table for the running CPU (chosen once).
const KernelTable& kernels();

}  // namespace fusedamp::cpu
