#pragma once
// The weights and grads a fused step kernel reads and writes (the memory traffic each
// kernel's header states).
#include <fusedamp/math/kahan_math.h>
#include <fusedamp/math/master_math.h>
#include <fusedamp/math/split_math.h>
#include <fusedamp/math/stochastic_rounding_math.h>

#include <cstdint>
#include <type_traits>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

#include <array>

#include "../csrc/ops/static_switch.h"
#include "../csrc/ops/step_lists.h"
#include "multi_tensor_apply.cuh"

namespace fusedamp::cuda {

// A split store's L remainders. The int8 ones go through 32-bit words (4 to a word) where L
// allows: moved as arrays of bytes, ptxas kept an 8-byte pack of them in local memory (a spill
// in the split8 AdamW kernel).
template <int L>
__device__ __forceinline__ void load_remainders(const int16_t* p, int16_t (&out)[L]) {
  load_raw<L>(p, out);
}

template <int L>
__device__ __forceinline__ void load_remainders(const int8_t* p, int8_t (&out)[L]) {
  if constexpr (L % 4 == 0) {
    uint32_t words[L / 4];
    load_raw<L / 4>(reinterpret_cast<const uint32_t*>(p), words);
#pragma unroll
    for (int l = 0; l < L; ++l) {
      out[l] = static_cast<int8_t>(static_cast<uint8_t>(words[l / 4] >> (8 * (l % 4))));
    }
  } else {
    load_raw<L>(p, out);
  }
}

// L bytes packed 4 to a word (byte l at bits 8 (l % 4) of words[l / 4]).
template <int L>
__device__ __forceinline__ void store_bytes(int8_t* p, const uint32_t (&words)[(L + 3) / 4]) {
  if constexpr (L % 4 == 0) {
    store_raw<L / 4>(reinterpret_cast<uint32_t*>(p), words);
  } else {
#pragma unroll
    for (int l = 0; l < L; ++l) {
      p[l] = static_cast<int8_t>(static_cast<uint8_t>(words[l / 4] >> (8 * (l % 4))));
    }
  }
}

// The weights a fused step kernel updates, seen as FP32 lanes, for each way of keeping them
// (fusedamp/master_modes.h; the CPU twin is csrc/cpu/step_weights.h):
//   kOff            the params themselves are read and written;
//   kFp32           the FP32 master is read, both are written; kMasterAdoptingEdits reads the
//                   param too: where it is not its master's rounding, the model was edited and
//                   the step starts from the param (math/master_math.h);
//   kSplit          BF16 param + int16 remainder = the master (math/split_math.h);
//   kSplit8         BF16 param + int8 remainder = a 24-bit master (math/split_math.h);
//   kKahan          param + compensation of the param's dtype (math/kahan_math.h);
//   kStochastic     the params, stored with stochastic rounding from the counter (seed, step,
//                   first_index + element) (math/stochastic_rounding_math.h).
// Adam and SGD share it, so the two read and write the weights in one way.
template <typename TP, WeightStore kStore>
struct StepWeights {
  static_assert(weight_store_fits<TP>(kStore), "no such weight store for this param dtype");
  static constexpr bool kFp32Master = master_mode_info(kStore).kept == MasterKept::kFp32Master;
  TP* param;
  void* extra;  // master (float), remainder (int16/int8) or compensation (TP); nullptr otherwise
  uint64_t seed;
  uint32_t step;
  int64_t first_index;  // the chunk's first element in the tensor

  template <int L>
  __device__ __forceinline__ void load(int i, float (&lanes)[L]) const {
    if constexpr (kFp32Master) {
      load_lanes<L>(static_cast<const float*>(extra) + i, lanes);
      if constexpr (kStore == WeightStore::kMasterAdoptingEdits) {
        float params[L];
        load_lanes<L>(param + i, params);
#pragma unroll
        for (int l = 0; l < L; ++l) {
          // The master as the step stores it into the param (store_lanes' rounding).
          const float rounded = to_float(from_float<TP>(lanes[l]));
          lanes[l] = math::weight_to_update(lanes[l], params[l], rounded);
        }
      }
    } else if constexpr (is_split_store(kStore)) {
      uint16_t weight_bits[L];
      SplitRemainder<kStore> remainder[L];
      load_raw<L>(reinterpret_cast<const uint16_t*>(param) + i, weight_bits);
      load_remainders<L>(static_cast<const SplitRemainder<kStore>*>(extra) + i, remainder);
#pragma unroll
      for (int l = 0; l < L; ++l) {
        lanes[l] = math::combine_split(weight_bits[l], remainder[l]);
      }
    } else if constexpr (kStore == WeightStore::kKahan) {
      float compensation[L];
      load_lanes<L>(param + i, lanes);
      load_lanes<L>(static_cast<const TP*>(extra) + i, compensation);
#pragma unroll
      for (int l = 0; l < L; ++l) {
        const float sum = lanes[l] + compensation[l];
        lanes[l] = math::kahan_weight(lanes[l], sum, to_float(from_float<TP>(sum)));
      }
    } else {  // kOff, kStochastic
      load_lanes<L>(param + i, lanes);
    }
  }

