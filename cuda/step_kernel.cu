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
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include "../csrc/ops/static_switch.h"
#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"
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

template <typename Algorithm, WeightStore kStore>
using GenericBatch = StepBatch<GenericPositions<Algorithm, kStore>>;

template <typename Algorithm, typename TP, typename TG, WeightStore kStore, typename TS>
struct GenericOp {
  static constexpr int kLists = Algorithm::kStateLists;
  static constexpr int kArray = kLists > 0 ? kLists : 1;
  StepWeights<TP, kStore> weights;
  StepGrads<TG> grads;
  TS* state[kArray];
  typename Algorithm::Hyper h;
  typename Algorithm::Coeffs c;
  float mult;

  template <int L>
  struct Regs {
    float p[L], g[L], s[kArray][L];
  };
  template <int L>
  __device__ __forceinline__ void load(int i, Regs<L>& r) const {
    grads.load(i, r.g);
    weights.load(i, r.p);
#pragma unroll
    for (int k = 0; k < kLists; ++k) {
      load_lanes<L>(state[k] + i, r.s[k]);
    }
  }
  template <int L>
  __device__ __forceinline__ void apply(int i, Regs<L>& r) const {
    grads.multiply_and_write_back(i, r.g, mult);
#pragma unroll
    for (int l = 0; l < L; ++l) {
      float s[kArray];
#pragma unroll
      for (int k = 0; k < kLists; ++k) {
        s[k] = r.s[k][l];
      }
      Algorithm::update(r.p[l], s, r.g[l], h, c);
#pragma unroll
      for (int k = 0; k < kLists; ++k) {
        r.s[k][l] = s[k];
      }
    }
  }
  template <int L>
  __device__ __forceinline__ void store(int i, const Regs<L>& r) const {
#pragma unroll
    for (int k = 0; k < kLists; ++k) {
      store_lanes<L>(state[k] + i, r.s[k]);
    }
    weights.store(i, r.p);
  }
};

template <typename Algorithm, typename TP, typename TG, WeightStore kStore, typename TS>
__global__ void __launch_bounds__(kThreads)
    generic_step_kernel(const __grid_constant__ GenericBatch<Algorithm, kStore> b,
                        typename Algorithm::Hyper h, StepScalarPointers s,
                        bool write_back_grads) {
  using Pos = GenericPositions<Algorithm, kStore>;
  if (s.skipped()) {
    return;  // skipped step: nothing is read or written
  }
  const ChunkRef ch = this_chunk(b);
  const float step_before = *static_cast<const float*>(b.extra[0][ch.t]);
  GenericOp<Algorithm, TP, TG, kStore, TS> op{
      step_weights_at<TP, kStore>(b, ch, Pos::kP, Pos::kStore, step_before),
      {list_at<TG>(b, ch, true, Pos::kG), write_back_grads},
      {},
      h,
      Algorithm::template coeffs<double>(h, s.learning_rate(), step_before),
      s.grad_multiplier()};
#pragma unroll
  for (int k = 0; k < Algorithm::kStateLists; ++k) {
    op.state[k] = list_at<TS>(b, ch, true, Pos::kState + k);
  }
  constexpr int W = vec_width_of<TP, TG, TS>();
  chunk_loop<W, kGenericElemsPerThread>(op, ch.n, ch.aligned);
}

template <typename Algorithm, typename TP, typename TG, WeightStore kStore, typename TS>
void launch(const Step<typename Algorithm::Hyper>& step, const StepScalarPointers& s) {
  launch_step<GenericPositions<Algorithm, kStore>, TP, TG, TS>(
      step, s, &generic_step_kernel<Algorithm, TP, TG, kStore, TS>);
}

// The state lists are all of one dtype, FP32 or BF16 (the checks refuse 8-bit codes for an
// algorithm without block scales).
template <typename Algorithm>
void generic_step(const Step<typename Algorithm::Hyper>& step, const StepScalarPointers& s) {
  const auto state_dtype =
      step.state.count != 0 ? step.state.lists[0][0].scalar_type() : at::kFloat;
  step_switch(
      step.params, step.grads, step.weight_store(),
      [&](auto param, auto grad, auto kept, auto state) {
        launch<Algorithm, decltype(param), decltype(grad), kept, decltype(state)>(step, s);
      },
      DtypeSwitch<float, c10::BFloat16>{state_dtype});
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
