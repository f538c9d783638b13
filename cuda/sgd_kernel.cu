// CUDA: fused SGD step (momentum, dampening, Nesterov, weight decay) over lists
// (fusedamp::math::sgd_update, shared with the CPU).
// Memory traffic per element (P = param bytes, G = grad bytes, B = 4 with momentum, else 0):
//   with FP32 master weights: read G + 4 + B, write P + 4 + B
//   without:                  read G + P + B, write P + B
// On a tensor's first step (step count 0) the momentum buffer is only written (buf = g), as
// torch initialises it. If *found_inf != 0 every block returns before touching memory.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <fusedamp/math/clip_math.h>
#include <fusedamp/math/sgd_math.h>

#include "../csrc/dispatch_float_types.h"
#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"

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

template <typename TP, typename TG, bool kHasMaster, bool kMomentum>
struct SgdOp {
  TP* p;
  const TG* g;
  float* buf;
  float* master;
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
    load_lanes<L>(g + i, r.g);
    if constexpr (kHasMaster) {
      load_lanes<L>(master + i, r.p);
    } else {
      load_lanes<L>(p + i, r.p);
    }
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
      if constexpr (kMomentum) {
        math::sgd_update(r.p[l], r.b[l], r.g[l] * mult, h, lr, first_step);
      } else {
        math::sgd_update_no_momentum(r.p[l], r.g[l] * mult, h, lr);
      }
    }
  }
  template <int L>
  __device__ __forceinline__ void store(int i, const Regs<L>& r) const {
    if constexpr (kMomentum) {
      store_lanes<L>(buf + i, r.b);
    }
    if constexpr (kHasMaster) {
      store_lanes<L>(master + i, r.p);
    }
    store_lanes<L>(p + i, r.p);
  }
};

template <typename TP, typename TG, bool kHasMaster, bool kMomentum>
__global__ void __launch_bounds__(kThreads)
    sgd_kernel(const __grid_constant__ SgdBatch<kHasMaster, kMomentum> b, math::SgdHyper h,
               StepScalars s) {
  using Pos = SgdLists<kHasMaster, kMomentum>;
  if (s.found_inf != nullptr && *s.found_inf != 0.f) {
    return;  // skipped step: nothing is read or written
  }
  const ChunkRef ch = this_chunk(b);
  const float lr = s.lr != nullptr ? *s.lr : s.lr_host;
  const float mult = math::grad_multiplier(s.inv_scale != nullptr ? *s.inv_scale : 1.f,
                                           s.grad_sum_sq != nullptr ? *s.grad_sum_sq : 0.f,
                                           s.max_grad_norm);
  const bool first = *static_cast<const float*>(b.extra[0][ch.t]) == 0.f;
  SgdOp<TP, TG, kHasMaster, kMomentum> op{
      static_cast<TP*>(b.ptr[Pos::kP][ch.t]) + ch.offset,
      static_cast<const TG*>(b.ptr[Pos::kG][ch.t]) + ch.offset,
      kMomentum ? static_cast<float*>(b.ptr[kMomentum ? Pos::kBuf : 0][ch.t]) + ch.offset
                : nullptr,
      kHasMaster ? static_cast<float*>(b.ptr[kHasMaster ? Pos::kMaster : 0][ch.t]) + ch.offset
                 : nullptr,
      h,
      lr,
      mult,
      first};
  constexpr int W = vec_width_of<TP, TG>();
  chunk_loop<W>(op, ch.n, ch.aligned);
}

template <typename TP, typename TG, bool kHasMaster, bool kMomentum>
void launch(at::TensorList params, at::TensorList master_params, at::TensorList grads,
            at::TensorList bufs, at::TensorList steps, const math::SgdHyper& h,
            const StepScalars& s) {
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
        sgd_kernel<TP, TG, kHasMaster, kMomentum>
            <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(b, h, s);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

}  // namespace

void sgd(at::TensorList params, at::TensorList master_params, at::TensorList grads,
         at::TensorList momentum_buffers, at::TensorList steps, const math::SgdHyper& h,
         const StepScalars& s) {
  if (params.empty()) {
    return;
  }
  const bool fp32_grads = grads[0].scalar_type() == at::kFloat;
  const bool master = !master_params.empty();
  const bool momentum = h.momentum != 0.f;
  FUSEDAMP_DISPATCH_FLOAT_TYPES(params[0].scalar_type(), "fusedamp_sgd_cuda", [&] {
    using TP = scalar_t;
    auto run = [&](auto grad_tag, auto master_tag, auto momentum_tag) {
      launch<TP, decltype(grad_tag), decltype(master_tag)::value,
             decltype(momentum_tag)::value>(params, master_params, grads, momentum_buffers,
                                            steps, h, s);
    };
    auto with_grad = [&](auto grad_tag) {
      if (master) {
        momentum ? run(grad_tag, std::true_type{}, std::true_type{})
                 : run(grad_tag, std::true_type{}, std::false_type{});
      } else {
        momentum ? run(grad_tag, std::false_type{}, std::true_type{})
                 : run(grad_tag, std::false_type{}, std::false_type{});
      }
    };
    if (fp32_grads) {
      with_grad(float{});
    } else {
      with_grad(TP{});
    }
  });
  advance_steps(steps, s.found_inf);
}

}  // namespace fusedamp::cuda
