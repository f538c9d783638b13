#pragma once
// Loads and stores between FP32/FP16/BF16 memory and pairs of Vectorized<float> registers,
// with an element count for the tail so that no loop needs a separate scalar epilogue.
// Included only by the per-instruction-set kernel files.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <fusedamp/math/lane_ops.h>
#include <fusedamp/math/master_math.h>

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

// The weights a step kernel updates, as FP32 lanes (the CPU twin of cuda/step_weights.cuh).
// With master weights the master is read (and, with kAdoptEdits, the param too: where the param
// is not the master's rounding, math::weight_to_update starts from the param) and both are
// written; without, the params themselves are read and written.
template <typename TP, bool kMaster, bool kAdoptEdits>
struct StepWeights {
  static_assert(kMaster || !kAdoptEdits, "edits are adopted into master weights only");
  TP* param;
  float* master;  // nullptr without master weights

  inline void load(int64_t i, int64_t n, Vec& a, Vec& b) const {
    if constexpr (kMaster) {
      PairIO<float>::load(master + i, n, a, b);
      if constexpr (kAdoptEdits) {
        Vec pa, pb, ra = a, rb = b;
        PairIO<TP>::load(param + i, n, pa, pb);
        PairIO<TP>::round_trip(ra, rb);
        a = math::weight_to_update(a, pa, ra);
        b = math::weight_to_update(b, pb, rb);
      }
    } else {
      PairIO<TP>::load(param + i, n, a, b);
    }
  }
  inline void store(int64_t i, int64_t n, const Vec& a, const Vec& b) const {
    if constexpr (kMaster) {
      PairIO<float>::store(master + i, n, a, b);
    }
    PairIO<TP>::store(param + i, n, a, b);
  }
};

}  // namespace fusedamp::cpu::CPU_CAPABILITY
