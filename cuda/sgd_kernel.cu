// CUDA: fused SGD step (momentum, dampening, Nesterov, weight decay) over lists
// (fusedamp::math::sgd_update, shared with the CPU).
// Memory traffic per element (P = param bytes, G = grad bytes, B = 4 with momentum, else 0):
//   with FP32 master weights: read G + 4 + B, write P + 4 + B
//   without:                  read G + P + B, write P + B
// plus P read when masters adopt edits of the params (the default) and G written when the
// multiplied grads are written back.
// On a tensor's first step (step count 0) the momentum buffer is only written (buf = g), as
// torch initialises it. If *found_inf != 0 every block returns before touching memory.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <fusedamp/math/sgd_math.h>

#include "../csrc/static_switch.h"
#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"
#include "step_weights.cuh"

namespace fusedamp::cuda {
namespace {

// List positions; the optional lists come last and exist only when used.
template <bool kHasMaster, bool kMomentum>
struct SgdLists {
  static constexpr int kP = 0;
  static constexpr int kG = 1;
  static constexpr int kBuf = 2;                     // valid if kMomentum
  static constexpr int kMaster = kMomentum ? 3 : 2;  // valid if kHasMaster
  static constexpr int kCount = 2 + (kMomentum ? 1 : 0) + (kHasMaster ? 1 : 0);
};

template <bool kHasMaster, bool kMomentum>
using SgdBatch = TensorBatch<SgdLists<kHasMaster, kMomentum>::kCount, 1>;  // extra: step

template <typename TP, typename TG, bool kHasMaster, bool kAdoptEdits, bool kWriteGrads,
          bool kMomentum>
struct SgdOp {
  StepWeights<TP, kHasMaster, kAdoptEdits> weights;
  StepGrads<TG, kWriteGrads> grads;
  float* buf;
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
  __device__ __forceinline__ void apply(Regs<L>& r) const {
#pragma unroll
    for (int l = 0; l < L; ++l) {
      r.g[l] = r.g[l] * mult;
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
    grads.store(i, r.g);
  }
};

template <typename TP, typename TG, bool kHasMaster, bool kAdoptEdits, bool kWriteGrads,
          bool kMomentum>
__global__ void __launch_bounds__(kThreads)
    sgd_kernel(const __grid_constant__ SgdBatch<kHasMaster, kMomentum> b, math::SgdHyper h,
               StepScalarPointers s) {
  using Pos = SgdLists<kHasMaster, kMomentum>;
  if (s.skipped()) {
    return;  // skipped step: nothing is read or written
  }
  const ChunkRef ch = this_chunk(b);
  const float lr = s.learning_rate();
  const float mult = s.grad_multiplier();
  const bool first = *static_cast<const float*>(b.extra[0][ch.t]) == 0.f;
  SgdOp<TP, TG, kHasMaster, kAdoptEdits, kWriteGrads, kMomentum> op{
      {list_at<TP>(b, ch, true, Pos::kP), list_at<float>(b, ch, kHasMaster, Pos::kMaster)},
      {list_at<TG>(b, ch, true, Pos::kG)},
      list_at<float>(b, ch, kMomentum, Pos::kBuf),
      h,
      lr,
      mult,
      first};
  constexpr int W = vec_width_of<TP, TG>();
  chunk_loop<W>(op, ch.n, ch.aligned);
}

template <typename TP, typename TG, bool kHasMaster, bool kAdoptEdits, bool kWriteGrads,
          bool kMomentum>
void launch(at::TensorList params, at::TensorList master_params, at::TensorList grads,
            at::TensorList bufs, at::TensorList steps, const math::SgdHyper& h,
            const StepScalarPointers& s) {
  using Pos = SgdLists<kHasMaster, kMomentum>;
  std::array<at::TensorList, Pos::kCount> lists;
  lists[Pos::kP] = params;
  lists[Pos::kG] = grads;
  if constexpr (kMomentum) {
    lists[Pos::kBuf] = bufs;
  }
  if constexpr (kHasMaster) {
    lists[Pos::kMaster] = master_params;
  }
  const auto stream = at::cuda::getCurrentCUDAStream();
  constexpr int W = vec_width_of<TP, TG>();
  multi_tensor_apply<Pos::kCount, 1>(
      lists, W,
      [&](size_t i, void** slots) { slots[0] = const_cast<void*>(steps[i].const_data_ptr()); },
      [&](const SgdBatch<kHasMaster, kMomentum>& b, int64_t blocks) {
        sgd_kernel<TP, TG, kHasMaster, kAdoptEdits, kWriteGrads, kMomentum>
            <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(b, h, s);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

}  // namespace

void sgd(at::TensorList params, at::TensorList master_params, at::TensorList grads,
         at::TensorList momentum_buffers, at::TensorList steps, const math::SgdHyper& h,
         const StepScalarPointers& s, bool adopt_param_edits, bool write_back_grads) {
  step_switch(
      params, grads, master_params, adopt_param_edits, write_back_grads,
      [&](auto param, auto grad, auto has_master, auto adopt_edits, auto write_grads,
          auto has_momentum) {
        launch<decltype(param), decltype(grad), has_master, adopt_edits, write_grads,
               has_momentum>(params, master_params, grads, momentum_buffers, steps, h, s);
      },
      BoolSwitch{h.momentum != 0.f});
  advance_steps(steps, s.found_inf);
}

}  // namespace fusedamp::cuda
