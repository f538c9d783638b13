#pragma once
// state_dtype=int8: Adam's moments kept in 8 bits per element, in blocks of kMomentBlock
// consecutive elements of each parameter's own element index (a block never spans two
// parameters, so the stored state does not depend on how a step's lists are grouped, chunked
// or partitioned over ranks parameter by parameter), with one FP32 scale per block and moment.
// The formats were chosen by benchmarks/moment_formats.py (results/moment_formats_cpu.md):
//
//   exp_avg     int8 code q in [-127, 127] of sign(m) sqrt(|m| / s_m), s_m = the block's
//               largest |m|; stored value q |q| s_m / 127^2. The square-root companding gives
//               small moments more codes than a linear code (update error 0.044 against
//               softsign's 0.052 and linear's 0.062 on the study's models).
//   exp_avg_sq  uint8 code q in [0, 255] of v^(1/4) / s_v, s_v = the block's largest v^(1/4);
//               stored value (q s_v / 255)^4. A linear or square-root code stores small v as 0
//               beside a nonzero m (an update of m / eps: every linear run of the study
//               diverged); in the fourth-root domain 0.0067 % of nonzero v became 0 and every
//               run stayed bounded.
//
// The scales are FP32, not the study's 16-bit ones: FP16 scales were subnormal for a third of
// the exp_avg blocks and zeroed 9 % of the nonzero m (the smallest moments of a model whose
// gradients are small), BF16 ones biased v low; FP32 costs 2 x 2 / 32 = 0.125 B/param more.
//
// A step reads a block's codes and scales, updates the moments in FP32 (adam_math.h), then
// quantizes the new moments with the block's new scales: the update of this step uses the
// exact new moments, the next step their stored values.
//
// A moment that is not finite (a non-finite gradient stepped without a skip, or a v whose
// g * g overflows) is left out of its block's scale and stored as code 0: its weight takes
// this step's update from the exact moments as torch's does (NaN or inf after a non-finite
// gradient), and its moments start again from 0 at the next step. The block's other elements
// are coded against the largest of their own values, so their codes, and their weights, are
// what they would have been had that element's moment been any finite one no larger. A scale
// made of the non-finite value would instead make every code of the block 0 and decode, at
// the next step, as 0 x inf = NaN: one bad element would spoil all 32.
#include <fusedamp/math/float_bits.h>
#include <fusedamp/math/lane_ops.h>

#include <cstdint>

