// CUDA: fused Adam/AdamW step with quantized moments (math/quantized_moments_math.h): int8
// exp_avg and uint8 exp_avg_sq codes, and per block of kMomentBlock = 32 elements of each
// parameter two FP32 scales (moment_scales). The same formulas as the CPU kernel
// (cpu/adam_kernel.cpp, adam_quantized_blocks), shared through math/.
// Memory traffic per element (P = param bytes, G = grad bytes; the codes are 1 + 1 B):
//   with FP32 master weights: read G + 4 + 2,     write P + 4 + 2  (BF16: 8 + 8)
//   split / kahan:            read G + P + 2 + 2, write P + 2 + 2  (BF16: 8 + 6)
//   none / stochastic:        read G + P + 2,     write P + 2      (FP32: 10 + 6)
// plus the block scales, 8 B read and 8 B written per 32 elements (0.25 + 0.25 B), P read when
// masters adopt edits of the params (the default), G written when the multiplied grads are
// written back, and, per block of kChunk elements, the device scalars and the step count.
// If *found_inf != 0 every block returns before touching memory; the step counts are advanced
// afterwards by advance_steps (bookkeeping.cu), which makes the same test.
//
// Design. A moment block's new scales are the largest |m| and v^(1/4) over its 32 new moments,
// and its codes can only be formed once both are known, so each block is reduced as a whole
// before anything of it is stored. One warp per block, one element per lane, makes that
// reduction five register shuffles per scale (no shared memory, no barrier), and since a chunk
// (kChunk elements) is whole blocks, no block is split between thread blocks. Lane i reads
// element i of the block in every list, so each access of a warp is one contiguous run (32 B of
// codes, 64 B of BF16 weights) whatever the tensor's alignment: no vector path and scalar tail
// as in adam_kernel.cu. Each warp issues the loads of kBlocksInFlight blocks (scales included)
// before their math, ~6 registers per block: about 60 registers in all, 4 thread blocks per SM,
// and enough bytes in flight to keep the memory busy.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <fusedamp/math/adam_math.h>
#include <fusedamp/math/quantized_moments_math.h>

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

// List positions; master_params comes last and exists only when the store keeps a list.
template <bool kStoreList>
struct QuantizedLists {
  static constexpr int kP = 0;
  static constexpr int kG = 1;
  static constexpr int kM = 2;      // int8 exp_avg codes
  static constexpr int kV = 3;      // uint8 exp_avg_sq codes
  static constexpr int kStore = 4;  // valid if kStoreList
  static constexpr int kCount = kStoreList ? 5 : 4;
};

template <WeightStore kStore>
using QuantizedPositions = QuantizedLists<has_store_list(kStore)>;

// The per-tensor slots: those of every step kernel (extra_slots_of: the step count and, under
// stochastic rounding, the seed), then the tensor's moment_scales, whose length is not numel.
template <WeightStore kStore>
constexpr int scales_slot_of() {
  return extra_slots_of(kStore);
}

template <WeightStore kStore>
using QuantizedBatch =
    TensorBatch<QuantizedPositions<kStore>::kCount, scales_slot_of<kStore>() + 1>;