  template <int L>
  __device__ __forceinline__ void store(int i, const float (&lanes)[L]) const {
    if constexpr (kFp32Master) {
      store_lanes<L>(static_cast<float*>(extra) + i, lanes);
      store_lanes<L>(param + i, lanes);
    } else if constexpr (kStore == WeightStore::kSplit) {
      uint16_t weight_bits[L];
      int16_t remainder[L];
#pragma unroll
      for (int l = 0; l < L; ++l) {
        math::split_into(lanes[l], weight_bits[l], remainder[l]);
      }
      store_raw<L>(reinterpret_cast<uint16_t*>(param) + i, weight_bits);
      store_raw<L>(static_cast<int16_t*>(extra) + i, remainder);
    } else if constexpr (kStore == WeightStore::kSplit8) {
      // The remainders go into their 32-bit words as they are made: an array of L bytes
      // beside the weights' made the split8 AdamW kernel spill.
      uint16_t weight_bits[L];
      uint32_t words[(L + 3) / 4] = {};
#pragma unroll
      for (int l = 0; l < L; ++l) {
        const math::Split8Master split = math::split_master8(lanes[l]);
        weight_bits[l] = split.weight_bits;
        words[l / 4] |= static_cast<uint32_t>(static_cast<uint8_t>(split.remainder))
                        << (8 * (l % 4));
      }
      store_raw<L>(reinterpret_cast<uint16_t*>(param) + i, weight_bits);
      store_bytes<L>(static_cast<int8_t*>(extra) + i, words);
    } else if constexpr (kStore == WeightStore::kKahan) {
      float rounded[L], compensation[L];
#pragma unroll
      for (int l = 0; l < L; ++l) {
        rounded[l] = to_float(from_float<TP>(lanes[l]));
        compensation[l] = math::kahan_compensation(lanes[l], rounded[l]);
      }
      store_lanes<L>(param + i, rounded);
      store_lanes<L>(static_cast<TP*>(extra) + i, compensation);
    } else if constexpr (kStore == WeightStore::kStochastic) {
      uint16_t weight_bits[L];
      const uint64_t first = static_cast<uint64_t>(first_index + i);
#pragma unroll
      for (int l = 0; l < L; ++l) {
        weight_bits[l] = math::stochastic_round_bf16(
            lanes[l], math::counter_random_bits(seed, step, first + l));
      }
      store_raw<L>(reinterpret_cast<uint16_t*>(param) + i, weight_bits);
    } else {
      store_lanes<L>(param + i, lanes);
    }
  }
};

// Whether a store has a list of its own beside the params (master_params).
constexpr bool has_store_list(WeightStore store) {
  return master_mode_info(store).kept != MasterKept::kNothing;
}

// Per-tensor scalars of a step beyond its step count: the stochastic-rounding seed, passed
// through a pointer-sized slot of the launch metadata as its value (not an address).
constexpr int extra_slots_of(WeightStore store) {
  return master_mode_info(store).seeded ? 2 : 1;
}

// Tensor t's weights at this block's chunk.
template <typename TP, WeightStore kStore, typename Batch>
__device__ __forceinline__ StepWeights<TP, kStore> step_weights_at(const Batch& b,
                                                                   const ChunkRef& ch,
                                                                   int param_list,
                                                                   int store_list,
                                                                   float step_before) {
  StepWeights<TP, kStore> w;
  w.param = static_cast<TP*>(b.ptr[param_list][ch.t]) + ch.offset;
  w.extra = nullptr;
  if constexpr (has_store_list(kStore)) {
    w.extra = static_cast<KeptElem<TP, kStore>*>(b.ptr[store_list][ch.t]) + ch.offset;
  }
  w.seed = 0;
  if constexpr (master_mode_info(kStore).seeded) {
    w.seed = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(b.extra[1][ch.t]));
  }
  w.step = static_cast<uint32_t>(step_before);
  w.first_index = ch.offset;
  return w;
}

