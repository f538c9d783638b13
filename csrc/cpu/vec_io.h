#pragma once
// Loads and stores between FP32/FP16/BF16 memory and pairs of Vectorized<float> registers,
// with an element count for the tail so that no loop needs a separate scalar epilogue.
// Included only by the per-instruction-set kernel files.
#include <fusedamp/math/quantized_moments_math.h>
#include <fusedamp/math/stochastic_rounding_math.h>

#include "../ops/static_switch.h"
#include "cpu_kernels.h"
#include "lane_ops_vec.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace fusedamp::cpu::CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;
// Elements handled per iteration: two float vectors, i.e. one FP16/BF16 vector.
constexpr int64_t kPair = 2 * Vec::size();

// The memory of one pair of T elements kPrefetchAhead elements past p asked for, ahead of its
// load. A step reads and writes five to seven streams at once (gradient, weights, master,
// moments); with the hardware's prefetchers alone the 8M-parameter AdamW step waited on the
// L3 for about a tenth of its time (benchmarks/results/default_step_cpu.md). The address is
// formed as an integer: it may lie past the end of the tensor (a prefetch never faults).
constexpr int64_t kPrefetchAhead = 512;  // elements

template <typename T>
C10_ALWAYS_INLINE void prefetch_pair_ahead(const T* p) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(p) + kPrefetchAhead * sizeof(T);
  for (uintptr_t b = 0; b < kPair * sizeof(T); b += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(at + b));
  }
}

template <typename T>
struct PairIO {
  static_assert(at::vec::Vectorized<T>::size() == kPair, "reduced-float vector = 2 float vectors");
  static inline void load(const T* p, int64_t n, Vec& a, Vec& b) {
    auto r = at::vec::Vectorized<T>::loadu(p, std::min<int64_t>(n, kPair));
    std::tie(a, b) = at::vec::convert_to_float<T>(r);
  }
  static inline void store(T* p, int64_t n, const Vec& a, const Vec& b) {
    at::vec::convert_from_float<T>(a, b).store(p, std::min<int64_t>(n, kPair));
  }
  // a, b as store() would leave them in memory, read back: rounded to T.
  static inline void round_trip(Vec& a, Vec& b) {
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b));
  }
  // store(), then a, b become what was stored (one conversion for both).
  static inline void store_read_back(T* p, int64_t n, Vec& a, Vec& b) {
    const auto rounded = at::vec::convert_from_float<T>(a, b);
    rounded.store(p, std::min<int64_t>(n, kPair));
    std::tie(a, b) = at::vec::convert_to_float<T>(rounded);
  }
};

template <>
struct PairIO<float> {
  static inline void load(const float* p, int64_t n, Vec& a, Vec& b) {
    constexpr int64_t k = Vec::size();
    if (n >= kPair) {
      a = Vec::loadu(p);
      b = Vec::loadu(p + k);
    } else {
      a = Vec::loadu(p, std::min(n, k));
      b = n > k ? Vec::loadu(p + k, n - k) : Vec(0.f);
    }
  }
  static inline void store(float* p, int64_t n, const Vec& a, const Vec& b) {
    constexpr int64_t k = Vec::size();
    if (n >= kPair) {
      a.store(p);
      b.store(p + k);
    } else {
      a.store(p, std::min(n, k));
      if (n > k) {
        b.store(p + k, n - k);
      }
    }
  }
  static inline void round_trip(Vec&, Vec&) {}
};

// f(l) for the lanes l < min(n, kPair) of one iteration; a full pair has a constant trip count
// (the compiler unrolls and vectorises it), the tail the rest.
template <typename F>
inline void for_each_lane(int64_t n, const F& f) {
  if (n >= kPair) {
    for (int64_t l = 0; l < kPair; ++l) {
      f(l);
    }
  } else {
    for (int64_t l = 0; l < n; ++l) {
      f(l);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// FP32 bit patterns, one per float lane (math::PatternOps).
using PatternLanes = at::vec::Vectorized<int32_t>;
static_assert(PatternLanes::size() == Vec::size(), "one pattern lane per float lane");

inline PatternLanes as_patterns(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_castps_si512(x);
#else
  return _mm256_castps_si256(x);
#endif
}
inline Vec as_floats(const PatternLanes& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_castsi512_ps(x);
#else
  return _mm256_castsi256_ps(x);
#endif
}

// Vec::size() 8- or 16-bit integers at p as int32 lanes, sign- or zero-extended as R is
// signed or not.
template <typename R>
inline PatternLanes widened(const R* p) {
  static_assert(sizeof(R) == 1 || std::is_signed_v<R>, "unsigned: 8-bit codes only");
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (sizeof(R) == 2) {
    return _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return std::is_signed_v<R> ? _mm512_cvtepi8_epi32(x) : _mm512_cvtepu8_epi32(x);
  }
#else
  if constexpr (sizeof(R) == 2) {
    return _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return std::is_signed_v<R> ? _mm256_cvtepi8_epi32(x) : _mm256_cvtepu8_epi32(x);
  }
#endif
}

// The first min(n, kPair) integers at p, widened, as two vectors (the lanes beyond n hold 0).
template <typename R>
inline void load_extended(const R* p, int64_t n, PatternLanes& a, PatternLanes& b) {
  if (n >= kPair) {
    a = widened(p);
    b = widened(p + Vec::size());
    return;
  }
  alignas(64) int32_t lanes[kPair] = {};
  for (int64_t l = 0; l < n; ++l) {
    lanes[l] = p[l];
  }
  a = PatternLanes::loadu(lanes);
  b = PatternLanes::loadu(lanes + Vec::size());
}

// The lower 8 or 16 bits of the first min(n, kPair) lanes of (a, b), stored at p.
template <typename R>
inline void store_narrowed(R* p, int64_t n, const PatternLanes& a, const PatternLanes& b) {
  constexpr int64_t k = Vec::size();
#if defined(CPU_CAPABILITY_AVX512)
  if (n >= kPair) {  // truncating narrowing stores (vpmovdb / vpmovdw)
    if constexpr (sizeof(R) == 1) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p + k), _mm512_cvtepi32_epi8(b));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(a));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + k), _mm512_cvtepi32_epi16(b));
    }
    return;
  }
