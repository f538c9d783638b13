#pragma once
// fusedamp's operators for C++: each one's arguments, declared once (op_declaration.h), and the
// call that runs it through the dispatcher, so that CPU, CUDA and Meta tensors reach their own
// kernel exactly as torch.ops.fusedamp.<op> does from Python. What each operator does is written
// beside its schema, in csrc/schemas.cpp; the arguments below are the schema's, in its order.
//
//   fusedamp::ops::AdamStep a;          // every field starts at the schema's default
//   a.params = params; a.master_params = masters; a.grads = grads;
//   a.exp_avgs = m; a.exp_avg_sqs = v; a.steps = steps;
//   a.lr = 1e-3; a.beta1 = 0.9; a.beta2 = 0.999; a.eps = 1e-8; a.weight_decay = 0.01;
//   a.decoupled_weight_decay = true;
//   a.shared.inv_scale = inv_scale;     // the arguments both step ops take (StepShared)
//   fusedamp::ops::adam_step_(a);
//
// or, with the arguments in schema order: fusedamp::ops::unscale_and_check_({grads, found_inf,
// inv_scale}). The lists are views: the tensors they name must outlive the call.
#include <fusedamp/math/adam_math.h>
#include <fusedamp/math/lion_math.h>
#include <fusedamp/math/sgd_math.h>
#include <fusedamp/op_declaration.h>

#include <tuple>
#include <type_traits>
#include <utility>

