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
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <fusedamp/math/sgd_math.h>

#include "../csrc/ops/static_switch.h"
#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"
#include "step_op.cuh"
#include "step_weights.cuh"

namespace fusedamp::cuda {
namespace {

// List positions: the momentum buffers where there is momentum.
template <WeightStore kStore, bool kMomentum>
struct SgdPositions : StepPositions<kStore, kMomentum ? 1 : 0> {
  static constexpr int kBuf = SgdPositions::kState;  // valid if kMomentum
};

// SGD's part of the dense step (step_op.cuh): the momentum buffer, where there is momentum.
template <typename TS, WeightStore kStore, bool kMomentum>
struct SgdRule : StepRule<math::SgdHyper, SgdPositions<kStore, kMomentum>, TS> {
  TS* buf;
  math::SgdHyper h;
  float lr;
  bool first_step;

  template <int L>
  struct State {
    float b[kMomentum ? L : 1];
  };
  // The block's start with the learning rate, read once for the block.
  struct Start : StepBlock {
    float lr;
  };
  static __device__ __forceinline__ Start begin(const StepBatch<typename SgdRule::Pos>& b,
                                                const math::SgdHyper&,
                                                const StepScalarPointers& s) {
    const ChunkRef ch = this_chunk(b);
    const float lr = s.learning_rate();
    const float mult = s.grad_multiplier();
    return {{ch, *static_cast<const float*>(b.extra[0][ch.t]), mult}, lr};
  }
  static __device__ __forceinline__ SgdRule at(const StepBatch<typename SgdRule::Pos>& b,
                                               const Start& start, const math::SgdHyper& h) {
    return {{}, list_at<TS>(b, start.ch, kMomentum, SgdRule::Pos::kBuf), h, start.lr,
            start.step_before == 0.f};
  }
  template <int L>
  __device__ __forceinline__ void load(int i, State<L>& r) const {
    if constexpr (kMomentum) {
      if (!first_step) {
        load_lanes<L>(buf + i, r.b);
      }
    }
  }
  template <int L>
  __device__ __forceinline__ void update(int l, float& p, float g, State<L>& r) const {
    if constexpr (kMomentum) {
      math::sgd_update(p, r.b[l], g, h, lr, first_step);
    } else {
      math::sgd_update_no_momentum(p, g, h, lr);
    }
  }
  template <int L>
  __device__ __forceinline__ void store(int i, const State<L>& r) const {
    if constexpr (kMomentum) {
      store_lanes<L>(buf + i, r.b);
    }
  }
};

}  // namespace

// The state list: the momentum buffers, where there is momentum; with momentum_scales, int8
// codes (quantized_kernel.cu).
template <>
void step<math::Sgd>(const Step<math::SgdHyper>& step, const StepScalarPointers& s) {
  dense_or_quantized_step<SgdRule>(step, s, &sgd_quantized, BoolSwitch{step.state.count != 0});
}

}  // namespace fusedamp::cuda
