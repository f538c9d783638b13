#pragma once
// The statistics pass's lanes for 16-bit gradients (FP16, BF16): the overflow check and the
// telemetry read from the elements' bit patterns, 16-bit lane by 16-bit lane
// (math::HalfPatterns), beside the FP32 values the sum of squares needs. Per element they cost
// a mask, a maximum and two counting compares on lanes twice as many as the FP32 ones — the
// float forms (math::accumulate_telemetry, math::accumulate_nonfinite) spend about twice the
// instructions on half the lanes, which made the telemetry a third of the pass.
// Included only by the per-instruction-set kernel files.
#include <ATen/cpu/vec/vec.h>
#include <fusedamp/math/telemetry_math.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec_io.h"

namespace fusedamp::cpu::CPU_CAPABILITY {

// One lane per element of a pair (kPair elements, one 16-bit vector): the largest magnitude
// pattern seen (inf and NaN included: it is the overflow check too) and, with kCount, how many
// patterns were below the smallest normal's and how many were zero, and with kFiniteTop the
// largest finite one (for a pass that overwrites the elements, so that an overflowing chunk's
// finite maximum cannot be read again afterwards; largest_finite_value otherwise). A lane takes
// one element per pair of a chunk (at most kChunk / kPair <= 1024), so 16-bit counts cannot
// wrap.
template <typename T, bool kCount, bool kFiniteTop>
struct HalfPatternLanes {
  using P = math::HalfPatterns<T>;
  using V = at::vec::Vectorized<int16_t>;
  static_assert(V::size() == kPair, "one 16-bit vector = one pair");

  V top = V(0);
  V n_small = V(0);
  V n_zero = V(0);
  V finite_top = V(0);

  // The kPair elements at p.
  C10_ALWAYS_INLINE void add(const T* p) {
#if defined(CPU_CAPABILITY_AVX512)
    add_patterns(_mm512_loadu_si512(p));
#else
    add_patterns(V::loadu(p));
#endif
  }

  // The first min(n, kPair) elements at p: a whole pair, or the pair a range ends with.
  C10_ALWAYS_INLINE void add(const T* p, int64_t n) {
    if (n >= kPair) {
      add(p);
    } else {
      add_partial(p, n);
    }
  }

  // The first n < kPair elements at p; the lanes from n on count as zeros (the caller takes
  // them off the counts). On AVX-512 a masked load: a copy through a zeroed buffer is read back
  // by one wide load before its narrow stores retire, a stalled load per call, and there every
  // row of 16 FP16 values is a partial pair.
  void add_partial(const T* p, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
    add_patterns(_mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint64_t{1} << n) - 1), p));
#else
    alignas(64) T lanes[kPair];
    std::memset(lanes, 0, sizeof(lanes));
    std::memcpy(lanes, p, static_cast<size_t>(n) * sizeof(T));
    add(lanes);
#endif
  }

  // One pair's bit patterns.
  C10_ALWAYS_INLINE void add_patterns(const V& bits) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512i m = _mm512_and_si512(bits, _mm512_set1_epi16(0x7FFF));
    top = _mm512_max_epi16(top, m);
    if constexpr (kCount) {
      const __m512i one = _mm512_set1_epi16(1);
      n_small = _mm512_mask_add_epi16(
          n_small, _mm512_cmplt_epi16_mask(m, _mm512_set1_epi16(P::kSmallestNormal)), n_small, one);
      n_zero = _mm512_mask_add_epi16(n_zero, _mm512_testn_epi16_mask(m, m), n_zero, one);
    }
    if constexpr (kFiniteTop) {
      finite_top = _mm512_mask_max_epi16(
          finite_top, _mm512_cmplt_epi16_mask(m, _mm512_set1_epi16(P::kInf)), finite_top, m);
    }
#else
    // A comparison's true lanes hold -1: subtracting it counts.
    const V m = bits & V(0x7FFF);
    top = at::vec::maximum(top, m);
    if constexpr (kCount) {
      n_small = n_small - (m < V(static_cast<int16_t>(P::kSmallestNormal)));
      n_zero = n_zero - (m == V(0));
    }
    if constexpr (kFiniteTop) {
      finite_top = at::vec::maximum(finite_top, m & (m < V(static_cast<int16_t>(P::kInf))));
    }
#endif
  }

  bool nonfinite() const { return largest(top) >= P::kInf; }

  static uint16_t largest(const V& v) {
    alignas(64) int16_t lanes[kPair];
    v.store(lanes);
    return static_cast<uint16_t>(*std::max_element(lanes, lanes + kPair));
  }

  static int64_t sum(const V& v) {
    alignas(64) int16_t lanes[kPair];
    v.store(lanes);
    int64_t s = 0;
    for (int16_t x : lanes) {
      s += x;
    }
    return s;
  }
};

// The largest finite magnitude among n 16-bit elements, as a value: read once more, element by
// element, only for a chunk that held an inf or NaN (an overflowing step's).
template <typename T>
float largest_finite_value(const T* p, int64_t n) {
  using P = math::HalfPatterns<T>;
  uint16_t top = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint16_t bits;
    std::memcpy(&bits, p + i, sizeof(bits));
    const uint16_t m = bits & 0x7FFF;
    if (m < P::kInf) {
      top = std::max(top, m);
    }
  }
  return P::value(top);
}

}  // namespace fusedamp::cpu::CPU_CAPABILITY
