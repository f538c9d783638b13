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
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <fusedamp/math/adam_math.h>

#include "../csrc/ops/static_switch.h"
#include "adam_block.cuh"
#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"
#include "step_op.cuh"
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

// Adam's part of the dense step (step_op.cuh): the moments, and AMSGrad's running maximum.
// 8 elements of 4-6 lists in flight per thread: ~64 registers of data, 2+ blocks per SM.
// Up to 128 registers (2 blocks per SM) for the split8 store and AMSGrad: ptxas's default
// target for the split8 weight store (the extra rounding to 24 bits) was 80 registers with an
// 8-byte spill; asked for at least one block per SM instead, it took 122. AMSGrad (a third
// moment list) with FP32 masters or split remainders spilled 8-16 bytes at 80 registers once
// every product and sum rounds on its own (--fmad=false: the bits of math/, not of the
// compiler).
template <typename TS, WeightStore kStore, bool kAmsgrad>
struct AdamRule : StepRule<math::AdamHyper, AdamPositions<kStore, kAmsgrad>, TS,
                           kAdamElemsPerThread, kStore == WeightStore::kSplit8 || kAmsgrad> {
  TS* m;
  TS* v;
  TS* v_max;  // AMSGrad's running maximum of v; nullptr without
  math::AdamHyper h;
  math::AdamCoeffs c;

  template <int L>
  struct State {
    float m[L], v[L], v_max[kAmsgrad ? L : 1];
  };
  // The block's start holds its bias corrections (adam_block.cuh).
  using Start = AdamBlockStart;
  static __device__ __forceinline__ AdamBlockStart begin(
      const StepBatch<typename AdamRule::Pos>& b, const math::AdamHyper& h,
      const StepScalarPointers& s) {
    return adam_block_start(b, h, s);
  }
  static __device__ __forceinline__ AdamRule at(const StepBatch<typename AdamRule::Pos>& b,
                                                const AdamBlockStart& start,
                                                const math::AdamHyper& h) {
    using Pos = typename AdamRule::Pos;
    return {{},
            list_at<TS>(b, start.ch, true, Pos::kM),
            list_at<TS>(b, start.ch, true, Pos::kV),
            list_at<TS>(b, start.ch, kAmsgrad, Pos::kVMax),
            h,
            start.coeffs};
  }
  template <int L>
  __device__ __forceinline__ void load(int i, State<L>& r) const {
    load_lanes<L>(m + i, r.m);
    load_lanes<L>(v + i, r.v);
    if constexpr (kAmsgrad) {
      load_lanes<L>(v_max + i, r.v_max);
    }
  }
  template <int L>
  __device__ __forceinline__ void update(int l, float& p, float g, State<L>& r) const {
    math::adam_update(p, r.m[l], r.v[l], g, h, c, kAmsgrad ? &r.v_max[kAmsgrad ? l : 0] : nullptr);
  }
  template <int L>
  __device__ __forceinline__ void store(int i, const State<L>& r) const {
    store_lanes<L>(m + i, r.m);
    store_lanes<L>(v + i, r.v);
    if constexpr (kAmsgrad) {
      store_lanes<L>(v_max + i, r.v_max);
    }
  }
};

}  // namespace

// The state lists: exp_avgs, exp_avg_sqs, and with AMSGrad its running maxima; or, with
// moment_scales, the two moments as int8 / uint8 codes (quantized_kernel.cu).
template <>
void step<math::Adam>(const Step<math::AdamHyper>& step, const StepScalarPointers& s) {
  dense_or_quantized_step<AdamRule>(step, s, &adam_quantized, BoolSwitch{step.state.count == 3});
}

}  // namespace fusedamp::cuda