// The largest of a value over the warp, in every lane (NaN if any lane's is NaN).
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    x = math::LaneOps<float>::max(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

// One moment block's loads, one element per lane.
struct BlockLoads {
  float p, g, m_code, v_code;
  float exp_avg_scale, exp_avg_sq_scale;
};

template <typename TP, typename TG, WeightStore kStore>
__global__ void __launch_bounds__(kThreads)
    adam_quantized_kernel(const __grid_constant__ QuantizedBatch<kStore> b, math::AdamHyper h,
                          StepScalarPointers s, bool write_back_grads) {
  using Pos = QuantizedPositions<kStore>;
  if (s.skipped()) {
    return;  // skipped step: nothing is read or written
  }
  const AdamBlockStart start = adam_block_start(b, h, s);
  const ChunkRef& ch = start.ch;
  const float step_before = start.step_before;
  const float mult = start.mult;
  const math::AdamCoeffs c = start.coeffs;
  const StepWeights<TP, kStore> weights =
      step_weights_at<TP, kStore>(b, ch, Pos::kP, Pos::kStore, step_before);
  const StepGrads<TG> grads{list_at<TG>(b, ch, true, Pos::kG), write_back_grads};
  int8_t* const m_codes = list_at<int8_t>(b, ch, true, Pos::kM);
  uint8_t* const v_codes = list_at<uint8_t>(b, ch, true, Pos::kV);
  // Chunks start at multiples of kChunk, so the chunk's blocks are the tensor's from this one.
  float* const scales =
      static_cast<float*>(b.extra[scales_slot_of<kStore>()][ch.t]) + 2 * (ch.offset / kBlock);

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
        // Every lane reads the same two scales: one broadcast transaction each. Two FP32 loads,
        // not one of 8 B: a moment_scales tensor need not start 8-byte aligned.
        r[u].exp_avg_scale = scales[2 * blk];
        r[u].exp_avg_sq_scale = scales[2 * blk + 1];
      }
      if (i < ch.n) {
        float lanes[1];
        grads.template load<1>(i, lanes);
        r[u].g = lanes[0];
        weights.template load<1>(i, lanes);
        r[u].p = lanes[0];
        r[u].m_code = static_cast<float>(m_codes[i]);
        r[u].v_code = static_cast<float>(v_codes[i]);
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
      float m = 0.f;
      float root = 0.f;
      if (active) {
        float lanes[1] = {r[u].g};
        grads.template multiply_and_write_back<1>(i, lanes, mult);
        const math::QuantizedBlock stored =
            math::quantized_block(r[u].exp_avg_scale, r[u].exp_avg_sq_scale);
        float p = r[u].p;
        float mv = math::exp_avg_value(r[u].m_code, stored.exp_avg_step);
        float vv = math::exp_avg_sq_value(r[u].v_code, stored.exp_avg_sq_step);
        float sqrt_v = 0.f;
        math::adam_update(p, mv, vv, lanes[0], h, c, static_cast<float*>(nullptr), &sqrt_v);
        const float new_p[1] = {p};
        weights.template store<1>(i, new_p);
        m = mv;
        root = math::exp_avg_sq_root_of_sqrt(sqrt_v);
      }
      const float m_scale = warp_max(math::exp_avg_magnitude(m));
      const float v_scale = warp_max(root);
      const math::QuantizingBlock next = math::quantizing_block(m_scale, v_scale);
      if (active) {
        m_codes[i] = static_cast<int8_t>(math::exp_avg_code(m, next));
        v_codes[i] = static_cast<uint8_t>(math::exp_avg_sq_code(root, next));
      }
      if (lane == 0) {
        scales[2 * blk] = m_scale;
        scales[2 * blk + 1] = v_scale;
      }
    }
  }
}

template <typename TP, typename TG, WeightStore kStore>
void launch(const Step<math::AdamHyper>& step, const StepScalarPointers& s) {
  using Pos = QuantizedPositions<kStore>;
  auto lists = step_lists_of<Pos, kStore>(step);
  lists[Pos::kM] = step.state.lists[0];
  lists[Pos::kV] = step.state.lists[1];
  const auto stream = at::cuda::getCurrentCUDAStream();
  // Every list is written but the grads, which are written only when written back.
  const uint32_t all = (1u << Pos::kCount) - 1u;
  const uint32_t written = step.write_back_grads ? all : all & ~(1u << Pos::kG);
  // Width 1: the kernel reads element by element and never asks for the alignment bit.
  multi_tensor_apply<Pos::kCount, scales_slot_of<kStore>() + 1>(
      lists, written, 1,
      [&](size_t i, void** slots) {
        slots[0] = const_cast<void*>(step.steps[i].const_data_ptr());
        if constexpr (kStore == WeightStore::kStochastic) {
          slots[1] = reinterpret_cast<void*>(static_cast<uintptr_t>(step.rounding_seeds[i]));
        }
        // Written: mutable_data_ptr() gives a copy-on-write tensor its own storage first.
        slots[scales_slot_of<kStore>()] = step.moment_scales[i].mutable_data_ptr();
      },
      [&](const QuantizedBatch<kStore>& batch, int64_t blocks) {
        adam_quantized_kernel<TP, TG, kStore>
            <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(batch, step.hyper, s,
                                                                     step.write_back_grads);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

}  // namespace

void adam_quantized(const Step<math::AdamHyper>& step, const StepScalarPointers& s) {
  step_switch(step.params, step.grads, step.weight_store(),
              [&](auto param, auto grad, auto kept) {
                launch<decltype(param), decltype(grad), kept>(step, s);
              });
}

}  // namespace fusedamp::cuda
