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

namespace fusedamp::math {

struct SplitMaster {
  uint16_t weight_bits;  // the BF16 weight's pattern
  int16_t remainder;     // master pattern − weight pattern · 2^16
};

// Both functions are branch-free (selects only), so that the CPU compiler vectorises the loops
// that call them lane by lane.
C10_HOST_DEVICE inline SplitMaster split_master(float master) {
  const uint32_t bits = float_bits(master);
  const bool nan = bits_are_nan(bits);
  // + 2^15 then truncation rounds the magnitude half away from zero. No finite or infinite
  // pattern wraps: the largest, 0xFF800000 (−inf), stays below 2^32 − 2^15. A NaN keeps its
  // upper half, made quiet, and no remainder.
  const uint32_t weight = nan ? ((bits >> 16) | kBf16QuietBit) : ((bits + 0x8000u) >> 16);
  const uint32_t rest = nan ? 0u : bits - (weight << 16);
  return {static_cast<uint16_t>(weight), static_cast<int16_t>(static_cast<uint16_t>(rest))};
}

C10_HOST_DEVICE inline float combine_master(uint16_t weight_bits, int16_t remainder) {
  const uint32_t weight = static_cast<uint32_t>(weight_bits) << 16;
  const uint32_t magnitude = weight & kFloatMagnitudeMask;
  const bool wraps_below_zero = magnitude == 0u && remainder < 0;
  const bool beyond_inf =
      magnitude > kFloatInfBits || (magnitude == kFloatInfBits && remainder > 0);
  const uint32_t combined = weight + static_cast<uint32_t>(static_cast<int32_t>(remainder));
  return float_of_bits((wraps_below_zero || beyond_inf) ? weight : combined);
}

}  // namespace fusedamp::math
