#pragma once
// fusedamp::optim::sparse_step — one optimizer step over embedding tables with sparse
// gradients (nn.Embedding / nn.EmbeddingBag with sparse=True: COO gradients of one sparse and
// one dense dimension, one entry per lookup, duplicates included), each table stepped by its
// row-wise operator (fusedamp::sparse_{sgd,adagrad,adam,rowwise_adagrad}_step_).
//
// The caller owns the state (as torch's functional optimizers take theirs): the tables, their
// FP32 masters, the algorithm's state tensors and step counts are passed in and updated in
// place. A step is all or nothing, across the tables and, where given, the dense parameters
// of an engine optimizer:
//   1. every table is checked (gradient layout, shape, dtype, device, learning rate, and on
//      the CPU the index range) before anything is written;
//   2. every table's lookups are checked for inf/NaN into one flag (under a loss scale they are
//      unscaled in place, as torch leaves .grad): on the CPU in the pass that sums each
//      table's lookups per row (ops::sparse_rows_sum_), elsewhere in multi-tensor passes;
//   3. `dense`, where given, steps its parameters with that flag as its seed (it adds what it
//      finds in the dense gradients);
//   4. each table's operator runs, and returns before writing anything where the flag is set.
// Nothing is read back on the host, so a step does not synchronise with the device.
#include <ATen/core/Tensor.h>
#include <fusedamp/math/sparse_rows_math.h>
#include <fusedamp/telemetry.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fusedamp::optim {

class MasterWeights;
class Optimizer;

using SparseAlgorithm = math::SparseRowsAlgorithm;
// The algorithm's hyper-parameters for one table (the ones it does not take are ignored).
using SparseHyper = math::SparseRowsHyper;

// One table: the parameter (its .grad the sparse gradient), its master (FP16/BF16 tables with
// master weights), its state in the operator's order (SGD: the momentum buffer where momentum
// is not 0; Adagrad: sum; SparseAdam: exp_avg, exp_avg_sq; row-wise Adagrad: the row sums) and
// its step count (one FP32 element). A BF16 table without a master may be kept with
// stochastic rounding (master_weights "stochastic"): rounding_seed is then its group's seed,
// and with the table's index among its optimizer's parameters it gives the table's own stream
// (math::param_rounding_seed, as the dense engine seeds a parameter).
struct SparseTable {
  at::Tensor param;
  std::optional<at::Tensor> master;
  std::vector<at::Tensor> state;
  at::Tensor step;
  SparseHyper hyper;
  std::optional<int64_t> rounding_seed;
  int64_t index = 0;
};

struct SparseStepOptions {
  SparseAlgorithm algorithm = SparseAlgorithm::kSgd;
  // The loss scale the gradients carry (undefined: unscaled), the flag found so far (undefined:
  // none yet), and whether an inf/NaN gradient skips the step without a loss scale.
  at::Tensor grad_scale;
  at::Tensor found_inf;
  bool skip_nonfinite = true;
  // Who the error messages name (e.g. "fusedamp.optim.Adagrad").
  std::string who = "fusedamp::optim::sparse_step";
};

// Step 1 alone: throws (c10::Error, c10::ValueError for a negative learning rate) at the first
// table that cannot be stepped (its gradient, learning rate, number of state tensors); writes
// nothing. The operators check the rest of their arguments (state shapes, hyper-parameters).
void check_sparse_tables(const std::vector<SparseTable>& tables,
                         const SparseStepOptions& options);

// The sparse steps' master-weight modes (MasterWeights' names): True, an FP32 master; False,
// the table stepped in its own dtype; "split" / "split8", a BF16 table's int16 / int8
// remainders; "stochastic", a BF16 table rounded stochastically. Throws c10::ValueError naming
// `who` for another mode.
void check_sparse_master_weights(const MasterWeights& mode, const std::string& who);

// A table's master for its first step under `mode`, with its name in the table's state
// (param_state.h): an FP16/BF16 table's FP32 copy (master_param) or, in a split mode, its
// remainders, zero (param_remainder: weight + 0 is the weight); none for the table alone,
// stochastic rounding, and a float32 table in every mode (its own master). Checks `mode` as
// above; the step checks the rest (a float16 table has no split remainders).
std::optional<std::pair<const char*, at::Tensor>> new_sparse_master(const at::Tensor& table,
                                                                    const MasterWeights& mode,
                                                                    const std::string& who);

// The whole step. `dense` (optional): an engine optimizer whose parameters with dense
// gradients step between the check and the tables, seeded with the tables' flag; the tables'
// gradients are hidden from it meanwhile. `telemetry` is its gradient pass's sink. Returns the
// flag the step was decided by (undefined where nothing was checked).
at::Tensor sparse_step(const std::vector<SparseTable>& tables, const SparseStepOptions& options,
                       Optimizer* dense = nullptr, GradTelemetrySink* telemetry = nullptr);

}  // namespace fusedamp::optim
