#pragma once
// Loads and stores between FP32/FP16/BF16 memory and pairs of Vectorized<float> registers,
// with an element count for the tail so that no loop needs a separate scalar epilogue.
// Included only by the per-instruction-set kernel files.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <fusedamp/math/lane_ops.h>
#include <fusedamp/math/kahan_math.h>
#include <fusedamp/math/master_math.h>
#include <fusedamp/math/split_math.h>
#include <fusedamp/math/stochastic_rounding_math.h>

#include "../ops/static_switch.h"
#include "cpu_kernels.h"

#include <algorithm>
#include <limits>

namespace fusedamp::math {
template <>
struct LaneOps<at::vec::Vectorized<float>> {
  static inline at::vec::Vectorized<float> sqrt(const at::vec::Vectorized<float>& x) {
    return x.sqrt();
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
  static inline at::vec::Vectorized<float> max_finite(const at::vec::Vectorized<float>& acc,
                                                     const at::vec::Vectorized<float>& candidate) {
    const at::vec::Vectorized<float> inf(std::numeric_limits<float>::infinity());
    // (candidate > acc) and (candidate < inf): false for inf and NaN lanes.
    return at::vec::Vectorized<float>::blendv(acc, candidate,
                                              (candidate > acc) & (candidate < inf));
  }
  static inline at::vec::Vectorized<float> one_if_less(const at::vec::Vectorized<float>& x,
                                                      const at::vec::Vectorized<float>& y) {
    return x.lt(y);
  }
  static inline at::vec::Vectorized<float> one_if_equal(const at::vec::Vectorized<float>& x,
                                                       const at::vec::Vectorized<float>& y) {
    return x.eq(y);
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
  static inline at::vec::Vectorized<float> code_in(const at::vec::Vectorized<float>& x,
                                                   const at::vec::Vectorized<float>& top) {
    // (x > 0) is false for NaN lanes: they become 0, so the minimum need not propagate NaN
    // (clamp_max: one instruction, where minimum() adds a compare and a blend).
    return at::vec::clamp_max(x, top) & (x > at::vec::Vectorized<float>(0.f));
  }
};
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
      alignas(64) float lanes[kPair] = {};
      const uint16_t* weight_bits = reinterpret_cast<const uint16_t*>(param + i);
      const auto* remainder = static_cast<const SplitRemainder<kStore>*>(extra) + i;
      for_each_lane(n, [&](int64_t l) {
        lanes[l] = math::combine_split(weight_bits[l], remainder[l]);
      });
      a = Vec::loadu(lanes);
      b = Vec::loadu(lanes + Vec::size());
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
      alignas(64) float lanes[kPair];
      a.store(lanes);
      b.store(lanes + Vec::size());
      uint16_t* weight_bits = reinterpret_cast<uint16_t*>(param + i);
      auto* remainder = static_cast<SplitRemainder<kStore>*>(extra) + i;
      for_each_lane(n, [&](int64_t l) { math::split_into(lanes[l], weight_bits[l], remainder[l]); });
    } else if constexpr (kStore == WeightStore::kKahan) {
      Vec ra = a, rb = b;
      PairIO<TP>::store_read_back(param + i, n, ra, rb);
      PairIO<TP>::store(static_cast<TP*>(extra) + i, n, math::kahan_compensation(a, ra),
                        math::kahan_compensation(b, rb));
    } else if constexpr (kStore == WeightStore::kStochastic) {
      alignas(64) float lanes[kPair];
      a.store(lanes);
      b.store(lanes + Vec::size());
      uint16_t* weight_bits = reinterpret_cast<uint16_t*>(param + i);
      const uint64_t first = static_cast<uint64_t>(first_index + i);
      for_each_lane(n, [&](int64_t l) {
        weight_bits[l] = math::stochastic_round_bf16(
            lanes[l], math::counter_random_bits(seed, step, first + static_cast<uint64_t>(l)));
      });
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
