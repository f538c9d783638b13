#pragma once
// Loads and stores between FP32/FP16/BF16 memory and pairs of Vectorized<float> registers,
// with an element count for the tail so that no loop needs a separate scalar epilogue.
// Included only by the per-instruction-set kernel files.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <fusedamp/math/lane_ops.h>
#include <fusedamp/math/kahan_math.h>
#include <fusedamp/math/master_math.h>
#include <fusedamp/math/quantized_moments_math.h>
#include <fusedamp/math/split_math.h>
#include <fusedamp/math/stochastic_rounding_math.h>

#include "../ops/static_switch.h"
#include "cpu_kernels.h"

#include <algorithm>
#include <limits>
#include <type_traits>

namespace fusedamp::math {
template <>
struct LaneOps<at::vec::Vectorized<float>> {
  static inline at::vec::Vectorized<float> sqrt(const at::vec::Vectorized<float>& x) {
    return x.sqrt();
  }
  static inline at::vec::Vectorized<float> fma(const at::vec::Vectorized<float>& x,
                                               const at::vec::Vectorized<float>& y,
                                               const at::vec::Vectorized<float>& z) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    return at::vec::fmadd(x, y, z);
#else
    // DEFAULT's at::vec::fmadd is x * y + z, rounded twice: one rounding lane by lane instead.
    at::vec::Vectorized<float> r;
    for (int l = 0; l < at::vec::Vectorized<float>::size(); ++l) {
      r[l] = std::fma(x[l], y[l], z[l]);
    }
    return r;
#endif
  }
  static inline at::vec::Vectorized<float> max(const at::vec::Vectorized<float>& x,
                                               const at::vec::Vectorized<float>& y) {
    return at::vec::maximum(x, y);  // NaN-propagating, as torch.maximum
  }
  static inline at::vec::Vectorized<float> abs(const at::vec::Vectorized<float>& x) {
    return x.abs();
  }
  // The bits of |x| order as the values do, every NaN above +inf: one integer maximum of them
  // is the NaN-propagating maximum that maximum() spends a compare, a max and a blend on.
  static inline at::vec::Vectorized<float> max_magnitude(const at::vec::Vectorized<float>& x,
                                                         const at::vec::Vectorized<float>& y) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    return _mm512_castsi512_ps(
        _mm512_max_epi32(_mm512_and_si512(_mm512_castps_si512(x), magnitude),
                         _mm512_and_si512(_mm512_castps_si512(y), magnitude)));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
    return _mm256_castsi256_ps(
        _mm256_max_epi32(_mm256_and_si256(_mm256_castps_si256(x), magnitude),
                         _mm256_and_si256(_mm256_castps_si256(y), magnitude)));
#else
    return at::vec::maximum(x.abs(), y.abs());
#endif
  }
  // The telemetry's lanes (math/telemetry_math.h), once per element of every gradient pass
  // with telemetry: a float compare-and-blend chain through acc (compare, mask to vector, and,
  // vector to mask, blend: 5 dependent instructions per vector) made the pass compute-bound.
  // Magnitudes order as their bits do, so the largest finite one is an integer maximum of the
  // finite lanes: one instruction on the accumulator's chain.
  static inline at::vec::Vectorized<float> max_finite_magnitude(
      const at::vec::Vectorized<float>& acc, const at::vec::Vectorized<float>& magnitude) {
    constexpr float kInf = std::numeric_limits<float>::infinity();
#if defined(CPU_CAPABILITY_AVX512)
    const __mmask16 finite = _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(kInf), _CMP_LT_OQ);
    const __m512i a = _mm512_castps_si512(acc);
    return _mm512_castsi512_ps(
        _mm512_mask_max_epi32(a, finite, a, _mm512_castps_si512(magnitude)));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256 finite = _mm256_cmp_ps(magnitude, _mm256_set1_ps(kInf), _CMP_LT_OQ);
    return _mm256_castsi256_ps(_mm256_max_epi32(
        _mm256_castps_si256(acc), _mm256_castps_si256(_mm256_and_ps(finite, magnitude))));
