// The one place where fusedamp's kernel operators are *defined*. Backends only implement them
// (cpu/register_cpu.cpp, meta/register_meta.cpp, ../cuda/register_cuda.cpp). Those through
// which a compiled graph runs the engine's step take Python objects and are declared in
// python/fusedamp/compiled_step.py.
// Every mutated list or tensor is annotated (a!) and every op returns (): the ops update
// gradients, optimizer state and the loss-scale state in place, on the device they live on.
#include <torch/library.h>

TORCH_LIBRARY(fusedamp, m) {
  // grads *= inv_scale; found_inf = 1 if any element of any grad is inf/NaN (never reset to 0).
  // Same contract as torch._amp_foreach_non_finite_check_and_unscale_. With sum_sq (and
  // telemetry, which needs it), also what grad_stats_ adds to them, of the values before they
  // are unscaled, in the same read.
  m.def(
      "unscale_and_check_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale, "
      "Tensor(c!)? sum_sq=None, Tensor(d!)? telemetry=None) -> ()");

  // Read-only pass over the grads: found_inf |= any non-finite; sum_sq += sum of squares of all
  // elements (FP32 accumulation); tensor_flags[i] = 1 where grads[i] holds a non-finite value.
  // telemetry (FP64[4], math/telemetry_math.h), in the same pass: [0] = max(itself, largest
  // finite |element|), [1] += elements that are nonzero but below their dtype's smallest normal
  // (subnormal), [2] += elements that are zero, [3] = min(itself, position of the first grad
  // holding inf/NaN); seed [3] with +inf for "none".
  m.def(
      "grad_stats_(Tensor[] grads, Tensor(a!) found_inf, Tensor(b!) sum_sq, "
      "Tensor(c!)? tensor_flags=None, Tensor(d!)? telemetry=None) -> ()");

  // Loss-scale state machine (growth, backoff, hysteresis, bounds) on device tensors.
  // amax_target (with amax, FP64[1]: this step's largest finite |scaled gradient|, as
  // grad_stats_'s telemetry gives it; negative: not measured): the amax policy of
  // math/scale_math.h.
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_tracker, "
      "Tensor found_inf, float growth_factor, float backoff_factor, int growth_interval, "
      "int hysteresis=1, float? min_scale=None, float? max_scale=None, Tensor? amax=None, "
      "float? amax_target=None) -> ()");

  // A loss scaler's telemetry record of one iteration (math/telemetry_math.h's columns): ring
  // (FP64 [capacity, 7]) row `position mod capacity` = [scale, found_inf, measured[0..3],
  // measured[4] + pass_sum_sq], then position (int64, one element: the records taken) += 1.
  // measured (FP64[5]) holds grad_stats_'s four telemetry slots and a sum of squares, and
  // pass_sum_sq (FP32) is a pass's sum not yet added (absent: 0). The row is chosen on the
  // device, so a replayed CUDA graph writes the next one. All on one device.
  m.def(
      "record_telemetry_(Tensor(a!) ring, Tensor(b!) position, Tensor scale, "
      "Tensor found_inf, Tensor measured, Tensor? pass_sum_sq=None) -> ()");

  // What a master-weight optimizer records after a step, in one kernel (math/
  // step_account_math.h): with found_inf (the step's flag), step_applied = 1 if it is 0 else 0,
  // skipped_steps += 1 if it is not 0, and found_inf_out (the loss scaler's flag) = found_inf;
  // without it (an unchecked step) step_applied = 1. With grad_norm (needs grad_sum_sq),
  // grad_norm = the global norm of the unscaled gradients, sqrt(grad_sum_sq) * inv_scale
  // (inv_scale absent: 1). step_applied, found_inf_out, grad_norm and the scalars are
  // one-element FP32 tensors, skipped_steps one-element int64, all on one device.
  m.def(
      "account_step_(Tensor(a!) step_applied, Tensor(b!) skipped_steps, Tensor? found_inf=None, "
      "Tensor(c!)? found_inf_out=None, Tensor? grad_sum_sq=None, Tensor? inv_scale=None, "
      "Tensor(d!)? grad_norm=None) -> ()");

  // Adam/AdamW step over lists. grads are multiplied
  // by inv_scale and by the clip coefficient derived from grad_sum_sq and max_grad_norm; if
  // found_inf is set nothing is modified (steps included). lr_tensor, when given, overrides lr.
  // adopt_param_edits: where params[i] differs from the rounding of master_params[i] (the model
  // was edited: a loaded snapshot, a clamp, a pruning mask), the master takes the param's value
  // before the update. write_back_grads: grads[i] receive the multiplied gradient (unscaled and
  // clipped), as torch's fused optimizers leave them. max_exp_avg_sqs, when given, is AMSGrad's
  // running maximum of exp_avg_sqs (one per param), used in the denominator.
  // How the weights are kept (master_weights: the modes of fusedamp/master_modes.h), from
  // master_params' dtype beside the params': empty = none (params rounded to nearest); float32
  // = FP32 masters; int16 or int8 (bfloat16 params) = remainders below the weight
  // (math/split_math.h); the params' own float16/bfloat16 = Kahan compensations
  // (math/kahan_math.h). rounding_seeds (one per tensor, bfloat16 params, no master_params):
  // stochastic rounding from the counter (seed, step count, element index)
  // (math/stochastic_rounding_math.h). The state lists (moments,
  // AMSGrad maxima, momentum buffers) are all float32 or all bfloat16, or (Adam without
  // AMSGrad) quantized: exp_avgs int8 and exp_avg_sqs uint8 codes with moment_scales (one
  // contiguous float32 [ceil(numel / 32), 2] tensor per param: each block of 32 elements'
  // exp_avg and exp_avg_sq scales), read and rewritten by the step
  // (math/quantized_moments_math.h).
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor(b!)[] master_params, Tensor(f!)[] grads, "
      "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] steps, *, float lr, "
      "float beta1, float beta2, float eps, float weight_decay, bool decoupled_weight_decay, "
      "bool maximize=False, Tensor? lr_tensor=None, Tensor? inv_scale=None, "
      "Tensor? found_inf=None, Tensor? grad_sum_sq=None, float? max_grad_norm=None, "
      "bool adopt_param_edits=True, bool write_back_grads=False, "
      "Tensor(g!)[]? max_exp_avg_sqs=None, int[]? rounding_seeds=None, "
      "Tensor(h!)[]? moment_scales=None) -> ()");

  // SGD (momentum, dampening, Nesterov, weight decay) with the same contract (weights kept as
  // adam_step_'s). momentum_buffers is empty when momentum == 0; they are float32 or bfloat16, or
  // quantized: int8 codes (exp_avg's format) with momentum_scales (one contiguous float32
  // [ceil(numel / 32), 1] tensor per param: each block of 32 elements' scale), read and
  // rewritten by the step (math/quantized_moments_math.h).
  m.def(
      "sgd_step_(Tensor(a!)[] params, Tensor(b!)[] master_params, Tensor(e!)[] grads, "
      "Tensor(c!)[] momentum_buffers, Tensor(d!)[] steps, *, float lr, float momentum, "
      "float dampening, float weight_decay, bool nesterov, bool maximize=False, "
      "Tensor? lr_tensor=None, Tensor? inv_scale=None, Tensor? found_inf=None, "
      "Tensor? grad_sum_sq=None, float? max_grad_norm=None, bool adopt_param_edits=True, "
      "bool write_back_grads=False, int[]? rounding_seeds=None, "
      "Tensor(f!)[]? momentum_scales=None) -> ()");

  // Lion (math/lion_math.h: the sign of an interpolated momentum, decoupled weight decay) with
  // the same contract (weights kept as adam_step_'s); exp_avgs float32 or bfloat16.
  m.def(
      "lion_step_(Tensor(a!)[] params, Tensor(b!)[] master_params, Tensor(d!)[] grads, "
      "Tensor(c!)[] exp_avgs, Tensor(e!)[] steps, *, float lr, float beta1, float beta2, "
      "float weight_decay, bool maximize=False, Tensor? lr_tensor=None, "
      "Tensor? inv_scale=None, Tensor? found_inf=None, Tensor? grad_sum_sq=None, "
      "float? max_grad_norm=None, bool adopt_param_edits=True, bool write_back_grads=False, "
      "int[]? rounding_seeds=None) -> ()");
  // Row-wise steps of an embedding table from its sparse gradient (indices [nnz] or [1, nnz]
  // and values [nnz, dim] of nn.Embedding/EmbeddingBag(sparse=True)'s COO gradient, duplicates
  // included: summed per row in FP32 inside the op). Only the rows looked up are read and
  // written (SGD with momentum: every row, its buffer dense). table float32, or float16/bfloat16
  // with an FP32 master of its shape (absent: stepped in its own dtype); state float32, of the
  // table's shape ([rows] for the row-wise accumulators); step a one-element float32 count of
  // applied steps. Values are multiplied by inv_scale; if found_inf is set nothing is modified
  // (step included). rounding_seed: a bfloat16 table without a master is stored with stochastic
  // rounding (master_weights "stochastic"; the bits from the seed, the step count before the
  // update and the element's index in the table). Formulas and their order:
  // math/sparse_rows_math.h.
  m.def(
      "sparse_sgd_step_(Tensor(a!) table, Tensor(b!)? master, Tensor indices, Tensor values, "
      "Tensor(c!)? momentum_buffer, Tensor(d!) step, *, float lr, float momentum=0., "
      "float dampening=0., bool nesterov=False, bool maximize=False, Tensor? inv_scale=None, "
      "Tensor? found_inf=None, int? rounding_seed=None) -> ()");
  m.def(
      "sparse_adagrad_step_(Tensor(a!) table, Tensor(b!)? master, Tensor indices, "
      "Tensor values, Tensor(c!) state_sum, Tensor(d!) step, *, float lr, float lr_decay=0., "
      "float eps=1e-10, bool maximize=False, Tensor? inv_scale=None, "
      "Tensor? found_inf=None, int? rounding_seed=None) -> ()");
  m.def(
      "sparse_adam_step_(Tensor(a!) table, Tensor(b!)? master, Tensor indices, Tensor values, "
      "Tensor(c!) exp_avg, Tensor(d!) exp_avg_sq, Tensor(e!) step, *, float lr, float beta1, "
      "float beta2, float eps, bool maximize=False, Tensor? inv_scale=None, "
      "Tensor? found_inf=None, int? rounding_seed=None) -> ()");
  // A sparse gradient's lookups summed per row in FP32 ahead of a step, the inf/NaN check fused
  // into that one read of the values (CPU). Returns (rows [u] int64: the rows looked up, in
  // first-lookup order; sums [u, dim] float32): each row's lookups added in the order given,
  // the sums a step op above takes as its indices and values for the same bits. With inv_scale
  // each value is first multiplied by it and written back into values (in their dtype, as
  // unscale_and_check_ leaves a gradient), the value written being the one added. found_inf
  // is set to 1 if a sum is not finite (an inf/NaN lookup, or FP32 overflow), else left as is.
  // telemetry (FP64[4]) and sum_sq (FP32[1]), where given, gather grad_stats_'s over the values
  // as given (before unscaling) in the same read: combined into what they hold, these values at
  // `position` in the gradient list the telemetry counts (a non-finite one makes it the first
  // non-finite position where it is below the one held). An index outside [0, num_rows) is an
  // error before anything is written.
  m.def(
      "sparse_rows_sum_(Tensor indices, Tensor(a!) values, int num_rows, Tensor(b!) found_inf, "
      "*, Tensor? inv_scale=None, Tensor(c!)? telemetry=None, Tensor(d!)? sum_sq=None, "
      "int position=0) -> "
      "(Tensor rows, Tensor sums)");
  // Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD): row_sum [rows] += mean of g^2 over the
  // row; the row moves by -lr / (sqrt(row_sum) + eps) * g.
  m.def(
      "sparse_rowwise_adagrad_step_(Tensor(a!) table, Tensor(b!)? master, Tensor indices, "
      "Tensor values, Tensor(c!) row_sum, Tensor(d!) step, *, float lr, float eps=1e-10, "
      "bool maximize=False, Tensor? inv_scale=None, Tensor? found_inf=None, int? rounding_seed=None) -> ()");
}
