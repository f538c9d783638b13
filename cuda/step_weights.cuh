#pragma once
// The weights a fused step kernel updates, seen as FP32 lanes. With master weights the FP32
// master copy is read and written and the params are written (rounded from it) and, with
// kAdoptEdits, read too: where a param is not its master's rounding, the model was edited and
// the step starts from the param (math/master_math.h). Without master weights the params
// themselves are read and written. Adam and SGD share it, so the two read and write the weights
// in one way (the memory traffic each kernel's header states).
#include <fusedamp/math/master_math.h>

#include "multi_tensor_apply.cuh"

namespace fusedamp::cuda {

template <typename TP, bool kHasMaster, bool kAdoptEdits>
struct StepWeights {
  static_assert(kHasMaster || !kAdoptEdits, "edits are adopted into master weights only");
  TP* param;
  float* master;  // nullptr without master weights

  template <int L>
  __device__ __forceinline__ void load(int i, float (&lanes)[L]) const {
    if constexpr (kHasMaster) {
      load_lanes<L>(master + i, lanes);
      if constexpr (kAdoptEdits) {
        float params[L];
        load_lanes<L>(param + i, params);
#pragma unroll
        for (int l = 0; l < L; ++l) {
          // The master as the step stores it into the param (store_lanes' rounding).
          const float rounded = to_float(from_float<TP>(lanes[l]));
          lanes[l] = math::weight_to_update(lanes[l], params[l], rounded);
        }
      }
    } else {
      load_lanes<L>(param + i, lanes);
    }
  }
  template <int L>
  __device__ __forceinline__ void store(int i, const float (&lanes)[L]) const {
    if constexpr (kHasMaster) {
      store_lanes<L>(master + i, lanes);
    }
    store_lanes<L>(param + i, lanes);
  }
};

// The grads a step reads and, with kWriteGrads, writes back: the multiplied (unscaled, clipped)
// gradient the update used, as torch's fused optimizers leave .grad.
template <typename TG, bool kWriteGrads>
struct StepGrads {
  TG* grad;

  template <int L>
  __device__ __forceinline__ void load(int i, float (&lanes)[L]) const {
    load_lanes<L>(grad + i, lanes);
  }
  template <int L>
  __device__ __forceinline__ void store(int i, const float (&lanes)[L]) const {
    if constexpr (kWriteGrads) {
      store_lanes<L>(grad + i, lanes);
    }
  }
};

// A list of a batch at this block's chunk, as T*; nullptr where the list is absent.
template <typename T, typename Batch>
__device__ __forceinline__ T* list_at(const Batch& b, const ChunkRef& ch, bool present,
                                      int list) {
  return present ? static_cast<T*>(b.ptr[present ? list : 0][ch.t]) + ch.offset : nullptr;
}

}  // namespace fusedamp::cuda
