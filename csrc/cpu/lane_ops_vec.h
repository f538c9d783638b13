#pragma once
// math::LaneOps and math::PatternOps for ATen's CPU vectors: the element math of
// csrc/include/fusedamp/math/ runs on Vectorized<float> lanes with these, one instruction set at
// a time. Included only by the per-instruction-set kernel files (through vec_io.h).
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <fusedamp/math/lane_ops.h>

#include <cmath>
#include <limits>

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
