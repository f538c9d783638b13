// fusedamp._C — the pybind11 module. Bindings of the C++ engine live in one file per
// concept (bind_*.cpp) and are registered here.
#include <ATen/Version.h>
#include <fusedamp/math/quantized_moments_math.h>

#include "bindings.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fusedamp: fused mixed-precision training engine (C++ core)";
  m.def("cpu_capability", [] { return at::get_cpu_capability(); },
        "Instruction set of the CPU kernels in use (DEFAULT, AVX2 or AVX512).");
  m.def("built_with_cuda", [] {
#if defined(FUSEDAMP_WITH_CUDA)
    return true;
#else
    return false;
#endif
  }, "Whether libfusedamp was built with its CUDA kernels.");
  // state_dtype=int8: elements per block of the moments' codes (one pair of scales each).
  m.attr("MOMENT_BLOCK") = fusedamp::math::kMomentBlock;
  fusedamp::python::bind_all(m);
}
