#pragma once
// The CPU's row-wise sparse steps (math/sparse_rows_math.h): what the checked op hands the
// kernel, which is compiled once per instruction set (sparse_rows_kernel.cpp) like the dense
// step kernels (cpu_kernels.h).
#include <c10/core/ScalarType.h>

#include <cstdint>

#include "../ops/sparse_rows_args.h"

namespace fusedamp::cpu {

using SparseAlgorithm = kernels::SparseRowsAlgorithm;

// The lookups of one step, bucketed by row before the kernel runs: slot_of[k] is the slot of
// lookup k's row, rows[s] the row of slot s (first-lookup order), row_slot[r] the slot of row
// r or -1 (the table's row count long; read by the momentum pass, which visits every row).
struct SparseRowsStep {
  SparseAlgorithm algorithm;
  c10::ScalarType table_dtype;
  c10::ScalarType values_dtype;
  void* table;
  void* master;  // what store keeps beside the table (FP32 master, remainders); else nullptr
  WeightStore store;  // one of SparseRowStores
  uint64_t rounding_seed;  // kStochastic: the table's seed
  uint32_t counter;        // kStochastic: the step count before the update
  int64_t num_rows;
  int64_t dim;
  const void* values;  // [nnz, dim]; FP32 sums one per slot where nnz == num_slots
  int64_t nnz;
  const int32_t* slot_of;
  const int64_t* rows;
  int64_t num_slots;
  const int32_t* row_slot;
  float* state0;  // momentum buffer / Adagrad sum / exp_avg / row accumulators
  float* state1;  // exp_avg_sq
  float grad_mult;  // inverse loss scale, negated under maximize
  // Coefficients, FP32-rounded from the host's doubles (sparse_rows_math.h).
  float neg_lr;  // SGD: -lr; Adagrad: -clr; SparseAdam: -step_size; row-wise: lr
  float momentum;
  float one_minus_dampening;
  bool nesterov;
  bool first_step;
  float eps;
  float one_minus_beta1;
  float one_minus_beta2;
};

// sparse_rows_sum_'s lookups, bucketed as for a step: each lookup's values unscaled in place
// (where unscale) as unscale_and_check_ leaves a gradient, then added in FP32 into its slot's
// row of sums ([num_slots, dim], slots in first-lookup order), lookups in the order given.
struct SparseRowsSumPass {
  c10::ScalarType values_dtype;
  void* values;  // [nnz, dim]
  int64_t nnz;
  int64_t dim;
  const int32_t* slot_of;
  float* sums;
  bool unscale;
  float inv_scale;
  // With `stats`, what grad_stats_ sees in the values as given (before unscaling).
  bool stats;
};

// sparse_rows_sum's findings: whether a partial sum was non-finite, and with `stats` the
// values' largest finite magnitude, counts below the smallest normal (zeros included) and of
// zeros, and their sum of squares.
struct SparseRowsSumResult {
  bool nonfinite = false;
  double amax = 0.0;
  double n_small = 0.0;
  double n_zero = 0.0;
  double sum_sq = 0.0;
};

}  // namespace fusedamp::cpu
