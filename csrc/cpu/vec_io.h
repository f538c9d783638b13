#pragma once
// Loads and stores between FP32/FP16/BF16 memory and pairs of Vectorized<float> registers,
// with an element count for the tail so that no loop needs a separate scalar epilogue.
// Included only by the per-instruction-set kernel files.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <fusedamp/math/lane_ops.h>

#include <algorithm>

namespace fusedamp::math {
template <>
struct LaneOps<at::vec::Vectorized<float>> {
  static inline at::vec::Vectorized<float> sqrt(const at::vec::Vectorized<float>& x) {
    return x.sqrt();
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
};

}  // namespace fusedamp::cpu::CPU_CAPABILITY