#else
    const at::vec::Vectorized<float> inf(kInf);
    return at::vec::Vectorized<float>::blendv(acc, magnitude,
                                              (magnitude > acc) & (magnitude < inf));
#endif
  }
  // A masked add of 1 (AVX-512: the compare's mask register is the add's mask).
  static inline at::vec::Vectorized<float> count_if_less(const at::vec::Vectorized<float>& count,
                                                        const at::vec::Vectorized<float>& x,
                                                        const at::vec::Vectorized<float>& y) {
#if defined(CPU_CAPABILITY_AVX512)
    return _mm512_mask_add_ps(count, _mm512_cmp_ps_mask(x, y, _CMP_LT_OQ), count,
                              _mm512_set1_ps(1.f));
#else
    return count + x.lt(y);
#endif
  }
  static inline at::vec::Vectorized<float> count_if_equal(const at::vec::Vectorized<float>& count,
                                                         const at::vec::Vectorized<float>& x,
                                                         const at::vec::Vectorized<float>& y) {
#if defined(CPU_CAPABILITY_AVX512)
    return _mm512_mask_add_ps(count, _mm512_cmp_ps_mask(x, y, _CMP_EQ_OQ), count,
                              _mm512_set1_ps(1.f));
#else
    return count + x.eq(y);
#endif
  }
  static inline at::vec::Vectorized<float> where_equal(const at::vec::Vectorized<float>& x,
                                                      const at::vec::Vectorized<float>& y,
                                                      const at::vec::Vectorized<float>& if_equal,
                                                      const at::vec::Vectorized<float>& otherwise) {
    return at::vec::Vectorized<float>::blendv(otherwise, if_equal, x == y);
  }
  static inline at::vec::Vectorized<float> rint(const at::vec::Vectorized<float>& x) {
    return x.round();  // to nearest, ties to even
  }
  // Bitwise: Vectorized::copysign is a call into Sleef, once per vector.
  static inline at::vec::Vectorized<float> copysign(const at::vec::Vectorized<float>& x,
                                                    const at::vec::Vectorized<float>& s) {
    const at::vec::Vectorized<float> sign(-0.f);
    return x.abs() | (s & sign);
  }
};

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// Pattern lanes as int32 vectors (the split weight stores). AVX-512 keeps the comparisons in
// mask registers; AVX2 in all-ones lanes.
template <>
struct PatternOps<at::vec::Vectorized<int32_t>> {
  using P = at::vec::Vectorized<int32_t>;
#if defined(CPU_CAPABILITY_AVX512)
  using Mask = __mmask16;
  static inline Mask greater(const P& x, const P& y) { return _mm512_cmpgt_epi32_mask(x, y); }
  static inline Mask equal(const P& x, const P& y) { return _mm512_cmpeq_epi32_mask(x, y); }
  static inline Mask both(Mask a, Mask b) { return a & b; }
  static inline Mask either(Mask a, Mask b) { return a | b; }
  static inline P select(Mask m, const P& if_true, const P& if_false) {
    return _mm512_mask_blend_epi32(m, if_false, if_true);
  }
  template <int k>
  static inline P shift_right(const P& x) {
    return _mm512_srli_epi32(x, k);
  }
  template <int k>
  static inline P shift_left(const P& x) {
    return _mm512_slli_epi32(x, k);
  }
#else
  using Mask = __m256i;
  static inline Mask greater(const P& x, const P& y) { return _mm256_cmpgt_epi32(x, y); }
  static inline Mask equal(const P& x, const P& y) { return _mm256_cmpeq_epi32(x, y); }
  static inline Mask both(Mask a, Mask b) { return _mm256_and_si256(a, b); }
  static inline Mask either(Mask a, Mask b) { return _mm256_or_si256(a, b); }
  static inline P select(Mask m, const P& if_true, const P& if_false) {
    return _mm256_blendv_epi8(if_false, if_true, m);
  }
  template <int k>
  static inline P shift_right(const P& x) {
    return _mm256_srli_epi32(x, k);
  }
  template <int k>
  static inline P shift_left(const P& x) {
    return _mm256_slli_epi32(x, k);
  }
#endif
  static inline P splat(uint32_t c) { return P(static_cast<int32_t>(c)); }
};
#endif
}  // namespace fusedamp::math

