#pragma once
// Gradient telemetry, gathered in the same read as the overflow check (grad_stats_): the
// largest finite magnitude (amax), how many elements lie below the smallest normal number of
// their dtype (zero included) and how many are exactly zero. Subnormal = small - zero.
//
// amax ignores inf and NaN on purpose: an overflowing step still reports how large its finite
// gradients were, which is what the amax scale policy (scale_math.h) backs off from. Counts are
// kept in float lanes: a lane sees at most one chunk of elements (< 2^24), so they are exact,
// and are summed into doubles per chunk.
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include <fusedamp/math/float_bits.h>
#include <fusedamp/math/lane_ops.h>

namespace fusedamp::math {

// The smallest positive normal number of the gradient's element type, as the FP32 lanes hold
// it: below it an FP16 gradient has lost precision (or flushed to zero).
template <typename T>
constexpr float smallest_normal() {
  return kFloatSmallestNormal;  // FP32 and BF16 (same exponent range)
}
template <>
constexpr float smallest_normal<c10::Half>() {
  return 6.103515625e-05f;  // 2^-14
}

template <typename V>
struct TelemetryLanes {
  V amax;     // largest finite |x|
  V n_small;  // |x| < smallest normal (zeros included)
  V n_zero;   // x == 0
};

template <typename V>
C10_HOST_DEVICE inline TelemetryLanes<V> telemetry_zero() {
  return {V(0.f), V(0.f), V(0.f)};
}

template <typename V>
C10_HOST_DEVICE inline void accumulate_telemetry(TelemetryLanes<V>& t, V x, V smallest_normal) {
  const V magnitude = LaneOps<V>::abs(x);
  t.amax = LaneOps<V>::max_finite_magnitude(t.amax, magnitude);
  t.n_small = LaneOps<V>::count_if_less(t.n_small, magnitude, smallest_normal);
  t.n_zero = LaneOps<V>::count_if_equal(t.n_zero, x, V(0.f));
}

// The same telemetry read from a 16-bit gradient's bit patterns, 16-bit lane by 16-bit lane
// (twice the lanes of the FP32 values, no conversion): with m = bits & 0x7FFF, the magnitude's
// pattern, patterns order as magnitudes do and every NaN lies above +inf, so
//   |x| finite              <=>  m <  kInf          (and amax = the largest such m, as a value)
//   |x| < smallest normal   <=>  m <  kSmallestNormal
//   x == 0 (either sign)    <=>  m == 0
//   x not finite            <=>  m >= kInf
// — the values accumulate_telemetry and the overflow check find, bit for bit.
template <typename T>
struct HalfPatterns;
template <>
struct HalfPatterns<c10::Half> {
  static constexpr uint16_t kInf = 0x7C00;
  static constexpr uint16_t kSmallestNormal = 0x0400;  // 2^-14
  static float value(uint16_t m) { return static_cast<float>(c10::Half(m, c10::Half::from_bits())); }
};
template <>
struct HalfPatterns<c10::BFloat16> {
  static constexpr uint16_t kInf = 0x7F80;
  static constexpr uint16_t kSmallestNormal = 0x0080;  // 2^-126
  static float value(uint16_t m) { return float_of_bits(static_cast<uint32_t>(m) << 16); }
};

// What grad_stats_'s telemetry tensor holds (FP64, in this order), and how calls combine:
// amax by max, counts by sum, the first non-finite grad's list position by min (the caller seeds
// it with +inf: "none").
enum TelemetrySlot : int64_t {
  kAmax = 0,
  kSubnormal = 1,
  kZero = 2,
  kFirstNonfinite = 3,
  kTelemetrySlots = 4,
};

// One row of a loss scaler's telemetry ring per iteration (record_telemetry_, FP64): the scale
// the gradients carried, found_inf, then the iteration's measurements as grad_stats_'s slots
// combined them, then the sum of squares of the scaled gradients. Derived values (norm,
// fractions) are computed when the ring is read.
enum TelemetryColumn : int64_t {
  kColumnScale = 0,
  kColumnFoundInf = 1,
  kColumnMeasured = 2,  // kTelemetrySlots columns
  kColumnSumSq = kColumnMeasured + kTelemetrySlots,
  kTelemetryColumns,
};

// The ring row an iteration's record goes to: the ring's position (how many records it has
// taken, kept on the device and advanced by the record itself, so that a replayed CUDA graph
// writes the next row) modulo its rows. Any position names a row, a negative one included.
C10_HOST_DEVICE inline int64_t telemetry_row(int64_t position, int64_t rows) {
  const int64_t row = position % rows;
  return row < 0 ? row + rows : row;
}

// measured: the slots and then the sum of squares so far (FP64[kTelemetrySlots + 1]);
// pass_sum_sq (or nullptr): a pass's FP32 sum not yet added to it. Every input is read before
// the row is written (the row may overlap them).
C10_HOST_DEVICE inline void write_telemetry_row(double* row, float scale, float found_inf,
                                                const double* measured,
                                                const float* pass_sum_sq) {
  double values[kTelemetryColumns];
  values[kColumnScale] = scale;
  values[kColumnFoundInf] = found_inf;
  for (int64_t k = 0; k < kTelemetrySlots; ++k) {
    values[kColumnMeasured + k] = measured[k];
  }
  values[kColumnSumSq] = measured[kTelemetrySlots] +
                         (pass_sum_sq != nullptr ? static_cast<double>(*pass_sum_sq) : 0.0);
  for (int64_t k = 0; k < kTelemetryColumns; ++k) {
    row[k] = values[k];
  }
}

}  // namespace fusedamp::math
