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

QuantizedMoments zero_quantized_moments(const at::Tensor& param, bool with_exp_avg_sq) {
  return {at::zeros_like(param, param.options().dtype(at::kChar)),
          with_exp_avg_sq ? at::zeros_like(param, param.options().dtype(at::kByte))
                          : at::Tensor(),
          scales_for(param, param.options(), with_exp_avg_sq ? 2 : 1)};
}

QuantizedMoments quantize_moments(const at::Tensor& param, const at::Tensor& exp_avg,
                                  const at::Tensor& exp_avg_sq) {
  at::NoGradGuard no_grad;
  const bool with_v = exp_avg_sq.defined();
  const int64_t columns = with_v ? 2 : 1;
  const auto m = host_like(param, exp_avg, at::kFloat);
  const auto v = with_v ? host_like(param, exp_avg_sq, at::kFloat) : at::Tensor();
  auto m_codes = at::empty_like(m, m.options().dtype(at::kChar));
  auto v_codes = with_v ? at::empty_like(v, v.options().dtype(at::kByte)) : at::Tensor();
  auto scales = scales_for(param, m.options(), columns);
  const float* mp = m.const_data_ptr<float>();
  const float* vp = with_v ? v.const_data_ptr<float>() : nullptr;
  int8_t* mq = m_codes.mutable_data_ptr<int8_t>();
  uint8_t* vq = with_v ? v_codes.mutable_data_ptr<uint8_t>() : nullptr;
  float* sp = scales.mutable_data_ptr<float>();
  const int64_t n = param.numel();
  for (int64_t start = 0; start < n; start += kMomentBlock) {
    const int64_t end = std::min(start + kMomentBlock, n);
    float m_scale = 0.f, v_scale = 0.f;
    for (int64_t i = start; i < end; ++i) {
      m_scale = Lane::max(m_scale, math::block_scale_magnitude(mp[i]));
      if (with_v) {
        v_scale = Lane::max(v_scale, math::block_scale_magnitude(math::exp_avg_sq_root(vp[i])));
      }
    }
    const math::QuantizingBlock b = math::quantizing_block(m_scale, v_scale);
    for (int64_t i = start; i < end; ++i) {
      mq[i] = static_cast<int8_t>(math::exp_avg_code(mp[i], b));
      if (with_v) {
        vq[i] = static_cast<uint8_t>(math::exp_avg_sq_code(math::exp_avg_sq_root(vp[i]), b));
      }
    }
    float* row = sp + columns * (start / kMomentBlock);
    row[0] = m_scale;
    if (with_v) {
      row[1] = v_scale;
    }
  }
  const auto device = param.device();
  return {m_codes.to(device), with_v ? v_codes.to(device) : at::Tensor(), scales.to(device)};
}

std::pair<at::Tensor, at::Tensor> dequantize_moments(const at::Tensor& param,
                                                     const QuantizedMoments& q) {
  at::NoGradGuard no_grad;
  const bool with_v = q.exp_avg_sq.defined();
  const int64_t columns = with_v ? 2 : 1;
  const auto mq = host_like(param, q.exp_avg, at::kChar);
  const auto vq = with_v ? host_like(param, q.exp_avg_sq, at::kByte) : at::Tensor();
  const auto scales = q.scales.to(at::kCPU, at::kFloat).contiguous();
  auto m = at::empty_like(mq, mq.options().dtype(at::kFloat));
  auto v = with_v ? at::empty_like(vq, vq.options().dtype(at::kFloat)) : at::Tensor();
  const int8_t* mc = mq.const_data_ptr<int8_t>();
  const uint8_t* vc = with_v ? vq.const_data_ptr<uint8_t>() : nullptr;
  const float* sp = scales.const_data_ptr<float>();
  float* mp = m.mutable_data_ptr<float>();
  float* vp = with_v ? v.mutable_data_ptr<float>() : nullptr;
  const int64_t n = param.numel();
  for (int64_t start = 0; start < n; start += kMomentBlock) {
    const float* row = sp + columns * (start / kMomentBlock);
    const math::QuantizedBlock b = math::quantized_block(row[0], with_v ? row[1] : 0.f);
    for (int64_t i = start; i < std::min(start + kMomentBlock, n); ++i) {
      mp[i] = math::exp_avg_value(static_cast<float>(mc[i]), b.exp_avg_step);
      if (with_v) {
        vp[i] = math::exp_avg_sq_value(static_cast<float>(vc[i]), b.exp_avg_sq_step);
      }
    }
  }
  return {m.to(param.device()), with_v ? v.to(param.device()) : at::Tensor()};
}

}  // namespace fusedamp::optim::detail