// The grads a step reads, multiplies (unscale and clipping) and, where asked, writes back: the
// multiplied gradient the update uses, as torch's fused optimizers leave .grad. The write-back
// is a runtime flag (one uniform branch per vector, half the kernels to compile) taken before
// the update (multiply_and_write_back, first thing in the op's apply): every load of the
// iteration is in flight by then, and no lane's gradient has to stay live through the update
// for a store after it (which made two AdamW kernels spill).
template <typename TG>
struct StepGrads {
  TG* grad;
  bool write_back;

  template <int L>
  __device__ __forceinline__ void load(int i, float (&lanes)[L]) const {
    load_lanes<L>(grad + i, lanes);
  }
  template <int L>
  __device__ __forceinline__ void multiply_and_write_back(int i, float (&lanes)[L],
                                                          float mult) const {
#pragma unroll
    for (int l = 0; l < L; ++l) {
      lanes[l] = lanes[l] * mult;
    }
    if (write_back) {
      store_lanes<L>(grad + i, lanes);
    }
  }
};

// The list positions of a step kernel over weights kept as kKept: params, grads, the
// algorithm's first kStateLists state lists, master_params where the store keeps a list, then
// its kLateLists further state lists (each present only when used). A kernel's batch is
// StepBatch<Pos>.
template <WeightStore kKept, int kStateLists, int kLateLists = 0>
struct StepPositions {
  static constexpr WeightStore kWeights = kKept;
  static constexpr int kP = 0;
  static constexpr int kG = 1;
  static constexpr int kState = 2;                    // the first state list
  static constexpr int kStore = kState + kStateLists;  // valid if has_store_list(kKept)
  static constexpr int kLate = kStore + (has_store_list(kKept) ? 1 : 0);
  static constexpr int kCount = kLate + kLateLists;
  // The position of the step's state list k (StepLists::state).
  static constexpr int state_at(size_t k) {
    const int i = static_cast<int>(k);
    return i < kStateLists ? kState + i : kLate + (i - kStateLists);
  }
};

// extra: the step count (and the rounding seed, see extra_slots_of)
template <typename Pos>
using StepBatch = TensorBatch<Pos::kCount, extra_slots_of(Pos::kWeights)>;

// A list of a batch at this block's chunk, as T*; nullptr where the list is absent.
template <typename T, typename Batch>
__device__ __forceinline__ T* list_at(const Batch& b, const ChunkRef& ch, bool present,
                                      int list) {
  return present ? static_cast<T*>(b.ptr[present ? list : 0][ch.t]) + ch.offset : nullptr;
}

// ---- host side -------------------------------------------------------------------------------

// The lists a step kernel walks, at the positions Pos names: params, grads, master_params where
// the store keeps one, and the step's state lists (Pos::state_at).
template <typename Pos>
std::array<at::TensorList, Pos::kCount> step_lists_of(const StepLists& step) {
  std::array<at::TensorList, Pos::kCount> lists;
  lists[Pos::kP] = step.params;
  lists[Pos::kG] = step.grads;
  if constexpr (has_store_list(Pos::kWeights)) {
    lists[Pos::kStore] = step.master_params;
  }
  for (size_t k = 0; k < step.state.count; ++k) {
    lists[Pos::state_at(k)] = step.state.lists[k];
  }
  return lists;
}

// kernel(batch, hyper, scalars, write_back_grads) over the step's lists (positions Pos), one
// launch per batch, with the per-tensor slots every step kernel reads (the step count; under
// stochastic rounding the tensor's seed). Every list is written but the grads, which are
// written only when written back.
template <typename Pos, typename TP, typename TG, typename TS, typename Hyper, typename Kernel>
void launch_step(const Step<Hyper>& step, const StepScalarPointers& s, Kernel* kernel) {
  const bool write_back = step.shared->write_back_grads;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const uint32_t all = (1u << Pos::kCount) - 1u;
  const uint32_t written = write_back ? all : all & ~(1u << Pos::kG);
  multi_tensor_apply<Pos::kCount, extra_slots_of(Pos::kWeights)>(
      step_lists_of<Pos>(step), written, vec_width_of<TP, TG, TS>(),
      [&](size_t i, void** slots) {
        slots[0] = const_cast<void*>(step.steps[i].const_data_ptr());
        if constexpr (master_mode_info(Pos::kWeights).seeded) {
          slots[1] = reinterpret_cast<void*>(static_cast<uintptr_t>(step.rounding_seeds[i]));
        }
      },
      [&](const StepBatch<Pos>& batch, int64_t blocks) {
        kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(batch, step.hyper, s,
                                                                       write_back);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

}  // namespace fusedamp::cuda
