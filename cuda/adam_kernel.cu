// CUDA: fused Adam/AdamW step over lists (fusedamp::math::adam_update, shared with the CPU).
// Memory traffic per element (P = param bytes, G = grad bytes, S = 8 with FP32 moments, 4
// with BF16 ones):
//   with FP32 master weights: read G + 4 + S (master, m, v), write P + 4 + S  (FP16: 14 + 14)
//   split / kahan:            read G + P + 2 + S,            write P + 2 + S  (BF16: 14 + 12)
//   none / stochastic:        read G + P + S,                write P + S      (FP32: 16 + 12)
//   (AMSGrad: + S/2 read and written, the running maximum of v)
// plus P read when masters adopt edits of the params (the default), G written when the
// multiplied grads are written back, and, per block of kChunk elements, the device scalars and
// the tensor's step count.
// If *found_inf != 0 every block returns before touching memory; the step counts are
// advanced afterwards by advance_steps (bookkeeping.cu), which makes the same test.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <fusedamp/math/adam_math.h>

#include "../csrc/ops/static_switch.h"
#include "adam_block.cuh"
#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"
#include "step_weights.cuh"

namespace fusedamp::cuda {
namespace {

constexpr int kAdamElemsPerThread = 8;

// List positions: the moments, then AMSGrad's running maximum after the store's list.
template <WeightStore kStore, bool kAmsgrad>
struct AdamPositions : StepPositions<kStore, 2, kAmsgrad ? 1 : 0> {
  static constexpr int kM = AdamPositions::kState;
  static constexpr int kV = AdamPositions::kState + 1;
  static constexpr int kVMax = AdamPositions::kLate;  // valid if kAmsgrad
};

template <WeightStore kStore, bool kAmsgrad>
using AdamBatch = StepBatch<AdamPositions<kStore, kAmsgrad>>;

template <typename TP, typename TG, WeightStore kStore, bool kAmsgrad, typename TS>
struct AdamOp {
  StepWeights<TP, kStore> weights;
  StepGrads<TG> grads;
  TS* m;
  TS* v;
  TS* v_max;  // AMSGrad's running maximum of v; nullptr without
  math::AdamHyper h;
  math::AdamCoeffs c;
  float mult;

