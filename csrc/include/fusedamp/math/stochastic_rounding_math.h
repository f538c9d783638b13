#pragma once
// master_weights="stochastic": the FP32 result of a step is rounded to the BF16 weight up or
// down at random, up with probability (distance to the lower neighbour) / (BF16 ulp), so the
// expected weight is the FP32 result and updates far below half an ulp still move the weight
// on average. No state besides the weight.
//
// The random bits are a function of (seed, step, element) only — a counter-based generator —
// so a run is reproducible from its seed, a resumed checkpoint continues bit-identically, the
// CPU and the GPU draw the same bits, and no generator state has to be saved. The seed is per
// tensor (the engine derives it from the optimizer's seed and the parameter's index); the
// counter is the tensor's step count before the update and the element's index in the tensor.
#include <fusedamp/math/float_bits.h>

namespace fusedamp::math {

// 32 well-mixed bits of (seed, step, index): a SplitMix64-style finaliser (two xor-shift-
// multiply rounds) over a Weyl-sequence combination of the three.
C10_HOST_DEVICE inline uint32_t counter_random_bits(uint64_t seed, uint32_t step, uint64_t index) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (index + 1) +
               0xD1B54A32D192ED03ull * (static_cast<uint64_t>(step) + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<uint32_t>((z ^ (z >> 31)) >> 32);
}

// The BF16 pattern of x rounded stochastically with 16 random bits: adding them below the
// kept half and truncating carries into the kept half with probability (lower half) / 2^16.
// inf and NaN are kept (NaN stays quiet). Branch-free, for the CPU vectoriser.
C10_HOST_DEVICE inline uint16_t stochastic_round_bf16(float x, uint32_t random) {
  const uint32_t bits = float_bits(x);
  const bool special = (bits & kFloatMagnitudeMask) >= kFloatInfBits;
  const uint32_t kept = (bits >> 16) | (bits_are_nan(bits) ? kBf16QuietBit : 0u);
  const uint32_t rounded = (bits + (random & 0xFFFFu)) >> 16;
  return static_cast<uint16_t>(special ? kept : rounded);
}

}  // namespace fusedamp::math
