// CUDA: the fused steps over a quantized state (math/quantized_moments_math.h): Adam/AdamW with
// int8 exp_avg and uint8 exp_avg_sq codes, SGD with int8 momentum buffer codes (exp_avg's
// format), and per block of kMomentBlock = 32 elements of each parameter one FP32 scale per
// quantized list (moment_scales, momentum_scales). The same formulas as the CPU kernels
// (cpu/quantized_blocks.h), shared through math/.
// Memory traffic per element (P = param bytes, G = grad bytes; Q = the codes, 2 B for Adam's
// two moments, 1 B for SGD's buffer):
//   with FP32 master weights: read G + 4 + Q,     write P + 4 + Q  (BF16 Adam: 8 + 8)
//   split / kahan:            read G + P + 2 + Q, write P + 2 + Q  (BF16 Adam: 8 + 6)
//   none / stochastic:        read G + P + Q,     write P + Q      (FP32 Adam: 10 + 6)
// plus the block scales, 4 B read and 4 B written per list and 32 elements, P read when
// masters adopt edits of the params (the default), G written when the multiplied grads are
// written back, and, per block of kChunk elements, the device scalars and the step count.
// If *found_inf != 0 every block returns before touching memory; the step counts are advanced
// afterwards by advance_steps (bookkeeping.cu), which makes the same test.
//
// Design. A block's new scales are the largest |m| (and v^(1/4)) over its 32 new values, and
// its codes can only be formed once they are known, so each block is reduced as a whole
// before anything of it is stored. One warp per block, one element per lane, makes that
// reduction five register shuffles per scale (no shared memory, no barrier), and since a chunk
// (kChunk elements) is whole blocks, no block is split between thread blocks. Lane i reads
// element i of the block in every list, so each access of a warp is one contiguous run (32 B of
// codes, 64 B of BF16 weights) whatever the tensor's alignment: no vector path and scalar tail
// as in adam_kernel.cu. Each warp issues the loads of kBlocksInFlight blocks (scales included)
// before their math, ~6 registers per block: about 60 registers in all, 4 thread blocks per SM,
// and enough bytes in flight to keep the memory busy.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <fusedamp/math/adam_math.h>
#include <fusedamp/math/quantized_moments_math.h>
#include <fusedamp/math/sgd_math.h>

#include <cstdint>

#include "../csrc/ops/static_switch.h"
#include "adam_block.cuh"
#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"
#include "step_weights.cuh"