namespace fusedamp::cpu::CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;
// Elements handled per iteration: two float vectors, i.e. one FP16/BF16 vector.
constexpr int64_t kPair = 2 * Vec::size();

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

// The codes of unrounded codes a, b (math::nearest_code: in R's range, or NaN). The vector
// instruction sets convert to the nearest integer (ties to even, whatever MXCSR says) and
// narrow in registers: a NaN converts to 0x80000000, whose low 8 bits, all the narrowing keeps,
// are code 0, as nearest_code has it. DEFAULT rounds as floats and goes through an array.
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

// The weights a step kernel updates, as FP32 lanes (the CPU twin of cuda/step_weights.cuh), for
// each way of storing them (static_switch.h WeightStore):
//   kParams         the params themselves are read and written;
//   kMaster         the FP32 master is read, both are written; kMasterAdoptingEdits reads the
//                   param too: where it is not the master's rounding, math::weight_to_update
//                   starts from the param;
//   kSplit          BF16 param + int16 remainder = the master (math/split_math.h);
//   kSplit8         BF16 param + int8 remainder = a 24-bit master (math/split_math.h);
//   kKahan          param + compensation of the param's dtype (math/kahan_math.h);
//   kStochastic     the params, stored with stochastic rounding (math/stochastic_rounding_math.h)
//                   from the counter (seed, step, first_index + element).
template <typename TP, WeightStore kStore>
struct StepWeights {
  static_assert(weight_store_fits<TP>(kStore), "no such weight store for this param dtype");
  TP* param;
  void* extra;  // master (float), remainder (int16/int8) or compensation (TP); nullptr otherwise
  uint64_t seed = 0;
  uint32_t step = 0;
  int64_t first_index = 0;

  inline void load(int64_t i, int64_t n, Vec& a, Vec& b) const {
    if constexpr (kStore == WeightStore::kMaster || kStore == WeightStore::kMasterAdoptingEdits) {
      PairIO<float>::load(static_cast<float*>(extra) + i, n, a, b);
      if constexpr (kStore == WeightStore::kMasterAdoptingEdits) {
        Vec pa, pb, ra = a, rb = b;
        PairIO<TP>::load(param + i, n, pa, pb);
        PairIO<TP>::round_trip(ra, rb);
        a = math::weight_to_update(a, pa, ra);
        b = math::weight_to_update(b, pb, rb);
      }
    } else if constexpr (is_split_store(kStore)) {
      using R = SplitRemainder<kStore>;
      const auto* remainder = static_cast<const R*>(extra) + i;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
      // The widened weights are their patterns in the upper half, as the formula takes them.
      PairIO<TP>::load(param + i, n, a, b);
      PatternLanes ra, rb;
      load_extended(remainder, n, ra, rb);
      constexpr int kShift = math::kRemainderShift<R>;
      a = as_floats(math::combine_patterns<kShift>(as_patterns(a), ra));
      b = as_floats(math::combine_patterns<kShift>(as_patterns(b), rb));
#else
      alignas(64) float lanes[kPair] = {};
      const uint16_t* weight_bits = reinterpret_cast<const uint16_t*>(param + i);
      for_each_lane(n, [&](int64_t l) {
        lanes[l] = math::combine_split(weight_bits[l], remainder[l]);
      });
      a = Vec::loadu(lanes);
      b = Vec::loadu(lanes + Vec::size());
#endif
    } else if constexpr (kStore == WeightStore::kKahan) {
      Vec ca, cb;
      PairIO<TP>::load(param + i, n, a, b);
      PairIO<TP>::load(static_cast<const TP*>(extra) + i, n, ca, cb);
      Vec sa = a + ca, sb = b + cb;
      Vec ra = sa, rb = sb;
      PairIO<TP>::round_trip(ra, rb);
      a = math::kahan_weight(a, sa, ra);
      b = math::kahan_weight(b, sb, rb);
    } else {  // kParams, kStochastic
      PairIO<TP>::load(param + i, n, a, b);
    }
  }

