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
#include <fusedamp/math/lane_ops.h>

namespace fusedamp::math {

// The counter's Weyl-sequence combination: z(index) = counter_start(seed, step) + kWeylStep *
// index (mod 2^64), so a run of consecutive indices needs one multiplication, then additions.
constexpr uint64_t kWeylStep = 0x9E3779B97F4A7C15ull;
C10_HOST_DEVICE inline uint64_t counter_start(uint64_t seed, uint32_t step) {
  return seed + kWeylStep + 0xD1B54A32D192ED03ull * (static_cast<uint64_t>(step) + 1);
}

// A SplitMix64-style finaliser (two xor-shift-multiply rounds) over 64-bit lanes U: uint64_t,
// or a CPU kernel's vector of them (+, ^, * and >> by a constant, wrapping as uint64_t does).
// The random bits are the upper 32 of the result.
template <typename U>
C10_HOST_DEVICE inline U counter_mix(U z) {
  z = (z ^ (z >> 30)) * U(0xBF58476D1CE4E5B9ull);
  z = (z ^ (z >> 27)) * U(0x94D049BB133111EBull);
  return z ^ (z >> 31);
}

// 32 well-mixed bits of (seed, step, index).
C10_HOST_DEVICE inline uint32_t counter_random_bits(uint64_t seed, uint32_t step, uint64_t index) {
  return static_cast<uint32_t>(counter_mix(counter_start(seed, step) + kWeylStep * index) >> 32);
}

// A parameter's seed: 64 mixed bits of (the group's seed, the parameter's index in its
// optimizer), so that parameters draw independent streams from one user seed.
C10_HOST_DEVICE inline int64_t param_rounding_seed(int64_t group_seed, int64_t param_index) {
  const auto seed = static_cast<uint64_t>(group_seed);
  const auto index = static_cast<uint64_t>(param_index);
  const uint64_t high = counter_random_bits(seed, 0xFFFFFFFFu, index);
  const uint64_t low = counter_random_bits(seed, 0xFFFFFFFEu, index);
  return static_cast<int64_t>((high << 32) | low);
}

// The BF16 pattern (the lane's lower 16 bits) of an FP32 pattern rounded stochastically with 16
// random bits, on pattern lanes P (PatternOps, math/lane_ops.h): adding them below the kept half
// and truncating carries into the kept half with probability (lower half) / 2^16. inf and NaN
// are kept (NaN stays quiet). Branch-free.
template <typename P>
C10_HOST_DEVICE inline P stochastic_round_patterns(P bits, P random) {
  using O = PatternOps<P>;
  const P magnitude = bits & O::splat(kFloatMagnitudeMask);
  const auto special = O::greater(magnitude, O::splat(kFloatInfBits - 1u));  // inf, NaN
  const auto nan = O::greater(magnitude, O::splat(kFloatInfBits));
  const P kept = O::template shift_right<16>(bits) |
                 O::select(nan, O::splat(kBf16QuietBit), O::splat(0u));
  const P rounded = O::template shift_right<16>(bits + (random & O::splat(0xFFFFu)));
  return O::select(special, kept, rounded);
}

C10_HOST_DEVICE inline uint16_t stochastic_round_bf16(float x, uint32_t random) {
  return static_cast<uint16_t>(stochastic_round_patterns(float_bits(x), random));
}

}  // namespace fusedamp::math
