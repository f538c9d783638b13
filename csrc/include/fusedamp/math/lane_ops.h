#pragma once
// The element formulas in this folder are templates over a "lane" type V: plain `float` on the
// GPU and in scalar tails, `at::vec::Vectorized<float>` in the CPU kernels. Arithmetic
// operators are shared by both; the few functions that are spelled differently (sqrt, fma, a
// per-lane choice) go through LaneOps, which the CPU kernels specialise for Vectorized<float>.
//
// libfusedamp is compiled with floating-point contraction off (CMakeLists.txt), so `a * b + c`
// rounds twice in every build; a formula that means one rounding says so with LaneOps::fma.
// An element's bits then depend neither on the instruction set nor on CPU against CUDA.
#include <c10/macros/Macros.h>
#include <cmath>
#include <cstdint>

namespace fusedamp::math {

template <typename V>
struct LaneOps {
  // std::sqrt and std::fabs of a float are also CUDA device functions (sqrtf, fabsf).
  static C10_HOST_DEVICE inline V sqrt(V x) { return std::sqrt(x); }
  // x * y + z rounded once (an FMA instruction where the target has one; std::fma is correct,
  // if slower, where it does not).
  static C10_HOST_DEVICE inline V fma(V x, V y, V z) {
#if defined(__CUDA_ARCH__)
    return ::fmaf(x, y, z);
#else
    return std::fma(x, y, z);
#endif
  }
  // Per lane: the larger, NaN if either is NaN (torch.maximum's rule).
  static C10_HOST_DEVICE inline V max(V x, V y) {
    return (x != x || y != y) ? x + y : (x > y ? x : y);
  }
  static C10_HOST_DEVICE inline V abs(V x) { return std::fabs(x); }
  // Per lane: the larger of |x| and |y|, NaN if either is NaN (a block scale's running top).
  static C10_HOST_DEVICE inline V max_magnitude(V x, V y) { return max(abs(x), abs(y)); }
  // Per lane: magnitude where it is finite and larger than acc, otherwise acc. Both are
  // magnitudes (never negative) and acc is finite: the CPU compares their bits as integers.
  static C10_HOST_DEVICE inline V max_finite_magnitude(V acc, V magnitude) {
    return (magnitude > acc && magnitude - magnitude == V(0.f)) ? magnitude : acc;
  }
  // Per lane: count + 1 where the relation holds, else count (NaN compares false). A count
  // stays exact below 2^24.
  static C10_HOST_DEVICE inline V count_if_less(V count, V x, V y) {
    return x < y ? count + V(1.f) : count;
  }
  static C10_HOST_DEVICE inline V count_if_equal(V count, V x, V y) {
    return x == y ? count + V(1.f) : count;
  }
  // Per lane: if_equal where x == y, otherwise `otherwise` (NaN equals nothing).
  static C10_HOST_DEVICE inline V where_equal(V x, V y, V if_equal, V otherwise) {
    return x == y ? if_equal : otherwise;
  }
  // Per lane: rounded to the nearest integer, ties to even (the default rounding mode).
  static C10_HOST_DEVICE inline V rint(V x) {
#if defined(__CUDA_ARCH__)
    return ::rintf(x);
#else
    return std::nearbyint(x);
#endif
  }
  // Per lane: |x| with the sign of s.
  static C10_HOST_DEVICE inline V copysign(V x, V s) { return std::copysign(x, s); }
};

// The integer twin of LaneOps, for formulas on FP32 bit patterns (math/split_math.h): a
// pattern lane P is a `uint32_t` on the GPU and in scalar code; the CPU kernels specialise
// PatternOps for at::vec::Vectorized<int32_t>. +, -, & and | are shared (wrapping, as unsigned
// arithmetic wraps); shifts, comparisons and the per-lane choice go through here. A Mask is
// what the comparisons give and select takes.
template <typename P>
struct PatternOps {
  using Mask = bool;
  static C10_HOST_DEVICE inline P splat(uint32_t c) { return c; }
  template <int k>
  static C10_HOST_DEVICE inline P shift_right(P x) {  // logical
    return x >> k;
  }
  template <int k>
  static C10_HOST_DEVICE inline P shift_left(P x) {
    return x << k;
  }
  // Signed (two's complement) comparison: the formulas compare magnitudes (below 2^31) and
  // sign-extended remainders.
  static C10_HOST_DEVICE inline Mask greater(P x, P y) {
    return static_cast<int32_t>(x) > static_cast<int32_t>(y);
  }
  static C10_HOST_DEVICE inline Mask equal(P x, P y) { return x == y; }
  static C10_HOST_DEVICE inline Mask both(Mask a, Mask b) { return a && b; }
  static C10_HOST_DEVICE inline Mask either(Mask a, Mask b) { return a || b; }
  static C10_HOST_DEVICE inline P select(Mask m, P if_true, P if_false) {
    return m ? if_true : if_false;
  }
};

}  // namespace fusedamp::math
