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
  return kind_ != kSplit && kind_ != kStochastic;  // both are BF16 formats
}

const char* MasterWeights::name() const {
  switch (kind_) {
    case kOff:
      return "False";
    case kFp32:
      return "True";
    case kSplit:
      return "split";
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
    "FP32 master exactly), \"kahan\" (a 16-bit compensation buffer) or \"stochastic\" (BF16 "
    "stochastic rounding); True may also be named \"fp32\" or \"float32\", False \"off\"";
}  // namespace

MasterWeights MasterWeights::from_code(double code) {
  TORCH_CHECK_VALUE(code == 0.0 || code == 1.0 || code == 2.0 || code == 3.0 || code == 4.0,
                    "fusedamp: master_weights must be ", kModes, "; got the code ", code);
  return MasterWeights(static_cast<Kind>(static_cast<int>(code)));
}

MasterWeights MasterWeights::from_name(const std::string& name) {
  if (name == "split") return kSplit;
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

at::Tensor fp32_from_split(const at::Tensor& param, const at::Tensor& remainder) {
  const auto weight = host_contiguous(param);
  const auto rest = host_contiguous(remainder);
  auto master = at::empty(weight.sizes(), weight.options().dtype(at::kFloat));
  const auto* w = reinterpret_cast<const uint16_t*>(weight.const_data_ptr());
  const auto* r = rest.const_data_ptr<int16_t>();
  float* m = master.data_ptr<float>();
  for (int64_t i = 0; i < master.numel(); ++i) {
    m[i] = math::combine_master(w[i], r[i]);
  }
  return shaped_like(param, master, at::kFloat);
}

SplitState split_from_fp32(const at::Tensor& param, const at::Tensor& master) {
  const auto source = host_contiguous(master.to(at::kFloat));
  auto weight = at::empty(source.sizes(), source.options().dtype(at::kBFloat16));
  auto rest = at::empty(source.sizes(), source.options().dtype(at::kShort));
  const float* m = source.const_data_ptr<float>();
  auto* w = reinterpret_cast<uint16_t*>(weight.data_ptr());
  int16_t* r = rest.data_ptr<int16_t>();
  for (int64_t i = 0; i < source.numel(); ++i) {
    const math::SplitMaster split = math::split_master(m[i]);
    w[i] = split.weight_bits;
    r[i] = split.remainder;
  }
  return {shaped_like(param, weight, at::kBFloat16), shaped_like(param, rest, at::kShort)};
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