#else
  if (n >= kPair) {  // the lower bits masked, then packed without saturation (AVX2 has no
                     // truncating pack); packs interleave 128-bit halves, the permute undoes it
    constexpr int kBits = 8 * sizeof(R);
    const __m256i low = _mm256_set1_epi32((1 << kBits) - 1);
    const __m256i words = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(a, low), _mm256_and_si256(b, low)), 0xD8);
    if constexpr (sizeof(R) == 1) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                       _mm_packus_epi16(_mm256_castsi256_si128(words),
                                        _mm256_extracti128_si256(words, 1)));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), words);
    }
    return;
  }
#endif
  alignas(64) int32_t lanes[kPair];
  a.store(lanes);
  b.store(lanes + k);
  for_each_lane(n, [&](int64_t l) {
    p[l] = static_cast<R>(static_cast<std::make_unsigned_t<R>>(static_cast<uint32_t>(lanes[l])));
  });
}
#endif

// 8-bit codes (int8 or uint8: a quantized state) and float lanes holding their values: the
// first min(n, kPair) of them (loaded lanes beyond n are 0). The vector instruction sets widen
// and narrow them in registers; DEFAULT goes through an array.
template <typename R>
inline void load_codes(const R* p, int64_t n, Vec& a, Vec& b) {
  static_assert(sizeof(R) == 1, "8-bit codes");
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  PatternLanes ia, ib;
  load_extended(p, n, ia, ib);
#if defined(CPU_CAPABILITY_AVX512)
  a = _mm512_cvtepi32_ps(ia);
  b = _mm512_cvtepi32_ps(ib);
#else
  a = _mm256_cvtepi32_ps(ia);
  b = _mm256_cvtepi32_ps(ib);
#endif
#else
  alignas(64) float lanes[kPair] = {};
  for (int64_t l = 0; l < std::min(n, kPair); ++l) {
    lanes[l] = static_cast<float>(p[l]);
  }
  a = Vec::loadu(lanes);
  b = Vec::loadu(lanes + Vec::size());
#endif
}

