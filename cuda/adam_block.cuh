#pragma once
// What every Adam kernel's thread block does first (adam_kernel.cu, quantized_kernel.cu):
// find its chunk, read the tensor's step count, and compute the bias corrections once for the
// block, in FP64 from the count before its increment, as the CPU does.
#include <fusedamp/math/adam_math.h>

#include "../csrc/ops/step_lists.h"
#include "multi_tensor_apply.cuh"

namespace fusedamp::cuda {

struct AdamBlockStart {
  ChunkRef ch;
  float step_before;
  math::AdamCoeffs coeffs;
  float mult;  // inverse loss scale times clip coefficient
};

// Called by every thread of the block (it holds a barrier); the step must not be skipped.
template <typename Batch>
__device__ __forceinline__ AdamBlockStart adam_block_start(const Batch& b,
                                                           const math::AdamHyper& h,
                                                           const StepScalarPointers& s) {
  const ChunkRef ch = this_chunk(b);
  const float step_before = *static_cast<const float*>(b.extra[0][ch.t]);
  __shared__ math::AdamCoeffs coeffs;
  if (threadIdx.x == 0) {
    coeffs = math::adam_coeffs<double>(h, s.learning_rate(), step_before);
  }
  const float mult = s.grad_multiplier();
  __syncthreads();
  return {ch, step_before, coeffs, mult};
}

}  // namespace fusedamp::cuda
