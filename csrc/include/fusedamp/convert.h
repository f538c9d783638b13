#pragma once
// Casting a torch::nn::Module to FP16/BF16 for master-weight training, keeping numerically
// sensitive modules in FP32: normalisation layers (BatchNorm*, LayerNorm, GroupNorm,
// InstanceNorm*, LocalResponseNorm and any module whose type name contains "Norm") keep FP32
// parameters and buffers. A norm layer then sees FP32 inputs only if the caller casts them
// (x.to(at::kFloat)) — LibTorch modules do not cast their inputs.
#include <c10/core/ScalarType.h>

#include <functional>
#include <string>

namespace torch::nn {
class Module;
}

namespace fusedamp {

// true: keep this module's own parameters and buffers in FP32.
// `name` is the dotted path in the module tree ("" for the root), `type_name` Module::name().
using KeepFp32 = std::function<bool(const std::string& name, const std::string& type_name)>;

// The default rule: the type name contains "Norm".
bool is_norm_module(const std::string& name, const std::string& type_name);

// Casts, in place, every floating-point parameter and buffer of every module not kept FP32 to
// `dtype` (kHalf or kBFloat16). Parameters keep their identity (set_data), so optimizers and
// references held elsewhere stay valid. Returns the number of tensors cast.
int64_t convert_module(torch::nn::Module& module, c10::ScalarType dtype,
                       const KeepFp32& keep_fp32 = is_norm_module);

}  // namespace fusedamp