  template <int L>
  struct Regs {
    float p[L], g[L], m[L], v[L], v_max[kAmsgrad ? L : 1];
  };
  template <int L>
  __device__ __forceinline__ void load(int i, Regs<L>& r) const {
    grads.load(i, r.g);
    weights.load(i, r.p);
    load_lanes<L>(m + i, r.m);
    load_lanes<L>(v + i, r.v);
    if constexpr (kAmsgrad) {
      load_lanes<L>(v_max + i, r.v_max);
    }
  }
  template <int L>
  __device__ __forceinline__ void apply(int i, Regs<L>& r) const {
    grads.multiply_and_write_back(i, r.g, mult);
#pragma unroll
    for (int l = 0; l < L; ++l) {
      math::adam_update(r.p[l], r.m[l], r.v[l], r.g[l], h, c,
                        kAmsgrad ? &r.v_max[kAmsgrad ? l : 0] : nullptr);
    }
  }
  template <int L>
  __device__ __forceinline__ void store(int i, const Regs<L>& r) const {
    store_lanes<L>(m + i, r.m);
    store_lanes<L>(v + i, r.v);
    if constexpr (kAmsgrad) {
      store_lanes<L>(v_max + i, r.v_max);
    }
    weights.store(i, r.p);
  }
};

template <typename TP, typename TG, WeightStore kStore, bool kAmsgrad, typename TS>
__device__ __forceinline__ void adam_body(const AdamBatch<kStore, kAmsgrad>& b,
                                          const math::AdamHyper& h, const StepScalarPointers& s,
                                          bool write_back_grads) {
  using Pos = AdamPositions<kStore, kAmsgrad>;
  if (s.skipped()) {
    return;  // skipped step: nothing is read or written
  }
  const AdamBlockStart start = adam_block_start(b, h, s);
  const ChunkRef& ch = start.ch;
  const float step_before = start.step_before;
  AdamOp<TP, TG, kStore, kAmsgrad, TS> op{
      step_weights_at<TP, kStore>(b, ch, Pos::kP, Pos::kStore, step_before),
      {list_at<TG>(b, ch, true, Pos::kG), write_back_grads},
      list_at<TS>(b, ch, true, Pos::kM),
      list_at<TS>(b, ch, true, Pos::kV),
      list_at<TS>(b, ch, kAmsgrad, Pos::kVMax),
      h,
      start.coeffs,
      start.mult};
  constexpr int W = vec_width_of<TP, TG, TS>();
  // 8 elements of 4-6 lists in flight per thread: ~64 registers of data, 2+ blocks per SM.
  chunk_loop<W, kAdamElemsPerThread>(op, ch.n, ch.aligned);
}

template <typename TP, typename TG, WeightStore kStore, bool kAmsgrad, typename TS>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(const __grid_constant__ AdamBatch<kStore, kAmsgrad> b, math::AdamHyper h,
                StepScalarPointers s, bool write_back_grads) {
  adam_body<TP, TG, kStore, kAmsgrad, TS>(b, h, s, write_back_grads);
}

// The same kernel allowed up to 128 registers (2 blocks per SM): ptxas's default target for
// the split8 weight store (the extra rounding to 24 bits) was 80 registers with an 8-byte
// spill; asked for at least one block per SM instead, it took 122. AMSGrad (a third moment
// list) with FP32 masters or split remainders spilled 8-16 bytes at 80 registers once every
// product and sum rounds on its own (--fmad=false: the bits of math/, not of the compiler).
template <typename TP, typename TG, WeightStore kStore, bool kAmsgrad, typename TS>
__global__ void __launch_bounds__(kThreads, 2)
    adam_kernel_two_blocks(const __grid_constant__ AdamBatch<kStore, kAmsgrad> b,
                           math::AdamHyper h, StepScalarPointers s, bool write_back_grads) {
  adam_body<TP, TG, kStore, kAmsgrad, TS>(b, h, s, write_back_grads);
}

template <typename TP, typename TG, WeightStore kStore, bool kAmsgrad, typename TS>
void launch(const Step<math::AdamHyper>& step, const StepScalarPointers& s) {
  using Pos = AdamPositions<kStore, kAmsgrad>;
  // Only the kernel launched is instantiated (the other would be compiled for nothing).
  if constexpr (kStore == WeightStore::kSplit8 || kAmsgrad) {
    launch_step<Pos, TP, TG, TS>(step, s, &adam_kernel_two_blocks<TP, TG, kStore, kAmsgrad, TS>);
  } else {
    launch_step<Pos, TP, TG, TS>(step, s, &adam_kernel<TP, TG, kStore, kAmsgrad, TS>);
  }
}

}  // namespace

// The state lists: exp_avgs, exp_avg_sqs, and with AMSGrad its running maxima; or, with
// moment_scales, the two moments as int8 / uint8 codes (quantized_kernel.cu).
template <>
void step<math::Adam>(const Step<math::AdamHyper>& step, const StepScalarPointers& s) {
  if (!step.block_scales.empty()) {
    adam_quantized(step, s);
  } else {
    step_switch(
        step.params, step.grads, step.weight_store(),
        [&](auto param, auto grad, auto kept, auto amsgrad, auto state) {
          launch<decltype(param), decltype(grad), kept, amsgrad, decltype(state)>(step, s);
        },
        BoolSwitch{step.state.count == 3},
        DtypeSwitch<float, c10::BFloat16>{step.state.lists[0][0].scalar_type()});
  }
  advance_steps(step.steps, s.found_inf);
}

}  // namespace fusedamp::cuda
