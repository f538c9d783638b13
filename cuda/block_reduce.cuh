#pragma once
// Reductions over one thread block of a multi-tensor kernel (kThreads threads): a sum or a
// maximum, in a fixed order, so that the result is deterministic.
#include <cuda_runtime.h>

#include "multi_tensor_apply.cuh"

namespace fusedamp::cuda {

// Combine = Plus or Max. Max is for non-negative values (amax): 0 is its identity.
struct Plus {
  template <typename T>
  __device__ __forceinline__ T operator()(T x, T y) const {
    return x + y;
  }
};
struct Max {
  template <typename T>
  __device__ __forceinline__ T operator()(T x, T y) const {
    return x > y ? x : y;
  }
};

template <typename T, typename Combine>
__device__ __forceinline__ T warp_reduce(T x, Combine combine) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    x = combine(x, __shfl_xor_sync(0xffffffffu, x, o));
  }
  return x;
}

// x combined over the block (blockDim.x == kThreads); the result is valid in thread 0. The
// combination order is fixed, so the result is deterministic.
template <typename T, typename Combine>
__device__ __forceinline__ T block_reduce(T x, Combine combine) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "block size");
  __shared__ T warp_part[kThreads / 32];
  x = warp_reduce(x, combine);
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  if (lane == 0) {
    warp_part[warp] = x;
  }
  __syncthreads();
  T s = T(0);
  if (warp == 0) {
    s = lane < kThreads / 32 ? warp_part[lane] : T(0);
    s = warp_reduce(s, combine);
  }
  // warp_part is reused by the next call in the same kernel: no thread may overwrite it
  // before warp 0 has read it.
  __syncthreads();
  return s;
}

template <typename T>
__device__ __forceinline__ T block_sum(T x) {
  return block_reduce(x, Plus{});
}

template <typename T>
__device__ __forceinline__ T block_max(T x) {
  return block_reduce(x, Max{});
}

}  // namespace fusedamp::cuda
