#pragma once
// Converting what keeps a weight's lower bits between the master-weight modes (options.h
// MasterWeights), with the element math of math/split_math.h and math/kahan_math.h. Each
// result has the parameter's shape, strides and device.
#include <ATen/core/Tensor.h>
#include <fusedamp/optim/options.h>

#include <string>

namespace fusedamp::optim::detail {

// The modes that serve weights of `dtype` and keep what rounding drops, for messages
// (True or "kahan" for float16).
std::string modes_serving(at::ScalarType dtype);

// The FP32 master a BF16 weight and its remainder hold (exact): int16 ("split") or int8
// ("split8", a 24-bit master).
at::Tensor fp32_from_split(const at::Tensor& param, const at::Tensor& remainder);

// An FP32 master as a BF16 weight and remainder: exact with an int16 remainder, rounded to 24
// bits with an int8 one. The weight equals the (rounded) master's round-to-nearest-even except
// where it lies exactly halfway (split_math.h).
struct SplitState {
  at::Tensor weight;     // BF16
  at::Tensor remainder;  // int16 or int8
};
SplitState split_from_fp32(const at::Tensor& param, const at::Tensor& master,
                           at::ScalarType remainder_dtype = at::kShort);

// The value a weight and its Kahan compensation hold (their FP32 sum).
at::Tensor fp32_from_kahan(const at::Tensor& param, const at::Tensor& compensation);
// The compensation beside param = round(master) to nearest even: master − param, rounded to
// param's dtype (a split pair's weight, rounded ties away from zero, is not that at a tie).
at::Tensor kahan_from_fp32(const at::Tensor& param, const at::Tensor& master);

}  // namespace fusedamp::optim::detail