  inline void store(int64_t i, int64_t n, const Vec& a, const Vec& b) const {
    if constexpr (kStore == WeightStore::kMaster || kStore == WeightStore::kMasterAdoptingEdits) {
      PairIO<float>::store(static_cast<float*>(extra) + i, n, a, b);
      PairIO<TP>::store(param + i, n, a, b);
    } else if constexpr (is_split_store(kStore)) {
      using R = SplitRemainder<kStore>;
      uint16_t* weight_bits = reinterpret_cast<uint16_t*>(param + i);
      auto* remainder = static_cast<R*>(extra) + i;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
      PatternLanes wa, ra, wb, rb;
      math::split_patterns_for(R{}, as_patterns(a), wa, ra);
      math::split_patterns_for(R{}, as_patterns(b), wb, rb);
      store_narrowed(weight_bits, n, wa, wb);
      store_narrowed(remainder, n, ra, rb);
#else
      alignas(64) float lanes[kPair];
      a.store(lanes);
      b.store(lanes + Vec::size());
      for_each_lane(n, [&](int64_t l) { math::split_into(lanes[l], weight_bits[l], remainder[l]); });
#endif
    } else if constexpr (kStore == WeightStore::kKahan) {
      Vec ra = a, rb = b;
      PairIO<TP>::store_read_back(param + i, n, ra, rb);
      PairIO<TP>::store(static_cast<TP*>(extra) + i, n, math::kahan_compensation(a, ra),
                        math::kahan_compensation(b, rb));
    } else if constexpr (kStore == WeightStore::kStochastic) {
      uint16_t* weight_bits = reinterpret_cast<uint16_t*>(param + i);
      const uint64_t first = static_cast<uint64_t>(first_index + i);
#if defined(CPU_CAPABILITY_AVX512)
      PatternLanes ra, rb;
      counter_random_pair(seed, step, first, ra, rb);
      store_narrowed(weight_bits, n, math::stochastic_round_patterns(as_patterns(a), ra),
                     math::stochastic_round_patterns(as_patterns(b), rb));
#else
      alignas(64) float lanes[kPair];
      a.store(lanes);
      b.store(lanes + Vec::size());
      for_each_lane(n, [&](int64_t l) {
        weight_bits[l] = math::stochastic_round_bf16(
            lanes[l], math::counter_random_bits(seed, step, first + static_cast<uint64_t>(l)));
      });
#endif
    } else {
      PairIO<TP>::store(param + i, n, a, b);
    }
  }
};

// Position i's weights from element `begin` on, as a step over `step`'s rows reads them.
template <typename TP, WeightStore kStore>
inline StepWeights<TP, kStore> step_weights(const CpuStep& step, int64_t i, int64_t begin) {
  const StepRow& row = step.rows[i];
  StepWeights<TP, kStore> w{static_cast<TP*>(row.param) + begin, nullptr};
  if constexpr (kStore == WeightStore::kMaster || kStore == WeightStore::kMasterAdoptingEdits) {
    w.extra = static_cast<float*>(row.master) + begin;
  } else if constexpr (is_split_store(kStore)) {
    w.extra = static_cast<SplitRemainder<kStore>*>(row.master) + begin;
  } else if constexpr (kStore == WeightStore::kKahan) {
    w.extra = static_cast<TP*>(row.master) + begin;
  } else if constexpr (kStore == WeightStore::kStochastic) {
    w.seed = static_cast<uint64_t>(step.rounding_seeds[i]);
    w.step = static_cast<uint32_t>(step.steps_before[i]);
    w.first_index = begin;
  }
  return w;
}

}  // namespace fusedamp::cpu::CPU_CAPABILITY