// The codes of unrounded codes a, b (math::nearest_code: in R's range, or NaN or +-inf). The
// vector instruction sets convert to the nearest integer (ties to even, whatever MXCSR says)
// and narrow in registers: a NaN or an infinity converts to 0x80000000, whose low 8 bits, all
// the narrowing keeps, are code 0, as nearest_code has it. DEFAULT rounds as floats and goes
// through an array.
template <typename R>
inline void store_nearest_codes(R* p, int64_t n, const Vec& a, const Vec& b) {
  static_assert(sizeof(R) == 1, "8-bit codes");
#if defined(CPU_CAPABILITY_AVX512)
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  store_narrowed(p, n, PatternLanes(_mm512_cvt_roundps_epi32(a, kNearest)),
                 PatternLanes(_mm512_cvt_roundps_epi32(b, kNearest)));
#elif defined(CPU_CAPABILITY_AVX2)
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  store_narrowed(p, n, PatternLanes(_mm256_cvttps_epi32(_mm256_round_ps(a, kNearest))),
                 PatternLanes(_mm256_cvttps_epi32(_mm256_round_ps(b, kNearest))));
#else
  alignas(64) float lanes[kPair];
  math::nearest_code(a).store(lanes);
  math::nearest_code(b).store(lanes + Vec::size());
  for_each_lane(n, [&](int64_t l) { p[l] = static_cast<R>(lanes[l]); });
#endif
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// out[j] = the largest lane of in[j], for 16 vectors of magnitudes' bit patterns (lanes >= 0 as
// int32, NaN patterns above +inf's: LaneOps::max_magnitude's order), each a block's running
// top. One reduction tree over all 16 takes 15 vector maxima and 30 shuffles (AVX-512) where
// 16 separate reductions take 64 maxima and 64 shuffles, and its result is stored as one vector.
// Each level halves the vectors by taking the maxima of two sources' halves side by side; the
// inputs go in permuted so that the last level's lanes are in source order.
inline void largest_lanes_of_16(const PatternLanes* in, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  // Last level's lane 4q + k holds source q + 4k of its inputs.
  __m512i x[16], y[8], z[4], w[2];
  for (int s = 0; s < 16; ++s) {
    x[s] = in[4 * (s % 4) + s / 4];
  }
  for (int i = 0; i < 8; ++i) {  // 128-bit quarters 0-1 vs 2-3: [source 2i, source 2i+1]
    y[i] = _mm512_max_epi32(_mm512_shuffle_i32x4(x[2 * i], x[2 * i + 1], 0x44),
                            _mm512_shuffle_i32x4(x[2 * i], x[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // quarters 0, 2 vs 1, 3: quarter q holds source 4i + q
    z[i] = _mm512_max_epi32(_mm512_shuffle_i32x4(y[2 * i], y[2 * i + 1], 0x88),
                            _mm512_shuffle_i32x4(y[2 * i], y[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // in each quarter q: sources 8i + q, 8i + 4 + q, two lanes
    w[i] = _mm512_max_epi32(_mm512_unpacklo_epi64(z[2 * i], z[2 * i + 1]),
                            _mm512_unpackhi_epi64(z[2 * i], z[2 * i + 1]));
  }
  const __m512 lo = _mm512_castsi512_ps(w[0]), hi = _mm512_castsi512_ps(w[1]);
  _mm512_storeu_si512(static_cast<void*>(out),
                      _mm512_max_epi32(_mm512_castps_si512(_mm512_shuffle_ps(lo, hi, 0x88)),
                                       _mm512_castps_si512(_mm512_shuffle_ps(lo, hi, 0xDD))));
#else
  // Two trees of 8 eight-lane vectors; a last level's lane 4h + k holds source h + 2k of its 8.
  for (int g = 0; g < 2; ++g) {
    __m256i x[8], y[4], z[2];
    for (int s = 0; s < 8; ++s) {
      x[s] = in[8 * g + 4 * (s % 2) + s / 2];
    }
    for (int i = 0; i < 4; ++i) {  // 128-bit halves: [source 2i, source 2i+1]
      y[i] = _mm256_max_epi32(_mm256_permute2x128_si256(x[2 * i], x[2 * i + 1], 0x20),
                              _mm256_permute2x128_si256(x[2 * i], x[2 * i + 1], 0x31));
    }
    for (int i = 0; i < 2; ++i) {  // in each half h: sources 4i + h, 4i + 2 + h, two lanes
      z[i] = _mm256_max_epi32(_mm256_unpacklo_epi64(y[2 * i], y[2 * i + 1]),
                              _mm256_unpackhi_epi64(y[2 * i], y[2 * i + 1]));
    }
    const __m256 lo = _mm256_castsi256_ps(z[0]), hi = _mm256_castsi256_ps(z[1]);
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(out + 8 * g),
        _mm256_max_epi32(_mm256_castps_si256(_mm256_shuffle_ps(lo, hi, 0x88)),
                         _mm256_castps_si256(_mm256_shuffle_ps(lo, hi, 0xDD))));
  }
#endif
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// Eight uint64_t lanes, with the operators math::counter_mix takes (AVX-512DQ's 64-bit
// multiply; AVX2 has none, and draws lane by lane).
struct Lanes64 {
  __m512i v;
  Lanes64(__m512i x) : v(x) {}  // NOLINT(google-explicit-constructor): results of intrinsics
  explicit Lanes64(uint64_t c) : v(_mm512_set1_epi64(static_cast<long long>(c))) {}
  friend Lanes64 operator+(const Lanes64& x, const Lanes64& y) {
    return _mm512_add_epi64(x.v, y.v);
  }
  friend Lanes64 operator^(const Lanes64& x, const Lanes64& y) {
    return _mm512_xor_si512(x.v, y.v);
  }
  friend Lanes64 operator*(const Lanes64& x, const Lanes64& y) {
    return _mm512_mullo_epi64(x.v, y.v);
  }
  Lanes64 operator>>(int k) const { return _mm512_srli_epi64(v, k); }
};

// math::counter_random_bits(seed, step, first + l) for the kPair lanes l of one pair, as the
// two vectors of 32-bit lanes it splits into.
inline void counter_random_pair(uint64_t seed, uint32_t step, uint64_t first, PatternLanes& a,
                                PatternLanes& b) {
  constexpr uint64_t kWeyl = math::kWeylStep;
  const Lanes64 iota(_mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7));
  const Lanes64 eight(kWeyl * 8);
  Lanes64 z = Lanes64(math::counter_start(seed, step) + kWeyl * first) + iota * Lanes64(kWeyl);
  __m256i bits[4];
  for (auto& quarter : bits) {
    quarter = _mm512_cvtepi64_epi32((math::counter_mix(z) >> 32).v);
    z = z + eight;
  }
  a = _mm512_inserti64x4(_mm512_castsi256_si512(bits[0]), bits[1], 1);
  b = _mm512_inserti64x4(_mm512_castsi256_si512(bits[2]), bits[3], 1);
}
#endif

}  // namespace fusedamp::cpu::CPU_CAPABILITY
