#pragma once
// master_weights="split": an FP32 master stored as its BF16 rounding (the model's weight) plus
// a signed 16-bit remainder, so that the pair is the FP32 master exactly at 2 extra bytes per
// parameter instead of 4.
//
// Why ties go away from zero. The pair must be a bijection with FP32. A BF16 pattern w covers
// the FP32 patterns whose rounding is w; under round-half-to-even an even w covers 65,537 of
// them (both halfway points), one more than 16 bits can name. Rounding the magnitude with ties
// away from zero gives every w exactly the patterns [w·2^16 − 2^15, w·2^16 + 2^15): remainder
// = master pattern − w·2^16 ∈ [−32768, 32767]. The weight therefore differs from the
// round-to-nearest-even weight of master_weights=True only where the master sits exactly
// halfway between two BF16 values (its lower 16 bits are 0x8000) and the even neighbour is the
// smaller one: there it is one BF16 ulp larger in magnitude. The masters themselves are
// identical.
//
// A weight the user edited (the remainder is then stale) still wins: the master becomes the
// new weight plus the old remainder, i.e. within half a BF16 ulp of the weight, which rounds
// back to it. Where that sum would leave the weight's class — a remainder below a zero weight
// (the pattern would wrap into NaN or the other sign), or above an infinite one — the master is
// the weight itself: a pruned weight stays exactly zero.
#include <fusedamp/math/float_bits.h>
#include <fusedamp/math/lane_ops.h>

