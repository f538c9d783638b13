#pragma once
// Adam's moments between FP32 values and state_dtype=int8's codes and block scales
// (math/quantized_moments_math.h), for a state that changes format: a checkpoint or an
// assignment of another state_dtype, a param group whose state_dtype was changed. The step
// itself never converts; these run once per change, on the host, with the kernels' formulas.
#include <ATen/core/Tensor.h>

#include <utility>

namespace fusedamp::optim::detail {

struct QuantizedMoments {
  at::Tensor exp_avg;     // int8 codes, param's shape and strides
  at::Tensor exp_avg_sq;  // uint8 codes
  at::Tensor scales;      // FP32 [ceil(numel / 32), 2], contiguous
};

// exp_avg and exp_avg_sq (any floating dtype, param's shape) as the codes and scales a step
// would leave for these values, on param's device. Blocks run over param's element order in
// memory, as the kernels walk it.
QuantizedMoments quantize_moments(const at::Tensor& param, const at::Tensor& exp_avg,
                                  const at::Tensor& exp_avg_sq);

// The FP32 values (param's shape, strides and device) that codes and scales stand for.
std::pair<at::Tensor, at::Tensor> dequantize_moments(const at::Tensor& param,
                                                     const QuantizedMoments& q);

// Whether t has the shape of param's block scales (dtype and layout aside).
bool has_block_scale_shape(const at::Tensor& param, const at::Tensor& t);

// Fresh (all-zero) codes and scales for param.
QuantizedMoments zero_quantized_moments(const at::Tensor& param);

}  // namespace fusedamp::optim::detail
