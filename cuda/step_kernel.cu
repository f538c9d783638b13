// CUDA: the fused step of every algorithm whose kernels are generic (fusedamp/ops.h
// FUSEDAMP_STEP_ALGORITHMS): its descriptor's element update (math/<algorithm>_math.h, shared
// with cpu/step_kernel.cpp) over the step's lists. Memory traffic per element (P = param
// bytes, G = grad bytes, S = the state lists' bytes: 4 each FP32, 2 BF16):
//   with FP32 master weights: read G + 4 + S,     write P + 4 + S
//   split / kahan:            read G + P + 2 + S, write P + 2 + S
//   none / stochastic:        read G + P + S,     write P + S
// plus P read when masters adopt edits of the params (the default), G written when the
// multiplied grads are written back, and, per block of kChunk elements, the device scalars and
// the tensor's step count. The descriptor's per-tensor coefficients are formed by every
// thread (in FP64): an algorithm whose coefficients cost more (Adam's bias corrections) has
// kernels of its own. If *found_inf != 0 every block returns before touching memory; the step
// counts are advanced afterwards by advance_steps (bookkeeping.cu), which makes the same test.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

#include "../csrc/ops/static_switch.h"
#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"
#include "step_op.cuh"
#include "step_weights.cuh"

namespace fusedamp::cuda {
namespace {

// Elements in flight per thread, as adam_kernel.cu's: with the default 16, ptxas spilled 4
// bytes in Lion's kernel over FP16 params and grads with FP32 state and no master (80
// registers); allowed 128 registers instead (2 blocks per SM), it spilled 16 bytes under
// stochastic rounding (CUDA 13.0, sm_90).
constexpr int kGenericElemsPerThread = 8;

// List positions: params, grads, the algorithm's state lists, then the store's list.
template <typename Algorithm, WeightStore kStore>
struct GenericPositions : StepPositions<kStore, Algorithm::kStateLists> {};

// The descriptor's part of the dense step (step_op.cuh): its state lists and its update.
template <typename Algorithm, typename TS, WeightStore kStore>
struct GenericRule : StepRule<typename Algorithm::Hyper, GenericPositions<Algorithm, kStore>, TS,
                              kGenericElemsPerThread> {
  static constexpr int kLists = Algorithm::kStateLists;
  static constexpr int kArray = kLists > 0 ? kLists : 1;
  TS* state[kArray];
  typename Algorithm::Hyper h;
  typename Algorithm::Coeffs c;

  template <int L>
  struct State {
    float s[kArray][L];
  };
  // The block's start with the descriptor's per-tensor coefficients, formed by every thread.
  struct Start : StepBlock {
    typename Algorithm::Coeffs coeffs;
  };
  static __device__ __forceinline__ Start begin(const StepBatch<typename GenericRule::Pos>& b,
                                                const typename Algorithm::Hyper& h,
                                                const StepScalarPointers& s) {
    const ChunkRef ch = this_chunk(b);
    const float step_before = *static_cast<const float*>(b.extra[0][ch.t]);
    const auto coeffs = Algorithm::template coeffs<double>(h, s.learning_rate(), step_before);
    return {{ch, step_before, s.grad_multiplier()}, coeffs};
  }
  static __device__ __forceinline__ GenericRule at(
      const StepBatch<typename GenericRule::Pos>& b, const Start& start,
      const typename Algorithm::Hyper& h) {
    GenericRule rule{{}, {}, h, start.coeffs};
#pragma unroll
    for (int k = 0; k < kLists; ++k) {
      rule.state[k] = list_at<TS>(b, start.ch, true, GenericRule::Pos::kState + k);
    }
    return rule;
  }
  template <int L>
  __device__ __forceinline__ void load(int i, State<L>& r) const {
#pragma unroll
    for (int k = 0; k < kLists; ++k) {
      load_lanes<L>(state[k] + i, r.s[k]);
    }
  }
  template <int L>
  __device__ __forceinline__ void update(int l, float& p, float g, State<L>& r) const {
    float s[kArray];
#pragma unroll
    for (int k = 0; k < kLists; ++k) {
      s[k] = r.s[k][l];
    }
    Algorithm::update(p, s, g, h, c);
#pragma unroll
    for (int k = 0; k < kLists; ++k) {
      r.s[k][l] = s[k];
    }
  }
  template <int L>
  __device__ __forceinline__ void store(int i, const State<L>& r) const {
#pragma unroll
    for (int k = 0; k < kLists; ++k) {
      store_lanes<L>(state[k] + i, r.s[k]);
    }
  }
};

// GenericRule as dense_step takes a rule (its flags: none).
template <typename Algorithm>
struct GenericRuleOf {
  template <typename TS, WeightStore kStore, bool... kNoFlags>
  using Rule = GenericRule<Algorithm, TS, kStore>;
};

// The state lists are all of one dtype, FP32 or BF16 (the checks refuse 8-bit codes for an
// algorithm without block scales).
template <typename Algorithm>
void generic_step(const Step<typename Algorithm::Hyper>& step, const StepScalarPointers& s) {
  dense_step<GenericRuleOf<Algorithm>::template Rule>(step, s);
  advance_steps(step.steps, s.found_inf);
}

}  // namespace

// step<Algorithm> for each algorithm of the list with generic kernels.
#define FUSEDAMP_GENERIC_CUDA_STEP_own(Algorithm)
#define FUSEDAMP_GENERIC_CUDA_STEP_generic(Algorithm)                         \
  template <>                                                                 \
  void step<math::Algorithm>(const Step<math::Algorithm::Hyper>& step,        \
                             const StepScalarPointers& s) {                   \
    generic_step<math::Algorithm>(step, s);                                   \
  }
#define FUSEDAMP_GENERIC_CUDA_STEP(Algorithm, Op, op, kernels) \
  FUSEDAMP_GENERIC_CUDA_STEP_##kernels(Algorithm)
FUSEDAMP_STEP_ALGORITHMS(FUSEDAMP_GENERIC_CUDA_STEP)
#undef FUSEDAMP_GENERIC_CUDA_STEP
#undef FUSEDAMP_GENERIC_CUDA_STEP_generic
#undef FUSEDAMP_GENERIC_CUDA_STEP_own

}  // namespace fusedamp::cuda