namespace fusedamp::math {

struct SplitMaster {
  uint16_t weight_bits;  // the BF16 weight's pattern
  int16_t remainder;     // master pattern − weight pattern · 2^16
};

struct Split8Master {
  uint16_t weight_bits;
  int8_t remainder;  // 24-bit master pattern − weight pattern · 2^8
};

// The formulas, on pattern lanes P (PatternOps, math/lane_ops.h): one FP32 pattern per lane, so
// that the CPU kernels run them on vectors and everything else on uint32_t. Branch-free
// (selects only).

// "split": bits (an FP32 pattern) into the weight pattern (the lane's lower 16 bits) and the
// remainder (lower 16 bits, two's complement).
template <typename P>
C10_HOST_DEVICE inline void split_patterns(P bits, P& weight, P& remainder) {
  using O = PatternOps<P>;
  const auto nan = O::greater(bits & O::splat(kFloatMagnitudeMask), O::splat(kFloatInfBits));
  // + 2^15 then truncation rounds the magnitude half away from zero. No finite or infinite
  // pattern wraps: the largest, 0xFF800000 (−inf), stays below 2^32 − 2^15. A NaN keeps its
  // upper half, made quiet, and no remainder.
  weight = O::select(nan, O::template shift_right<16>(bits) | O::splat(kBf16QuietBit),
                     O::template shift_right<16>(bits + O::splat(0x8000u)));
  remainder = O::select(nan, O::splat(0u), bits - O::template shift_left<16>(weight));
}

// "split8": bits rounded to 24 bits, then split one byte lower (remainder: the lower 8 bits).
template <typename P>
C10_HOST_DEVICE inline void split8_patterns(P bits, P& weight, P& remainder) {
  using O = PatternOps<P>;
  const auto nan = O::greater(bits & O::splat(kFloatMagnitudeMask), O::splat(kFloatInfBits));
  // Round the magnitude to 24 bits, ties to even: + 0x7F, + 1 if the kept part is odd. No
  // finite or infinite pattern wraps (the largest, 0xFF800000, stays far below 2^32 − 2^8);
  // the largest finite magnitudes round up to infinity, as IEEE rounding does.
  const P pattern24 = O::template shift_right<8>(
      bits + O::splat(0x7Fu) + (O::template shift_right<8>(bits) & O::splat(1u)));
  weight = O::select(nan, O::template shift_right<16>(bits) | O::splat(kBf16QuietBit),
                     O::template shift_right<8>(pattern24 + O::splat(0x80u)));
  remainder = O::select(nan, O::splat(0u), pattern24 - O::template shift_left<8>(weight));
}

// The FP32 pattern of a weight (its pattern in the upper half: weight_bits · 2^16) and a
// remainder (sign-extended) counted in units of 2^kShift of the FP32 pattern (0: "split",
// whose remainder is the lower half itself; 8: "split8").
template <int kShift, typename P>
C10_HOST_DEVICE inline P combine_patterns(P weight, P remainder) {
  using O = PatternOps<P>;
  const P sum = weight + O::template shift_left<kShift>(remainder);
  // The sum leaves the weight's class exactly where its sign is not the weight's (a remainder
  // below a zero weight wraps to the other sign) or it is past infinity (a remainder above an
  // infinite weight, and any of a NaN weight: a weight's lower 16 bits are 0, so no remainder,
  // at least -2^15, takes a NaN down to infinity). Every finite weight's sum stays between its
  // sign's zero and infinity: the largest, 0x7F7F0000, plus at most 2^15 - 1.
  const auto leaves = O::either(
      O::greater(O::splat(0u), sum ^ weight),
      O::greater(sum & O::splat(kFloatMagnitudeMask), O::splat(kFloatInfBits)));
  return O::select(leaves, weight, sum);
}

// One value at a time.
C10_HOST_DEVICE inline SplitMaster split_master(float master) {
  uint32_t weight, rest;
  split_patterns(float_bits(master), weight, rest);
  return {static_cast<uint16_t>(weight), static_cast<int16_t>(static_cast<uint16_t>(rest))};
}

template <int kShift>
C10_HOST_DEVICE inline float combine_weight_and_remainder(uint16_t weight_bits,
                                                          int32_t remainder) {
  return float_of_bits(combine_patterns<kShift>(static_cast<uint32_t>(weight_bits) << 16,
                                                static_cast<uint32_t>(remainder)));
}

C10_HOST_DEVICE inline float combine_master(uint16_t weight_bits, int16_t remainder) {
  return combine_weight_and_remainder<0>(weight_bits, remainder);
}

// master_weights="split8": a 24-bit master (sign, 8 exponent bits, 15 mantissa bits: the upper
// three bytes of an FP32 pattern) stored as its BF16 rounding (the model's weight) plus a
// signed 8-bit remainder: 1 extra byte per parameter instead of split's 2, for a master with
// 16 significant bits instead of 24 (BF16 alone: 8).
//
// The step's FP32 result is first rounded to 24 bits, to nearest with ties to even (an update
// below 2^-17 of the weight is lost, as one below half a BF16 ulp is without a master), then
// split as "split" splits, one byte lower: weight = the 24-bit pattern rounded half away from
// zero at its lowest byte, remainder = pattern - weight * 2^8 in [-128, 127], so every 24-bit
// pattern has exactly one (weight, remainder) pair. The edge cases follow split's: a NaN keeps
// its upper half, made quiet, and no remainder; a remainder below a zero weight or beyond an
// infinite one is ignored.
C10_HOST_DEVICE inline Split8Master split_master8(float master) {
  uint32_t weight, rest;
  split8_patterns(float_bits(master), weight, rest);
  return {static_cast<uint16_t>(weight), static_cast<int8_t>(static_cast<uint8_t>(rest))};
}

C10_HOST_DEVICE inline float combine_master8(uint16_t weight_bits, int8_t remainder) {
  return combine_weight_and_remainder<8>(weight_bits, remainder);
}

// Both splits under one name each, told apart by the remainder's type: the CPU and CUDA weight
// stores are written once for "split" (int16_t) and "split8" (int8_t).
C10_HOST_DEVICE inline float combine_split(uint16_t weight_bits, int16_t remainder) {
  return combine_master(weight_bits, remainder);
}
C10_HOST_DEVICE inline float combine_split(uint16_t weight_bits, int8_t remainder) {
  return combine_master8(weight_bits, remainder);
}
C10_HOST_DEVICE inline void split_into(float master, uint16_t& weight_bits, int16_t& remainder) {
  const SplitMaster split = split_master(master);
  weight_bits = split.weight_bits;
  remainder = split.remainder;
}
C10_HOST_DEVICE inline void split_into(float master, uint16_t& weight_bits, int8_t& remainder) {
  const Split8Master split = split_master8(master);
  weight_bits = split.weight_bits;
  remainder = split.remainder;
}
// The pattern formulas of either split, told apart the same way.
template <typename P>
C10_HOST_DEVICE inline void split_patterns_for(int16_t, P bits, P& weight, P& remainder) {
  split_patterns(bits, weight, remainder);
}
template <typename P>
C10_HOST_DEVICE inline void split_patterns_for(int8_t, P bits, P& weight, P& remainder) {
  split8_patterns(bits, weight, remainder);
}
template <typename Remainder>
constexpr int kRemainderShift = sizeof(Remainder) == 1 ? 8 : 0;

}  // namespace fusedamp::math
