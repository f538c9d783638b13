// fusedamp::optim::MasterWeights (options.h) and the conversion of a parameter's weight store
// between the modes (param_state_store.h): a state dict may hold what another mode keeps, and
// a group's mode may change between steps; the next bucket build converts, exactly where the
// two modes can represent the same FP32 master (FP32 master <-> split).
#include "master_weights.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fusedamp/math/kahan_math.h>
#include <fusedamp/math/split_math.h>

#include <cmath>
#include <string>
#include <vector>

namespace fusedamp::optim {

bool MasterWeights::fits(at::ScalarType param_dtype) const {
  return param_dtype == at::kFloat || master_mode_fits(info(), param_dtype);
}

const char* MasterWeights::name() const {
  return info().spelling != nullptr ? info().spelling : "(a kernel variant, no option)";
}

std::string MasterWeights::choices(bool (*taken)(Kind)) {
  std::vector<std::string> modes;
  std::string other_names;
  for (const auto& info : kMasterModes) {
    if (info.spelling == nullptr || (taken != nullptr && !taken(info.mode))) {
      continue;
    }
    modes.push_back(std::string(info.spelling) + " (" + info.about + ")");
    // The names that are not the spelling itself ("fp32" for True).
    std::vector<std::string> also;
    for (const char* n : info.names) {
      const std::string quoted = n != nullptr ? "\"" + std::string(n) + "\"" : "";
      if (n != nullptr && quoted != info.spelling) {
        also.push_back(quoted);
      }
    }
    if (!also.empty()) {
      other_names += (other_names.empty() ? "" : ", ") + std::string(info.spelling) +
                     (other_names.empty() ? " may also be named " : " ") + one_of(also);
    }
  }
  return other_names.empty() ? one_of(modes) : one_of(modes) + "; " + other_names;
}

MasterWeights MasterWeights::from_code(double code) {
  for (const auto& info : kMasterModes) {
    if (info.spelling != nullptr && code == static_cast<double>(info.mode)) {
      return info.mode;
    }
  }
  TORCH_CHECK_VALUE(false, "fusedamp: master_weights must be ", choices(), "; got the code ",
                    code);
}

MasterWeights MasterWeights::from_name(const std::string& name) {
  for (const auto& info : kMasterModes) {
    for (const char* n : info.names) {
      if (info.spelling != nullptr && n != nullptr && name == n) {
        return info.mode;
      }
    }
  }
  TORCH_CHECK_VALUE(false, "fusedamp: master_weights must be ", choices(), "; got '", name, "'");
}

namespace detail {

std::string modes_serving(at::ScalarType dtype) {
  std::vector<std::string> modes;
  for (const auto& info : kMasterModes) {
    if (info.spelling != nullptr && master_mode_fits(info, dtype) &&
        (info.kept != MasterKept::kNothing || info.seeded)) {
      modes.emplace_back(info.spelling);
    }
  }
  return one_of(modes);
}

namespace {

// Host copies for the element loops (conversions are rare: a load, a change of mode).
at::Tensor host_contiguous(const at::Tensor& t) {
  return t.detach().to(at::kCPU).contiguous();
}

// `values` (any device, contiguous element order of `like`) into a new tensor of `dtype` with
// like's shape, strides and device.
at::Tensor shaped_like(const at::Tensor& like, const at::Tensor& values, at::ScalarType dtype) {
  auto out = at::empty_like(like, like.options().dtype(dtype));
  out.copy_(values.view(like.sizes()));
  return out;
}

}  // namespace

namespace {

// The two split formats' element functions, by remainder type: int16 ("split") and int8
// ("split8").
float combine(uint16_t w, int16_t r) { return math::combine_master(w, r); }
float combine(uint16_t w, int8_t r) { return math::combine_master8(w, r); }
math::SplitMaster split_of(float m, int16_t) { return math::split_master(m); }
math::Split8Master split_of(float m, int8_t) { return math::split_master8(m); }

template <typename R>
at::Tensor fp32_from_split_as(const at::Tensor& param, const at::Tensor& remainder) {
  const auto weight = host_contiguous(param);
  const auto rest = host_contiguous(remainder);
  auto master = at::empty(weight.sizes(), weight.options().dtype(at::kFloat));
  const auto* w = reinterpret_cast<const uint16_t*>(weight.const_data_ptr());
  const auto* r = rest.const_data_ptr<R>();
  float* m = master.data_ptr<float>();
  for (int64_t i = 0; i < master.numel(); ++i) {
    m[i] = combine(w[i], r[i]);
  }
  return shaped_like(param, master, at::kFloat);
}

template <typename R>
SplitState split_from_fp32_as(const at::Tensor& param, const at::Tensor& master,
                              at::ScalarType remainder_dtype) {
  const auto source = host_contiguous(master.to(at::kFloat));
  auto weight = at::empty(source.sizes(), source.options().dtype(at::kBFloat16));
  auto rest = at::empty(source.sizes(), source.options().dtype(remainder_dtype));
  const float* m = source.const_data_ptr<float>();
  auto* w = reinterpret_cast<uint16_t*>(weight.data_ptr());
  R* r = rest.data_ptr<R>();
  for (int64_t i = 0; i < source.numel(); ++i) {
    const auto split = split_of(m[i], R{});
    w[i] = split.weight_bits;
    r[i] = split.remainder;
  }
  return {shaped_like(param, weight, at::kBFloat16), shaped_like(param, rest, remainder_dtype)};
}

}  // namespace

at::Tensor fp32_from_split(const at::Tensor& param, const at::Tensor& remainder) {
  return remainder.scalar_type() == at::kChar ? fp32_from_split_as<int8_t>(param, remainder)
                                              : fp32_from_split_as<int16_t>(param, remainder);
}

SplitState split_from_fp32(const at::Tensor& param, const at::Tensor& master,
                           at::ScalarType remainder_dtype) {
  return remainder_dtype == at::kChar
             ? split_from_fp32_as<int8_t>(param, master, remainder_dtype)
             : split_from_fp32_as<int16_t>(param, master, remainder_dtype);
}

at::Tensor fp32_from_kahan(const at::Tensor& param, const at::Tensor& compensation) {
  return param.detach().to(at::kFloat) + compensation.to(at::kFloat);
}

at::Tensor kahan_from_fp32(const at::Tensor& param, const at::Tensor& master) {
  const auto rounded = master.to(param.scalar_type()).to(at::kFloat);
  return shaped_like(param, math::kahan_compensation(master.to(at::kFloat), rounded),
                     param.scalar_type());
}

}  // namespace detail
}  // namespace fusedamp::optim