namespace fusedamp::ops {

#define FUSEDAMP_UNSCALE_AND_CHECK_ARGS(X) \
  X(Tensors, grads)                        \
  X(Tensor, found_inf)                     \
  X(Tensor, inv_scale)                     \
  X(OptTensor, sum_sq)                     \
  X(OptTensor, telemetry)
FUSEDAMP_DECLARE_OP(UnscaleAndCheck, unscale_and_check_, FUSEDAMP_UNSCALE_AND_CHECK_ARGS);

#define FUSEDAMP_GRAD_STATS_ARGS(X) \
  X(Tensors, grads)                 \
  X(Tensor, found_inf)              \
  X(Tensor, sum_sq)                 \
  X(OptTensor, tensor_flags)        \
  X(OptTensor, telemetry)
FUSEDAMP_DECLARE_OP(GradStats, grad_stats_, FUSEDAMP_GRAD_STATS_ARGS);

#define FUSEDAMP_UPDATE_SCALE_ARGS(X) \
  X(Tensor, scale)                    \
  X(Tensor, growth_tracker)           \
  X(Tensor, hysteresis_tracker)       \
  X(Tensor, found_inf)                \
  X(Float, growth_factor)             \
  X(Float, backoff_factor)            \
  X(Int, growth_interval)             \
  X(Int, hysteresis)                  \
  X(OptFloat, min_scale)              \
  X(OptFloat, max_scale)              \
  X(OptTensor, amax)                  \
  X(OptFloat, amax_target)
FUSEDAMP_DECLARE_OP(UpdateScale, update_scale_, FUSEDAMP_UPDATE_SCALE_ARGS);

#define FUSEDAMP_RECORD_TELEMETRY_ARGS(X) \
  X(Tensor, ring)                         \
  X(Tensor, position)                     \
  X(Tensor, scale)                        \
  X(Tensor, found_inf)                    \
  X(Tensor, measured)                     \
  X(OptTensor, pass_sum_sq)
FUSEDAMP_DECLARE_OP(RecordTelemetry, record_telemetry_, FUSEDAMP_RECORD_TELEMETRY_ARGS);

#define FUSEDAMP_ACCOUNT_STEP_ARGS(X) \
  X(Tensor, step_applied)             \
  X(Tensor, skipped_steps)            \
  X(OptTensor, found_inf)             \
  X(OptTensor, found_inf_out)         \
  X(OptTensor, grad_sum_sq)           \
  X(OptTensor, inv_scale)             \
  X(OptTensor, grad_norm)
FUSEDAMP_DECLARE_OP(AccountStep, account_step_, FUSEDAMP_ACCOUNT_STEP_ARGS);

// The arguments both step ops take, at the same place in their schemas (after the
// algorithm's hyper-parameters): the device lr, the loss scaler's inputs, clipping, and how
// the weights and the gradients are written. One value, StepShared: each step op's `shared`.
#define FUSEDAMP_STEP_SHARED_ARGS(X) \
  X(OptTensor, lr_tensor)            \
  X(OptTensor, inv_scale)            \
  X(OptTensor, found_inf)            \
  X(OptTensor, grad_sum_sq)          \
  X(OptFloat, max_grad_norm)         \
  X(Bool, adopt_param_edits)         \
  X(Bool, write_back_grads)
FUSEDAMP_DECLARE_ARG_GROUP(StepShared, adam_step_, FUSEDAMP_STEP_SHARED_ARGS)

#define FUSEDAMP_ADAM_STEP_ARGS(X) \
  X(Tensors, params)               \
  X(Tensors, master_params)        \
  X(Tensors, grads)                \
  X(Tensors, exp_avgs)             \
  X(Tensors, exp_avg_sqs)          \
  X(Tensors, steps)                \
  X(Float, lr)                     \
  X(Float, beta1)                  \
  X(Float, beta2)                  \
  X(Float, eps)                    \
  X(Float, weight_decay)           \
  X(Bool, decoupled_weight_decay)  \
  X(Bool, maximize)                \
  X(StepShared, shared)            \
  X(OptTensors, max_exp_avg_sqs)   \
  X(OptInts, rounding_seeds)       \
  X(OptTensors, moment_scales)
FUSEDAMP_DECLARE_OP(AdamStep, adam_step_, FUSEDAMP_ADAM_STEP_ARGS);

#define FUSEDAMP_SGD_STEP_ARGS(X) \
  X(Tensors, params)              \
  X(Tensors, master_params)       \
  X(Tensors, grads)               \
  X(Tensors, momentum_buffers)    \
  X(Tensors, steps)               \
  X(Float, lr)                    \
  X(Float, momentum)              \
  X(Float, dampening)             \
  X(Float, weight_decay)          \
  X(Bool, nesterov)               \
  X(Bool, maximize)               \
  X(StepShared, shared)           \
  X(OptInts, rounding_seeds)      \
  X(OptTensors, momentum_scales)
FUSEDAMP_DECLARE_OP(SgdStep, sgd_step_, FUSEDAMP_SGD_STEP_ARGS);

#define FUSEDAMP_LION_STEP_ARGS(X) \
  X(Tensors, params)               \
  X(Tensors, master_params)        \
  X(Tensors, grads)                \
  X(Tensors, exp_avgs)             \
  X(Tensors, steps)                \
  X(Float, lr)                     \
  X(Float, beta1)                  \
  X(Float, beta2)                  \
  X(Float, weight_decay)           \
  X(Bool, maximize)                \
  X(StepShared, shared)            \
  X(OptInts, rounding_seeds)
FUSEDAMP_DECLARE_OP(LionStep, lion_step_, FUSEDAMP_LION_STEP_ARGS);

// The row-wise steps of an embedding table from its sparse gradient (schemas.cpp; their
// checks and kernels: ops/sparse_rows_args.h). The arguments all four take last, as one value.
#define FUSEDAMP_SPARSE_ROWS_SHARED_ARGS(X) \
  X(OptTensor, inv_scale)                  \
  X(OptTensor, found_inf)                  \
  X(OptInt, rounding_seed)
FUSEDAMP_DECLARE_ARG_GROUP(SparseRowsShared, sparse_sgd_step_, FUSEDAMP_SPARSE_ROWS_SHARED_ARGS)

#define FUSEDAMP_SPARSE_SGD_STEP_ARGS(X) \
  X(Tensor, table)                      \
  X(OptTensor, master)                  \
  X(Tensor, indices)                    \
  X(Tensor, values)                     \
  X(OptTensor, momentum_buffer)         \
  X(Tensor, step)                       \
  X(Float, lr)                          \
  X(Float, momentum)                    \
  X(Float, dampening)                   \
  X(Bool, nesterov)                     \
  X(Bool, maximize)                     \
  X(SparseRowsShared, shared)
FUSEDAMP_DECLARE_OP(SparseSgdStep, sparse_sgd_step_, FUSEDAMP_SPARSE_SGD_STEP_ARGS);

#define FUSEDAMP_SPARSE_ADAGRAD_STEP_ARGS(X) \
  X(Tensor, table)                          \
  X(OptTensor, master)                      \
  X(Tensor, indices)                        \
  X(Tensor, values)                         \
  X(Tensor, state_sum)                      \
  X(Tensor, step)                           \
  X(Float, lr)                              \
  X(Float, lr_decay)                        \
  X(Float, eps)                             \
  X(Bool, maximize)                         \
  X(SparseRowsShared, shared)
FUSEDAMP_DECLARE_OP(SparseAdagradStep, sparse_adagrad_step_, FUSEDAMP_SPARSE_ADAGRAD_STEP_ARGS);

#define FUSEDAMP_SPARSE_ADAM_STEP_ARGS(X) \
  X(Tensor, table)                       \
  X(OptTensor, master)                   \
  X(Tensor, indices)                     \
  X(Tensor, values)                      \
  X(Tensor, exp_avg)                     \
  X(Tensor, exp_avg_sq)                  \
  X(Tensor, step)                        \
  X(Float, lr)                           \
  X(Float, beta1)                        \
  X(Float, beta2)                        \
  X(Float, eps)                          \
  X(Bool, maximize)                      \
  X(SparseRowsShared, shared)
FUSEDAMP_DECLARE_OP(SparseAdamStep, sparse_adam_step_, FUSEDAMP_SPARSE_ADAM_STEP_ARGS);

#define FUSEDAMP_SPARSE_ROWWISE_ADAGRAD_STEP_ARGS(X) \
  X(Tensor, table)                                  \
  X(OptTensor, master)                              \
  X(Tensor, indices)                                \
  X(Tensor, values)                                 \
  X(Tensor, row_sum)                                \
  X(Tensor, step)                                   \
  X(Float, lr)                                      \
  X(Float, eps)                                     \
  X(Bool, maximize)                                 \
  X(SparseRowsShared, shared)
FUSEDAMP_DECLARE_OP(SparseRowWiseAdagradStep, sparse_rowwise_adagrad_step_,
                    FUSEDAMP_SPARSE_ROWWISE_ADAGRAD_STEP_ARGS);

// A sparse gradient's lookups summed per row (schemas.cpp; CPU): returns (rows, sums), whose
// sizes are data.
using RowsAndSums = std::tuple<Tensor, Tensor>;
#define FUSEDAMP_SPARSE_ROWS_SUM_ARGS(X) \
  X(Tensor, indices)                     \
  X(Tensor, values)                      \
  X(Int, num_rows)                       \
  X(Tensor, found_inf)                   \
  X(OptTensor, inv_scale)                \
  X(OptTensor, telemetry)                \
  X(OptTensor, sum_sq)                   \
  X(Int, position)
FUSEDAMP_DECLARE_OP_RETURNING(SparseRowsSum, sparse_rows_sum_, RowsAndSums,
                              FUSEDAMP_SPARSE_ROWS_SUM_ARGS);

// The row-wise step operators, one row each: X(Op, op, Algorithm), Algorithm the
// math::SparseRowsAlgorithm it runs.
#define FUSEDAMP_SPARSE_ROW_OPS(X)                                      \
  X(SparseSgdStep, sparse_sgd_step_, kSgd)                              \
  X(SparseAdagradStep, sparse_adagrad_step_, kAdagrad)                  \
  X(SparseAdamStep, sparse_adam_step_, kAdam)                           \
  X(SparseRowWiseAdagradStep, sparse_rowwise_adagrad_step_, kRowWiseAdagrad)

// The step algorithms, one row each: every layer loops over this list rather than naming an
// algorithm (the operators' registration, entry and checks, the CPU, CUDA, Meta and Autograd
// kernels, the engine's call, fusedamp.ops in Python).
//   X(Algorithm, Op, op, kernels)
//   Algorithm  math::Algorithm, its descriptor (math/<algorithm>_math.h): hyper-parameters
//              from the operator's arguments, their checks, its state lists, its update
//   Op, op     its operator's declaration above (ops::Op) and name (schemas.cpp defines it)
//   kernels    own: cpu/<algorithm>_kernel.cpp and cuda/<algorithm>_kernel.cu; generic: the
//              descriptor's element update in the shared step kernels (cpu/step_kernel.cpp,
//              cuda/step_kernel.cu)
#define FUSEDAMP_STEP_ALGORITHMS(X)       \
  X(Adam, AdamStep, adam_step_, own)      \
  X(Sgd, SgdStep, sgd_step_, own)          \
  X(Lion, LionStep, lion_step_, generic)

// Every operator, in the order of csrc/schemas.cpp: what registers each kernel and entry.
template <typename... Ops>
struct OpList {};
namespace detail {
template <typename... Ops>
OpList<Ops...> op_list(Lead, Ops...);
template <typename... A>
TypeList<A...> algorithm_list(Lead, A...);
}  // namespace detail
#define FUSEDAMP_STEP_OP_TYPE(Algorithm, Op, op, kernels) , std::declval<Op>()
#define FUSEDAMP_STEP_ALGORITHM_TYPE(Algorithm, Op, op, kernels) \
  , std::declval<::fusedamp::math::Algorithm>()
using AllOps = decltype(detail::op_list(
    detail::Lead{}, std::declval<UnscaleAndCheck>(), std::declval<GradStats>(),
    std::declval<UpdateScale>(), std::declval<RecordTelemetry>(),
    std::declval<AccountStep>() FUSEDAMP_STEP_ALGORITHMS(FUSEDAMP_STEP_OP_TYPE)));
// The descriptors, in the list's order.
using StepAlgorithms = decltype(detail::algorithm_list(
    detail::Lead{} FUSEDAMP_STEP_ALGORITHMS(FUSEDAMP_STEP_ALGORITHM_TYPE)));

// A step operator's algorithm (math::Adam for AdamStep, ...); none for the other operators.
template <typename Op>
struct StepAlgorithmOf {};
#define FUSEDAMP_STEP_ALGORITHM_OF(Algorithm, Op, op, kernels) \
  template <>                                                 \
  struct StepAlgorithmOf<Op> {                                \
    using type = ::fusedamp::math::Algorithm;                 \
  };
FUSEDAMP_STEP_ALGORITHMS(FUSEDAMP_STEP_ALGORITHM_OF)
#undef FUSEDAMP_STEP_ALGORITHM_OF

template <typename Op, typename = void>
struct IsStepOp : std::false_type {};
template <typename Op>
struct IsStepOp<Op, std::void_t<typename StepAlgorithmOf<Op>::type>> : std::true_type {};

void unscale_and_check_(const UnscaleAndCheck& args);
void grad_stats_(const GradStats& args);
void update_scale_(const UpdateScale& args);
void record_telemetry_(const RecordTelemetry& args);
void account_step_(const AccountStep& args);
#define FUSEDAMP_DECLARE_STEP_CALL(Algorithm, Op, op, kernels) void op(const Op& args);
FUSEDAMP_STEP_ALGORITHMS(FUSEDAMP_DECLARE_STEP_CALL)
#undef FUSEDAMP_DECLARE_STEP_CALL
#define FUSEDAMP_DECLARE_SPARSE_ROW_CALL(Op, op, Algorithm) void op(const Op& args);
FUSEDAMP_SPARSE_ROW_OPS(FUSEDAMP_DECLARE_SPARSE_ROW_CALL)
#undef FUSEDAMP_DECLARE_SPARSE_ROW_CALL
RowsAndSums sparse_rows_sum_(const SparseRowsSum& args);

}  // namespace fusedamp::ops
