// fusedamp::convert_module (see include/fusedamp/convert.h).
#include <fusedamp/convert.h>

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
    for (auto& kv : m.named_buffers(/*recurse=*/false)) {
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

}  // namespace fusedamp
