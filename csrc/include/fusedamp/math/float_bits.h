#pragma once
// A float's IEEE-754 bit pattern and back, and the edges of its range, on the host and the
// device. The 16-bit weight formats of math/split_math.h and math/stochastic_rounding_math.h
// work on the pattern: BF16 is the upper half of an FP32 pattern, and for one sign the
// patterns of finite values are ordered like their magnitudes, so rounding a magnitude is
// integer arithmetic on it.
#include <c10/macros/Macros.h>

#include <cstdint>
#include <cstring>

namespace fusedamp::math {

C10_HOST_DEVICE inline uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

C10_HOST_DEVICE inline float float_of_bits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
#endif
}

constexpr float kFloatSmallestNormal = 1.17549435e-38f;  // 2^-126 (BF16's too)
constexpr float kFloatLargest = 3.40282347e+38f;

constexpr uint32_t kFloatMagnitudeMask = 0x7FFFFFFFu;
constexpr uint32_t kFloatInfBits = 0x7F800000u;
// A quiet-NaN bit of BF16 (and, shifted by 16, of FP32): set so a NaN stays a NaN when its
// lower half is dropped.
constexpr uint16_t kBf16QuietBit = 0x0040u;

C10_HOST_DEVICE inline bool bits_are_nan(uint32_t bits) {
  return (bits & kFloatMagnitudeMask) > kFloatInfBits;
}

}  // namespace fusedamp::math
