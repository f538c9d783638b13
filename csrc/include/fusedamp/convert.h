#pragma once
// Casting a torch::nn::Module to FP16/BF16 for master-weight training, keeping numerically
// sensitive modules in FP32: normalisation layers (BatchNorm*, LayerNorm, GroupNorm,
// InstanceNorm*, LocalResponseNorm and any module whose type name contains "Norm") keep FP32
// parameters. Buffers keep their dtype (running statistics, position tables, rotary
// frequencies): the model's code casts them where it means to. A norm layer then sees FP32
// inputs only if the caller casts them (x.to(at::kFloat)) — LibTorch modules do not cast their
// inputs. Run the converted model's forward under an AutocastGuard, as Python's
// fusedamp.convert_module does, so that the operations torch's autocast keeps in FP32 (losses,
// and on CUDA softmax, norms, exp/log/pow, sums) run in FP32 inside it.
#include <c10/core/DeviceType.h>
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

// Casts, in place, every floating-point parameter of every module not kept FP32 to `dtype`
// (kHalf or kBFloat16). Parameters keep their identity (set_data), so optimizers and
// references held elsewhere stay valid. Returns the number of tensors cast.
int64_t convert_module(torch::nn::Module& module, c10::ScalarType dtype,
                       const KeepFp32& keep_fp32 = is_norm_module);

// torch.autocast(device_type, dtype) for a scope (Python's `with torch.autocast(...)`): the
// operations on autocast's FP32 list for the device run in FP32, the matrix products in
// `dtype`. Restores the previous autocast state when it goes out of scope. The weights of a
// converted model already have `dtype`, so no weight cast is cached.
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device_type, c10::ScalarType dtype);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_type_;
  bool was_enabled_;
  c10::ScalarType old_dtype_;
  bool old_cache_;
};

}  // namespace fusedamp
