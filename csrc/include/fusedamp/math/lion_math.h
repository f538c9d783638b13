#pragma once
// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), in the operation
// order of the reference implementation lucidrains/lion-pytorch (lion_pytorch.py, update_fn):
//   p *= 1 - lr * wd                             decoupled weight decay, first
//   c = beta1 * m + (1 - beta1) * g              p -= lr * sign(c)
//   m = beta2 * m + (1 - beta2) * g
// Each interpolation is a rounded product and one fused multiply-add, as torch's CPU kernels
// compute the reference's mul_ then add(alpha=) (sgd_math.h's buffer line); lr * sign(c) is
// exact, so the update rounds once either way (written as an FMA). sign is torch.sign's: 0 for
// 0 and for NaN. The decay factor 1 - lr * wd is formed in double and rounded once, as the
// reference's Python float reaches mul_.
#include <fusedamp/math/lane_ops.h>

namespace fusedamp::math {

struct LionHyper {
  float beta1;
  float beta2;
  float weight_decay;
  float one_minus_beta1;
  float one_minus_beta2;
  bool maximize;
};

// Per tensor: the learning rate a step reads (a device tensor may override the number) and the
// decay factor made from it.
struct LionCoeffs {
  float lr;
  float decay_factor;  // 1 - lr * wd
};

// torch.sign: 1, -1, or 0 for zeros and NaN (neither comparison holds).
template <typename V>
C10_HOST_DEVICE inline V lion_sign(V x) {
  return LaneOps<V>::count_if_less(V(0.f), V(0.f), x) -
         LaneOps<V>::count_if_less(V(0.f), x, V(0.f));
}

template <typename V>
C10_HOST_DEVICE inline void lion_update(V& p, V& m, V g, const LionHyper& h,
                                        const LionCoeffs& c) {
  if (h.maximize) {
    g = V(0.f) - g;
  }
  if (h.weight_decay != 0.f) {
    p = p * V(c.decay_factor);
  }
  const V interpolated = LaneOps<V>::fma(V(h.one_minus_beta1), g, V(h.beta1) * m);
  p = LaneOps<V>::fma(V(-c.lr), lion_sign(interpolated), p);
  m = LaneOps<V>::fma(V(h.one_minus_beta2), g, V(h.beta2) * m);
}

// lion_step_ at the operator boundary (fusedamp/ops.h FUSEDAMP_STEP_ALGORITHMS), and its
// element update for the shared step kernels (generic: cpu/step_kernel.cpp,
// cuda/step_kernel.cu). One state list, exp_avgs, float32 or bfloat16 (no 8-bit format).
struct Lion {
  using Hyper = LionHyper;
  using Coeffs = LionCoeffs;
  static constexpr int kStateLists = 1;

  // The betas and 1 - beta rounded once from the double values (as the reference's alpha
  // reaches add).
  template <typename Args>
  static Hyper hyper(const Args& a) {
    return {static_cast<float>(a.beta1),       static_cast<float>(a.beta2),
            static_cast<float>(a.weight_decay), static_cast<float>(1.0 - a.beta1),
            static_cast<float>(1.0 - a.beta2),  a.maximize};
  }

  template <typename Args, typename Lists>
  static void lists(const Args& a, Lists& s) {
    s.state.add("exp_avgs", a.exp_avgs);
  }

  template <typename Args, typename Check>
  static void check(const Args& a, const Check& c) {
    c.betas(a.beta1, a.beta2);
    c.finite_nonneg("weight_decay", a.weight_decay);
  }

  // Once per tensor (per thread block on the GPU), from the learning rate the step reads.
  template <typename acc_t>
  static C10_HOST_DEVICE Coeffs coeffs(const Hyper& h, float lr, float /*step_before*/) {
    return {lr, static_cast<float>(acc_t(1) - static_cast<acc_t>(lr) *
                                                  static_cast<acc_t>(h.weight_decay))};
  }

  // state: the element's exp_avg.
  template <typename V>
  static C10_HOST_DEVICE void update(V& p, V* state, V g, const Hyper& h, const Coeffs& c) {
    lion_update(p, state[0], g, h, c);
  }
};

}  // namespace fusedamp::math
