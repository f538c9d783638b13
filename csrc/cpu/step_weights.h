#pragma once
// The weights a CPU step kernel reads and writes, as FP32 lanes, for each way a parameter's
// weights are stored (static_switch.h WeightStore). Included only by the per-instruction-set
// kernel files.
#include <fusedamp/math/kahan_math.h>
#include <fusedamp/math/master_math.h>
#include <fusedamp/math/split_math.h>
#include <fusedamp/math/stochastic_rounding_math.h>

#include "vec_io.h"

namespace fusedamp::cpu::CPU_CAPABILITY {

// The weights a step kernel updates, as FP32 lanes (the CPU twin of cuda/step_weights.cuh), for
// each way of storing them (static_switch.h WeightStore):
//   kOff            the params themselves are read and written;
//   kFp32           the FP32 master is read, both are written; kMasterAdoptingEdits reads the
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

  // The streams of the pair kPrefetchAhead elements past i (vec_io.h prefetch_pair_ahead).
  C10_ALWAYS_INLINE void prefetch_ahead(int64_t i) const {
    prefetch_pair_ahead(param + i);
    if constexpr (kStore == WeightStore::kFp32 || kStore == WeightStore::kMasterAdoptingEdits) {
      prefetch_pair_ahead(static_cast<const float*>(extra) + i);
    } else if constexpr (is_split_store(kStore)) {
      prefetch_pair_ahead(static_cast<const SplitRemainder<kStore>*>(extra) + i);
    } else if constexpr (kStore == WeightStore::kKahan) {
      prefetch_pair_ahead(static_cast<const TP*>(extra) + i);
    }
  }

  inline void load(int64_t i, int64_t n, Vec& a, Vec& b) const {
    if constexpr (kStore == WeightStore::kFp32 || kStore == WeightStore::kMasterAdoptingEdits) {
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
    } else {  // kOff, kStochastic
      PairIO<TP>::load(param + i, n, a, b);
    }
  }

  inline void store(int64_t i, int64_t n, const Vec& a, const Vec& b) const {
    if constexpr (kStore == WeightStore::kFp32 || kStore == WeightStore::kMasterAdoptingEdits) {
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
  if constexpr (kStore == WeightStore::kFp32 || kStore == WeightStore::kMasterAdoptingEdits) {
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
