// CUDA: fused SGD step (momentum, dampening, Nesterov, weight decay) over lists
// (fusedamp::math::sgd_update, shared with the CPU).
// Memory traffic per element (P = param bytes, G = grad bytes, B = the momentum buffer's
// bytes (4 FP32, 2 BF16) with momentum, else 0):
//   with FP32 master weights: read G + 4 + B,     write P + 4 + B
//   split / kahan:            read G + P + 2 + B, write P + 2 + B
//   none / stochastic:        read G + P + B,     write P + B
// plus P read when masters adopt edits of the params (the default) and G written when the
// multiplied grads are written back.
// On a tensor's first step (step count 0) the momentum buffer is only written (buf = g), as
// torch initialises it. If *found_inf != 0 every block returns before touching memory.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <fusedamp/math/sgd_math.h>

#include "../csrc/ops/static_switch.h"
#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"
#include "step_weights.cuh"

namespace fusedamp::cuda {
namespace {

// List positions: the momentum buffers where there is momentum.
template <WeightStore kStore, bool kMomentum>
struct SgdPositions : StepPositions<kStore, kMomentum ? 1 : 0> {
  static constexpr int kBuf = SgdPositions::kState;  // valid if kMomentum
};

template <WeightStore kStore, bool kMomentum>
using SgdBatch = StepBatch<SgdPositions<kStore, kMomentum>>;

template <typename TP, typename TG, WeightStore kStore, bool kMomentum, typename TS>
struct SgdOp {
  StepWeights<TP, kStore> weights;
  StepGrads<TG> grads;
  TS* buf;
  math::SgdHyper h;
  float lr;
  float mult;
  bool first_step;

  template <int L>
  struct Regs {
    float p[L], g[L], b[kMomentum ? L : 1];
  };
  template <int L>
  __device__ __forceinline__ void load(int i, Regs<L>& r) const {
    grads.load(i, r.g);
    weights.load(i, r.p);
    if constexpr (kMomentum) {
      if (!first_step) {
        load_lanes<L>(buf + i, r.b);
      }
    }
  }
  template <int L>
  __device__ __forceinline__ void apply(int i, Regs<L>& r) const {
    grads.multiply_and_write_back(i, r.g, mult);
#pragma unroll
    for (int l = 0; l < L; ++l) {
      if constexpr (kMomentum) {
        math::sgd_update(r.p[l], r.b[l], r.g[l], h, lr, first_step);
      } else {
        math::sgd_update_no_momentum(r.p[l], r.g[l], h, lr);
      }
    }
  }
  template <int L>
  __device__ __forceinline__ void store(int i, const Regs<L>& r) const {
    if constexpr (kMomentum) {
      store_lanes<L>(buf + i, r.b);
    }
    weights.store(i, r.p);
  }
};

template <typename TP, typename TG, WeightStore kStore, bool kMomentum, typename TS>
__global__ void __launch_bounds__(kThreads)
    sgd_kernel(const __grid_constant__ SgdBatch<kStore, kMomentum> b, math::SgdHyper h,
               StepScalarPointers s, bool write_back_grads) {
  using Pos = SgdPositions<kStore, kMomentum>;
  if (s.skipped()) {
    return;  // skipped step: nothing is read or written
  }
  const ChunkRef ch = this_chunk(b);
  const float lr = s.learning_rate();
  const float mult = s.grad_multiplier();
  const float step_before = *static_cast<const float*>(b.extra[0][ch.t]);
  SgdOp<TP, TG, kStore, kMomentum, TS> op{
      step_weights_at<TP, kStore>(b, ch, Pos::kP, Pos::kStore, step_before),
      {list_at<TG>(b, ch, true, Pos::kG), write_back_grads},
      list_at<TS>(b, ch, kMomentum, Pos::kBuf),
      h,
      lr,
      mult,
      step_before == 0.f};
  constexpr int W = vec_width_of<TP, TG, TS>();
  chunk_loop<W>(op, ch.n, ch.aligned);
}

template <typename TP, typename TG, WeightStore kStore, bool kMomentum, typename TS>
void launch(const Step<math::SgdHyper>& step, const StepScalarPointers& s) {
  launch_step<SgdPositions<kStore, kMomentum>, TP, TG, TS>(
      step, s, &sgd_kernel<TP, TG, kStore, kMomentum, TS>);
}

}  // namespace

// The state list: the momentum buffers, where there is momentum; with momentum_scales, int8
// codes (quantized_kernel.cu).
template <>
void step<math::Sgd>(const Step<math::SgdHyper>& step, const StepScalarPointers& s) {
  if (!step.block_scales.empty()) {
    sgd_quantized(step, s);
  } else {
    const bool momentum = step.state.count != 0;
    const auto state_dtype = momentum ? step.state.lists[0][0].scalar_type() : at::kFloat;
    step_switch(
        step.params, step.grads, step.weight_store(),
        [&](auto param, auto grad, auto kept, auto has_momentum, auto state) {
          launch<decltype(param), decltype(grad), kept, has_momentum, decltype(state)>(step, s);
        },
        BoolSwitch{momentum}, DtypeSwitch<float, c10::BFloat16>{state_dtype});
  }
  advance_steps(step.steps, s.found_inf);
}

}  // namespace fusedamp::cuda