namespace fusedamp::cuda {
namespace {

constexpr int kBlock = static_cast<int>(math::kMomentBlock);
constexpr int kWarpSize = 32;
constexpr int kWarps = kThreads / kWarpSize;
// Per warp and iteration: 4 blocks of 4-6 lists in flight, one element of each per lane.
constexpr int kBlocksInFlight = 4;
static_assert(kBlock == kWarpSize, "one lane per element of a moment block");
static_assert(kChunk % kBlock == 0, "a chunk is whole moment blocks");

// List positions: the quantized lists after params and grads.
template <int kLists, WeightStore kStore>
struct QuantizedPositions : StepPositions<kStore, kLists> {
  static constexpr int kX0 = QuantizedPositions::kState;      // int8 codes in exp_avg's format
  static constexpr int kX1 = QuantizedPositions::kState + 1;  // uint8 codes (kLists == 2)
};

// The per-tensor slots: those of every step kernel (extra_slots_of: the step count and, under
// stochastic rounding, the seed), then the tensor's block scales, whose length is not numel.
template <WeightStore kStore>
constexpr int scales_slot_of() {
  return extra_slots_of(kStore);
}

template <int kLists, WeightStore kStore>
using QuantizedBatch =
    TensorBatch<QuantizedPositions<kLists, kStore>::kCount, scales_slot_of<kStore>() + 1>;

// The largest of a value over the warp, in every lane (NaN if any lane's is NaN).
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    x = math::LaneOps<float>::max(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

// The algorithms over a quantized state: what a thread block computes first (begin, called by
// every thread: Adam's holds a barrier), and one element's update from its stored values x0
// (and x1), leaving in them what their codes are formed from (x1: the fourth root).
struct AdamQuantized {
  static constexpr int kLists = 2;
  math::AdamHyper h;
  struct Start {
    ChunkRef ch;
    float step_before;
    float mult;
    math::AdamCoeffs coeffs;
  };
  template <typename Batch>
  __device__ __forceinline__ Start begin(const Batch& b, const StepScalarPointers& s) const {
    const AdamBlockStart start = adam_block_start(b, h, s);
    return {start.ch, start.step_before, start.mult, start.coeffs};
  }
  __device__ __forceinline__ void update(float& p, float g, float& x0, float& x1,
                                         const Start& start) const {
    float sqrt_v = 0.f;
    math::adam_update(p, x0, x1, g, h, start.coeffs, static_cast<float*>(nullptr), &sqrt_v);
    x1 = math::exp_avg_sq_root_of_sqrt(sqrt_v);
  }
};

struct SgdQuantized {
  static constexpr int kLists = 1;
  math::SgdHyper h;
  struct Start {
    ChunkRef ch;
    float step_before;
    float mult;
    float lr;
  };
  template <typename Batch>
  __device__ __forceinline__ Start begin(const Batch& b, const StepScalarPointers& s) const {
    const ChunkRef ch = this_chunk(b);
    return {ch, *static_cast<const float*>(b.extra[0][ch.t]), s.grad_multiplier(),
            s.learning_rate()};
  }
  __device__ __forceinline__ void update(float& p, float g, float& x0, float&,
                                         const Start& start) const {
    // On a tensor's first step the buffer becomes the gradient, as torch initialises it.
    math::sgd_update(p, x0, g, h, start.lr, start.step_before == 0.f);
  }
};

// One block's loads, one element per lane.
struct BlockLoads {
  float p, g, code0, code1;
  float scale0, scale1;
};

template <typename Algo, typename TP, typename TG, WeightStore kStore>
__global__ void __launch_bounds__(kThreads)
    quantized_kernel(const __grid_constant__ QuantizedBatch<Algo::kLists, kStore> b, Algo algo,
                     StepScalarPointers s, bool write_back_grads) {
  constexpr int kLists = Algo::kLists;
  using Pos = QuantizedPositions<kLists, kStore>;
  if (s.skipped()) {
    return;  // skipped step: nothing is read or written
  }
  const typename Algo::Start start = algo.begin(b, s);
  const ChunkRef& ch = start.ch;
  const StepWeights<TP, kStore> weights =
      step_weights_at<TP, kStore>(b, ch, Pos::kP, Pos::kStore, start.step_before);
  const StepGrads<TG> grads{list_at<TG>(b, ch, true, Pos::kG), write_back_grads};
  int8_t* const codes0 = list_at<int8_t>(b, ch, true, Pos::kX0);
  uint8_t* const codes1 = list_at<uint8_t>(b, ch, kLists == 2, Pos::kX1);
  // Chunks start at multiples of kChunk, so the chunk's blocks are the tensor's from this one.
  float* const scales =
      static_cast<float*>(b.extra[scales_slot_of<kStore>()][ch.t]) + kLists * (ch.offset / kBlock);

  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int blocks = (ch.n + kBlock - 1) / kBlock;
  for (int first = warp; first < blocks; first += kWarps * kBlocksInFlight) {
    BlockLoads r[kBlocksInFlight];
#pragma unroll
    for (int u = 0; u < kBlocksInFlight; ++u) {
      const int blk = first + u * kWarps;
      const int i = blk * kBlock + lane;
      if (blk < blocks) {
        // Every lane reads the same scales: one broadcast transaction each. FP32 loads, not
        // one of 8 B: a scales tensor need not start 8-byte aligned.
        r[u].scale0 = scales[kLists * blk];
        r[u].scale1 = kLists == 2 ? scales[kLists * blk + 1] : 0.f;
      }
      if (i < ch.n) {
        float lanes[1];
        grads.template load<1>(i, lanes);
        r[u].g = lanes[0];
        weights.template load<1>(i, lanes);
        r[u].p = lanes[0];
        r[u].code0 = static_cast<float>(codes0[i]);
        r[u].code1 = kLists == 2 ? static_cast<float>(codes1[i]) : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kBlocksInFlight; ++u) {
      const int blk = first + u * kWarps;
      if (blk >= blocks) {
        break;  // uniform over the warp: the shuffles below see every lane
      }
      const int i = blk * kBlock + lane;
      const bool active = i < ch.n;  // the last block of a tensor may be partial
      // Lanes past the tensor's end contribute 0 to the maxima, as the CPU's padding lanes do
      // (every |m| and v^(1/4) is >= 0, so 0 changes no maximum).
      float x0 = 0.f;
      float x1 = 0.f;
      if (active) {
        float lanes[1] = {r[u].g};
        grads.template multiply_and_write_back<1>(i, lanes, start.mult);
        const math::QuantizedBlock stored = math::quantized_block(r[u].scale0, r[u].scale1);
        float p = r[u].p;
        x0 = math::exp_avg_value(r[u].code0, stored.exp_avg_step);
        if constexpr (kLists == 2) {
          x1 = math::exp_avg_sq_value(r[u].code1, stored.exp_avg_sq_step);
        }
        algo.update(p, lanes[0], x0, x1, start);
        const float new_p[1] = {p};
        weights.template store<1>(i, new_p);
      }
      const float scale0 = warp_max(math::block_scale_magnitude(x0));
      const float scale1 = kLists == 2 ? warp_max(math::block_scale_magnitude(x1)) : 0.f;
      const math::QuantizingBlock next = math::quantizing_block(scale0, scale1);
      if (active) {
        codes0[i] = static_cast<int8_t>(math::exp_avg_code(x0, next));
        if constexpr (kLists == 2) {
          codes1[i] = static_cast<uint8_t>(math::exp_avg_sq_code(x1, next));
        }
      }
      if (lane == 0) {
        scales[kLists * blk] = scale0;
        if constexpr (kLists == 2) {
          scales[kLists * blk + 1] = scale1;
        }
      }
    }
  }
}

template <typename Algo, typename TP, typename TG, WeightStore kStore, typename Hyper>
void launch(const Step<Hyper>& step, const StepScalarPointers& s) {
  constexpr int kLists = Algo::kLists;
  using Pos = QuantizedPositions<kLists, kStore>;
  const auto lists = step_lists_of<Pos>(step);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  // Every list is written but the grads, which are written only when written back.
  const uint32_t all = (1u << Pos::kCount) - 1u;
  const bool write_back = step.shared->write_back_grads;
  const uint32_t written = write_back ? all : all & ~(1u << Pos::kG);
  // Width 1: the kernel reads element by element and never asks for the alignment bit.
  multi_tensor_apply<Pos::kCount, scales_slot_of<kStore>() + 1>(
      lists, written, 1,
      [&](size_t i, void** slots) {
        slots[0] = const_cast<void*>(step.steps[i].const_data_ptr());
        if constexpr (master_mode_info(kStore).seeded) {
          slots[1] = reinterpret_cast<void*>(static_cast<uintptr_t>(step.rounding_seeds[i]));
        }
        // Written: mutable_data_ptr() gives a copy-on-write tensor its own storage first.
        slots[scales_slot_of<kStore>()] = step.block_scales[i].mutable_data_ptr();
      },
      [&](const QuantizedBatch<kLists, kStore>& batch, int64_t blocks) {
        quantized_kernel<Algo, TP, TG, kStore>
            <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(batch, Algo{step.hyper}, s,
                                                                     write_back);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

}  // namespace

void adam_quantized(const Step<math::AdamHyper>& step, const StepScalarPointers& s) {
  step_switch(step.params, step.grads, step.weight_store(),
              [&](auto param, auto grad, auto kept) {
                launch<AdamQuantized, decltype(param), decltype(grad), kept>(step, s);
              });
}

void sgd_quantized(const Step<math::SgdHyper>& step, const StepScalarPointers& s) {
  step_switch(step.params, step.grads, step.weight_store(),
              [&](auto param, auto grad, auto kept) {
                launch<SgdQuantized, decltype(param), decltype(grad), kept>(step, s);
              });
}

}  // namespace fusedamp::cuda
