#pragma once
// Adam's moments and SGD's momentum buffer between FP32 values and state_dtype=int8's codes and
// block scales (math/quantized_moments_math.h), for a state that changes format: a checkpoint or an
// assignment of another state_dtype, a param group whose state_dtype was changed. The step
// itself never converts; these run once per change, on the host, with the kernels' formulas.
#include <ATen/core/Tensor.h>

#include <utility>
#include <vector>

namespace fusedamp::optim::detail {

// Adam's two moments, or (exp_avg_sq undefined) SGD's momentum buffer in exp_avg's format.
struct QuantizedMoments {
  at::Tensor exp_avg;     // int8 codes, param's shape and strides
  at::Tensor exp_avg_sq;  // uint8 codes; undefined for SGD's buffer
  at::Tensor scales;      // FP32 of block_scales_shape(param, 2, or 1 without exp_avg_sq)
};

// The shape of param's block scales: one row per block, one column per quantized list (Adam's
// moment_scales: [exp_avg scale, exp_avg_sq scale], columns 2; SGD's momentum_scales: 1).
// [size(0), R / 32, columns] for a contiguous parameter of two or more dimensions whose rows
// (R = numel / size(0) elements) are whole blocks, so that a range of rows (an FSDP2 shard of
// dim 0) has that range of the scales whatever the sharding; [ceil(numel / 32), columns]
// otherwise.
std::vector<int64_t> block_scales_shape(const at::Tensor& param, int64_t columns = 2);

// exp_avg and exp_avg_sq (any floating dtype, param's shape; exp_avg_sq undefined: exp_avg
// alone, as SGD's buffer) as the codes and scales a step would leave for these values, on
// param's device. Blocks run over param's element order in
// memory, as the kernels walk it.
QuantizedMoments quantize_moments(const at::Tensor& param, const at::Tensor& exp_avg,
                                  const at::Tensor& exp_avg_sq);

// The FP32 values (param's shape, strides and device) that codes and scales stand for (the
// second undefined where q has no exp_avg_sq).
std::pair<at::Tensor, at::Tensor> dequantize_moments(const at::Tensor& param,
                                                     const QuantizedMoments& q);

// Whether t holds param's block scales, in block_scales_shape(param, columns) or as [blocks,
// columns] (dtype and layout aside): the scales of the same blocks either way.
bool has_block_scale_shape(const at::Tensor& param, const at::Tensor& t, int64_t columns = 2);

// Fresh (all-zero) codes and scales for param (without exp_avg_sq: SGD's buffer).
QuantizedMoments zero_quantized_moments(const at::Tensor& param, bool with_exp_avg_sq = true);

}  // namespace fusedamp::optim::detail
