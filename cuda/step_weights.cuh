#pragma once
// The weights a fused step kernel updates, seen as FP32 lanes. With master weights the FP32
// master copy is read and written and the params are only written (rounded from it); without,
// the params themselves are read and written. Adam and SGD share it, so the two read and write
// the weights in one way (the memory traffic each kernel's header states).
#include "multi_tensor_apply.cuh"

namespace fusedamp::cuda {

template <typename TP, bool kHasMaster>
struct StepWeights {
  TP* param;
  float* master;  // nullptr without master weights

  template <int L>
  __device__ __forceinline__ void load(int i, float (&lanes)[L]) const {
    if constexpr (kHasMaster) {
      load_lanes<L>(master + i, lanes);
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

}  // namespace fusedamp::cuda
