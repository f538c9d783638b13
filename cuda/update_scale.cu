// CUDA: the loss-scale state machine as a one-thread kernel, so the scale, the trackers and
// found_inf never leave the device. Memory traffic: 4 scalars read (5 with amax), 3 written.
// The factors are double (math::ScaleHyper), as in torch's CUDA _amp_update_scale_, so with
// hysteresis 1 and no bounds the scale sequence is torch's bit for bit.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <fusedamp/math/scale_math.h>

#include "cuda_kernels.h"

namespace fusedamp::cuda {
namespace {

__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker,
                                    int32_t* hysteresis_tracker, const float* found_inf,
                                    const double* amax, math::ScaleHyper h) {
  float s = *scale;
  int32_t g = *growth_tracker;
  int32_t hy = *hysteresis_tracker;
  math::update_scale(s, g, hy, *found_inf != 0.f, h, amax != nullptr ? *amax : -1.0);
  *scale = s;
  *growth_tracker = g;
  *hysteresis_tracker = hy;
}

}  // namespace

void update_scale(const ops::UpdateScale& op, const math::ScaleHyper& h) {
  update_scale_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(
      op.scale.data_ptr<float>(), op.growth_tracker.data_ptr<int32_t>(),
      op.hysteresis_tracker.data_ptr<int32_t>(), op.found_inf.const_data_ptr<float>(),
      input_or_null<double>(op.amax), h);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fusedamp::cuda
