// fusedamp::convert_module (see include/fusedamp/convert.h).
#include <fusedamp/convert.h>

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

namespace fusedamp {

bool is_norm_module(const std::string& /*name*/, const std::string& type_name) {
  return type_name.find("Norm") != std::string::npos;
}

int64_t convert_module(torch::nn::Module& module, c10::ScalarType dtype,
                       const KeepFp32& keep_fp32) {
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "fusedamp::convert_module: dtype must be float16 or bfloat16, got ", dtype);
  at::NoGradGuard no_grad;
  int64_t cast = 0;
  const auto cast_own = [&](torch::nn::Module& m) {
    for (auto& kv : m.named_parameters(/*recurse=*/false)) {
      auto& t = kv.value();
      if (t.is_floating_point() && t.scalar_type() != dtype) {
        t.set_data(t.to(dtype));
        ++cast;
      }
    }
  };
  // named_modules includes the root under the name "".
  for (auto& kv : module.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    auto& m = *kv.value();
    if (keep_fp32 && keep_fp32(kv.key(), m.name())) {
      continue;
    }
    cast_own(m);
  }
  return cast;
}

AutocastGuard::AutocastGuard(c10::DeviceType device_type, c10::ScalarType dtype)
    : device_type_(device_type),
      was_enabled_(at::autocast::is_autocast_enabled(device_type)),
      old_dtype_(at::autocast::get_autocast_dtype(device_type)),
      old_cache_(at::autocast::is_autocast_cache_enabled()) {
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "fusedamp::AutocastGuard: dtype must be float16 or bfloat16, got ", dtype);
  at::autocast::set_autocast_enabled(device_type, true);
  at::autocast::set_autocast_dtype(device_type, dtype);
  at::autocast::set_autocast_cache_enabled(false);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
  at::autocast::set_autocast_enabled(device_type_, was_enabled_);
  at::autocast::set_autocast_dtype(device_type_, old_dtype_);
  at::autocast::set_autocast_cache_enabled(old_cache_);
}

}  // namespace fusedamp
