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

namespace fusedamp::optim {

bool MasterWeights::fits(at::ScalarType param_dtype) const {
  if (param_dtype == at::kFloat || param_dtype == at::kBFloat16) {
    return true;
  }
  return kind_ != kSplit && kind_ != kSplit8 && kind_ != kStochastic;  // BF16 formats
}

const char* MasterWeights::name() const {
  switch (kind_) {
    case kOff:
      return "False";
    case kFp32:
      return "True";
    case kSplit:
      return "split";
    case kSplit8:
      return "split8";
    case kKahan:
      return "kahan";
    case kStochastic:
      return "stochastic";
  }
  return "?";
}

namespace {
constexpr const char* kModes =
    "True (an FP32 master copy), False (none), \"split\" (BF16 weight + int16 remainder = the "
    "FP32 master exactly), \"split8\" (BF16 weight + int8 remainder = a 24-bit master), "
    "\"kahan\" (a 16-bit compensation buffer) or \"stochastic\" (BF16 stochastic rounding); "
    "True may also be named \"fp32\" or \"float32\", False \"off\"";
}  // namespace

MasterWeights MasterWeights::from_code(double code) {
  TORCH_CHECK_VALUE(code == 0.0 || code == 1.0 || code == 2.0 || code == 3.0 || code == 4.0 ||
                        code == 5.0,
                    "fusedamp: master_weights must be ", kModes, "; got the code ", code);
  return MasterWeights(static_cast<Kind>(static_cast<int>(code)));
}

MasterWeights MasterWeights::from_name(const std::string& name) {
  if (name == "split") return kSplit;
  if (name == "split8") return kSplit8;
  if (name == "kahan") return kKahan;
  if (name == "stochastic") return kStochastic;
  if (name == "fp32" || name == "float32") return kFp32;
  if (name == "off") return kOff;
  TORCH_CHECK_VALUE(false, "fusedamp: master_weights must be ", kModes, "; got '", name, "'");
}

namespace detail {
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