namespace fusedamp::math {

constexpr int64_t kMomentBlock = 32;
constexpr float kExpAvgLevels = 127.f;
constexpr float kExpAvgSqLevels = 255.f;

// The scales of a parameter of n elements: one row per block, [exp_avg scale, exp_avg_sq
// scale].
C10_HOST_DEVICE inline int64_t moment_blocks(int64_t numel) {
  return (numel + kMomentBlock - 1) / kMomentBlock;
}

// ---- per block: what a scale makes of the codes ------------------------------------------
// exp_avg_step is FP32: subnormal where the block's largest |m| is below 127^2 2^-126 (about
// 1.9e-34), 0 below 127^2 2^-150 (1.1e-41), so the smallest blocks decode to fewer bits than
// their codes hold, the very smallest to 0. Decoding through the codes' 2^64 would cost every
// step a multiply per element, for moments whose updates no weight shows (measured:
// docs/master_weights.md#fp32-subnormal-blocks).
struct QuantizedBlock {
  float exp_avg_step;     // stored m = q |q| * exp_avg_step
  float exp_avg_sq_step;  // stored v = (q * exp_avg_sq_step)^4
};

C10_HOST_DEVICE inline QuantizedBlock quantized_block(float exp_avg_scale,
                                                      float exp_avg_sq_scale) {
  return {exp_avg_scale / (kExpAvgLevels * kExpAvgLevels), exp_avg_sq_scale / kExpAvgSqLevels};
}

// What the codes of a block with these scales are formed with: u = |m| * exp_avg_prescale *
// exp_avg_inverse, q = v^(1/4) * exp_avg_sq_factor. A block with no nonzero finite value has
// scale 0, and inverse and factor 0: its codes are 0 (a non-finite value's unrounded code is
// then NaN, and its code 0 too). Below 2^-126 (a subnormal largest |m|, whose reciprocal may
// overflow FP32) the values are first scaled by 2^64, exactly: the codes are then those of the
// same block 2^64 times larger. (v^(1/4) of an FP32 v is at least 2^-37.25: its factor never
// overflows.)
struct QuantizingBlock {
  float exp_avg_prescale;
  float exp_avg_inverse;
  float exp_avg_sq_factor;
};

C10_HOST_DEVICE inline QuantizingBlock quantizing_block(float exp_avg_scale,
                                                        float exp_avg_sq_scale) {
  const float prescale =
      exp_avg_scale < kFloatSmallestNormal ? 18446744073709551616.f : 1.f;  // 2^64
  const auto usable = [](float s) { return s > 0.f && s <= kFloatLargest; };  // false for NaN
  return {prescale, usable(exp_avg_scale) ? 1.f / (exp_avg_scale * prescale) : 0.f,
          usable(exp_avg_sq_scale) ? kExpAvgSqLevels / exp_avg_sq_scale : 0.f};
}

// ---- per element (lane type V, lane_ops.h) -------------------------------------------------

// The stored value of an exp_avg code (q as a float lane).
template <typename V>
C10_HOST_DEVICE inline V exp_avg_value(V q, float step) {
  return q * LaneOps<V>::abs(q) * V(step);
}

// The stored value of an exp_avg_sq code.
template <typename V>
C10_HOST_DEVICE inline V exp_avg_sq_value(V q, float step) {
  const V t = q * V(step);
  const V t2 = t * t;
  return t2 * t2;
}

// What a block's scales are the largest of: |m| (exp_avg) and v^(1/4) (exp_avg_sq) where
// finite, 0 where not (see the top of this file).
template <typename V>
C10_HOST_DEVICE inline V block_scale_magnitude(V x) {
  return LaneOps<V>::max_finite_magnitude(V(0.f), LaneOps<V>::abs(x));
}

// What a block's exp_avg_sq scale is the largest of, and its code is formed from: v^(1/4),
// from sqrt(v) (which the step's denominator has taken already).
template <typename V>
C10_HOST_DEVICE inline V exp_avg_sq_root_of_sqrt(V sqrt_v) {
  return LaneOps<V>::sqrt(sqrt_v);
}

template <typename V>
C10_HOST_DEVICE inline V exp_avg_sq_root(V v) {
  return exp_avg_sq_root_of_sqrt(LaneOps<V>::sqrt(v));
}

// The codes before rounding: sign(m) 127 sqrt(|m| / s_m), and 255 v^(1/4) / s_v. Every element
// of a block is at most its scale, and the reciprocal and the product are each rounded once
// (u <= 1 + 2^-23, whose square root rounds to at most 1), so no unrounded code exceeds 127
// (255) by 2^-15: the nearest integer is never beyond the last level, and no clamp is needed.
// A non-finite moment's is inf or NaN, and its code 0 (nearest_code).
template <typename V>
C10_HOST_DEVICE inline V exp_avg_code_unrounded(V m, const QuantizingBlock& b) {
  const V u = LaneOps<V>::abs(m) * V(b.exp_avg_prescale) * V(b.exp_avg_inverse);
  return LaneOps<V>::copysign(LaneOps<V>::sqrt(u) * V(kExpAvgLevels), m);
}

template <typename V>
C10_HOST_DEVICE inline V exp_avg_sq_code_unrounded(V root, const QuantizingBlock& b) {
  return root * V(b.exp_avg_sq_factor);
}

// The stored code of an unrounded one: the nearest integer, ties to even; NaN and +-inf store
// 0 (x - x is 0 only where x is finite). (The CPU's vector stores convert and narrow in one go,
// cpu/vec_io.h store_nearest_codes, to the same codes.)
template <typename V>
C10_HOST_DEVICE inline V nearest_code(V x) {
  return LaneOps<V>::where_equal(x - x, V(0.f), LaneOps<V>::rint(x), V(0.f));
}

// The int8 code of m (a float lane holding an integer in [-127, 127]).
template <typename V>
C10_HOST_DEVICE inline V exp_avg_code(V m, const QuantizingBlock& b) {
  return nearest_code(exp_avg_code_unrounded(m, b));
}

// The uint8 code of v from its fourth root (an integer in [0, 255]).
template <typename V>
C10_HOST_DEVICE inline V exp_avg_sq_code(V root, const QuantizingBlock& b) {
  return nearest_code(exp_avg_sq_code_unrounded(root, b));
}

}  // namespace fusedamp::math
