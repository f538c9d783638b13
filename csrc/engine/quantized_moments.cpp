// Conversions of Adam's moments and SGD's momentum buffer to and from 8-bit codes (see
// quantized_moments.h).
#include "quantized_moments.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fusedamp/math/quantized_moments_math.h>

#include <algorithm>

namespace fusedamp::optim::detail {
namespace {

using math::kMomentBlock;
using Lane = math::LaneOps<float>;

// A CPU tensor of `dtype` with param's shape and strides holding src's values. Dense and
// non-overlapping like param, so its numel elements are one run of memory, in the order the
// kernels walk them.
at::Tensor host_like(const at::Tensor& param, const at::Tensor& src, at::ScalarType dtype) {
  auto t = at::empty_like(param, param.options().dtype(dtype).device(at::kCPU));
  t.copy_(src);
  return t;
}

at::Tensor scales_for(const at::Tensor& param, const at::TensorOptions& options,
                      int64_t columns = 2) {
  return at::zeros(block_scales_shape(param, columns), options.dtype(at::kFloat));
}

}  // namespace

std::vector<int64_t> block_scales_shape(const at::Tensor& param, int64_t columns) {
  // R from the sizes, not numel / size(0): an empty shard of rows keeps its parameter's shape.
  int64_t row = 1;
  for (int64_t d = 1; d < param.dim(); ++d) {
    row *= param.size(d);
  }
  if (param.dim() >= 2 && row > 0 && row % kMomentBlock == 0 && param.is_contiguous()) {
    return {param.size(0), row / kMomentBlock, columns};
  }
  return {math::moment_blocks(param.numel()), columns};
}

bool has_block_scale_shape(const at::Tensor& param, const at::Tensor& t, int64_t columns) {
  return t.sizes() == at::IntArrayRef(block_scales_shape(param, columns)) ||
         (t.dim() == 2 && t.size(0) == math::moment_blocks(param.numel()) &&
          t.size(1) == columns);
}

QuantizedMoments zero_quantized_moments(const at::Tensor& param) {
  return {at::zeros_like(param, param.options().dtype(at::kChar)),
          at::zeros_like(param, param.options().dtype(at::kByte)),
          scales_for(param, param.options())};
}

QuantizedMoments quantize_moments(const at::Tensor& param, const at::Tensor& exp_avg,
                                  const at::Tensor& exp_avg_sq) {
  at::NoGradGuard no_grad;
  const auto m = host_like(param, exp_avg, at::kFloat);
  const auto v = host_like(param, exp_avg_sq, at::kFloat);
  auto m_codes = at::empty_like(m, m.options().dtype(at::kChar));
  auto v_codes = at::empty_like(v, v.options().dtype(at::kByte));
  auto scales = scales_for(param, m.options());
  const float* mp = m.const_data_ptr<float>();
  const float* vp = v.const_data_ptr<float>();
  int8_t* mq = m_codes.mutable_data_ptr<int8_t>();
  uint8_t* vq = v_codes.mutable_data_ptr<uint8_t>();
  float* sp = scales.mutable_data_ptr<float>();
  const int64_t n = param.numel();
  for (int64_t start = 0; start < n; start += kMomentBlock) {
    const int64_t end = std::min(start + kMomentBlock, n);
    float m_scale = 0.f, v_scale = 0.f;
    for (int64_t i = start; i < end; ++i) {
      m_scale = Lane::max(m_scale, math::exp_avg_magnitude(mp[i]));
      v_scale = Lane::max(v_scale, math::exp_avg_sq_root(vp[i]));
    }
    const math::QuantizingBlock b = math::quantizing_block(m_scale, v_scale);
    for (int64_t i = start; i < end; ++i) {
      mq[i] = static_cast<int8_t>(math::exp_avg_code(mp[i], b));
      vq[i] = static_cast<uint8_t>(math::exp_avg_sq_code(math::exp_avg_sq_root(vp[i]), b));
    }
    float* row = sp + 2 * (start / kMomentBlock);
    row[0] = m_scale;
    row[1] = v_scale;
  }
  const auto device = param.device();
  return {m_codes.to(device), v_codes.to(device), scales.to(device)};
}

std::pair<at::Tensor, at::Tensor> dequantize_moments(const at::Tensor& param,
                                                     const QuantizedMoments& q) {
  at::NoGradGuard no_grad;
  const auto mq = host_like(param, q.exp_avg, at::kChar);
  const auto vq = host_like(param, q.exp_avg_sq, at::kByte);
  const auto scales = q.scales.to(at::kCPU, at::kFloat).contiguous();
  auto m = at::empty_like(mq, mq.options().dtype(at::kFloat));
  auto v = at::empty_like(vq, vq.options().dtype(at::kFloat));
  const int8_t* mc = mq.const_data_ptr<int8_t>();
  const uint8_t* vc = vq.const_data_ptr<uint8_t>();
  const float* sp = scales.const_data_ptr<float>();
  float* mp = m.mutable_data_ptr<float>();
  float* vp = v.mutable_data_ptr<float>();
  const int64_t n = param.numel();
  for (int64_t start = 0; start < n; start += kMomentBlock) {
    const float* row = sp + 2 * (start / kMomentBlock);
    const math::QuantizedBlock b = math::quantized_block(row[0], row[1]);
    for (int64_t i = start; i < std::min(start + kMomentBlock, n); ++i) {
      mp[i] = math::exp_avg_value(static_cast<float>(mc[i]), b.exp_avg_step);
      vp[i] = math::exp_avg_sq_value(static_cast<float>(vc[i]), b.exp_avg_sq_step);
    }
  }
  return {m.to(param.device()), v.to(param.device())};
}

QuantizedBuffer zero_quantized_buffer(const at::Tensor& param) {
  return {at::zeros_like(param, param.options().dtype(at::kChar)),
          scales_for(param, param.options(), 1)};
}

QuantizedBuffer quantize_buffer(const at::Tensor& param, const at::Tensor& buffer) {
  at::NoGradGuard no_grad;
  const auto x = host_like(param, buffer, at::kFloat);
  auto codes = at::empty_like(x, x.options().dtype(at::kChar));
  auto scales = scales_for(param, x.options(), 1);
  const float* xp = x.const_data_ptr<float>();
  int8_t* q = codes.mutable_data_ptr<int8_t>();
  float* sp = scales.mutable_data_ptr<float>();
  const int64_t n = param.numel();
  for (int64_t start = 0; start < n; start += kMomentBlock) {
    const int64_t end = std::min(start + kMomentBlock, n);
    float scale = 0.f;
    for (int64_t i = start; i < end; ++i) {
      scale = Lane::max(scale, math::exp_avg_magnitude(xp[i]));
    }
    const math::QuantizingBlock b = math::quantizing_block(scale, 0.f);
    for (int64_t i = start; i < end; ++i) {
      q[i] = static_cast<int8_t>(math::exp_avg_code(xp[i], b));
    }
    sp[start / kMomentBlock] = scale;
  }
  const auto device = param.device();
  return {codes.to(device), scales.to(device)};
}

at::Tensor dequantize_buffer(const at::Tensor& param, const QuantizedBuffer& q) {
  at::NoGradGuard no_grad;
  const auto codes = host_like(param, q.codes, at::kChar);
  const auto scales = q.scales.to(at::kCPU, at::kFloat).contiguous();
  auto x = at::empty_like(codes, codes.options().dtype(at::kFloat));
  const int8_t* c = codes.const_data_ptr<int8_t>();
  const float* sp = scales.const_data_ptr<float>();
  float* xp = x.mutable_data_ptr<float>();
  const int64_t n = param.numel();
  for (int64_t i = 0; i < n; ++i) {
    const math::QuantizedBlock b = math::quantized_block(sp[i / kMomentBlock], 0.f);
    xp[i] = math::exp_avg_value(static_cast<float>(c[i]), b.exp_avg_step);
  }
  return x.to(param.device());
}

}  // namespace fusedamp::optim::detail
