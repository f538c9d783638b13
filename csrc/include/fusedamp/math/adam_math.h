#pragma once
// Adam / AdamW on FP32 state. Same operation order as torch.optim.Adam's single-tensor path:
//   (L2)    g += wd * p                     (decoupled)  p *= 1 - lr * wd
//   m = m + (1 - beta1) * (g - m)           v = beta2 * v + (1 - beta2) * g * g
//   p -= step_size * m / (sqrt(v) / bc2_sqrt + eps)
// with step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t).
// The L2 term, m's update and v's sum are each one fused multiply-add, as torch.optim's CPU
// kernels compute them on AVX2/AVX-512 (add(alpha=), lerp_ and mul_ + addcmul_ are vectorised
// with fmadd: on 2^20 elements torch's ops equal these placements in every element, the
// unfused forms differ in 2-29 % of them). Nothing else is fused: AdamW's decay, the
// denominator and the update round each operation, as torch's do.
#include <fusedamp/math/lane_ops.h>

namespace fusedamp::math {

// The learning rate is not here: a step reads it per tensor (a device tensor may override the
// number), and adam_coeffs takes it.
struct AdamHyper {
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  // 1 - beta, rounded once from the double value (as torch passes them to its kernels).
  float one_minus_beta1;
  float one_minus_beta2;
  // The betas as given, for the bias corrections 1 - beta^t: torch raises the double betas
  // (pow of the FP32-rounded 0.999 is off by 1.3e-5 relative at t = 1).
  double beta1_exact;
  double beta2_exact;
  bool decoupled;  // AdamW
  bool maximize;
};

// Host-side constructor: the derived constants are computed in double.
inline AdamHyper make_adam_hyper(double beta1, double beta2, double eps, double weight_decay,
                                 bool decoupled, bool maximize) {
  AdamHyper h;
  h.beta1 = static_cast<float>(beta1);
  h.beta2 = static_cast<float>(beta2);
  h.eps = static_cast<float>(eps);
  h.weight_decay = static_cast<float>(weight_decay);
  h.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.beta1_exact = beta1;
  h.beta2_exact = beta2;
  h.decoupled = decoupled;
  h.maximize = maximize;
  return h;
}

// Per-tensor coefficients, computed once per tensor (per chunk on the GPU) from the step
// count *before* it is incremented. acc_t is double on the CPU (as torch computes them in
// Python floats) and may be float or double on the GPU.
struct AdamCoeffs {
  float step_size;
  float bc2_sqrt;
  float decay_factor;  // 1 - lr * wd for AdamW, 1 otherwise
};

template <typename acc_t>
C10_HOST_DEVICE inline AdamCoeffs adam_coeffs(const AdamHyper& h, float lr, float step_before) {
  const acc_t t = static_cast<acc_t>(step_before) + acc_t(1);
#if defined(__CUDA_ARCH__)
  const acc_t bc1 = acc_t(1) - ::pow(static_cast<acc_t>(h.beta1_exact), t);
  const acc_t bc2 = acc_t(1) - ::pow(static_cast<acc_t>(h.beta2_exact), t);
  const acc_t bc2_sqrt = ::sqrt(bc2);
#else
  const acc_t bc1 = acc_t(1) - std::pow(static_cast<acc_t>(h.beta1_exact), t);
  const acc_t bc2 = acc_t(1) - std::pow(static_cast<acc_t>(h.beta2_exact), t);
  const acc_t bc2_sqrt = std::sqrt(bc2);
#endif
  AdamCoeffs c;
  c.step_size = static_cast<float>(static_cast<acc_t>(lr) / bc1);
  c.bc2_sqrt = static_cast<float>(bc2_sqrt);
  c.decay_factor = h.decoupled ? static_cast<float>(acc_t(1) - static_cast<acc_t>(lr) *
                                                                    static_cast<acc_t>(h.weight_decay))
                                : 1.f;
  return c;
}

// One element (or one vector of lanes). g is the raw gradient times `grad_mult`
// (inverse loss scale and clip coefficient); p, m, v are FP32 and updated in place. With
// AMSGrad (v_max given) the denominator uses the running maximum of v, as torch.optim.Adam
// with amsgrad=True: v_max = max(v_max, v) after v's update. sqrt_v, when given, receives
// the square root the denominator took (a quantized v's code is formed from it).
template <typename V>
C10_HOST_DEVICE inline void adam_update(V& p, V& m, V& v, V g, const AdamHyper& h,
                                        const AdamCoeffs& c, V* v_max = nullptr,
                                        V* sqrt_v = nullptr) {
  if (h.maximize) {
    g = V(0.f) - g;
  }
  if (h.weight_decay != 0.f) {
    if (h.decoupled) {
      p = p * V(c.decay_factor);
    } else {
      g = LaneOps<V>::fma(V(h.weight_decay), p, g);
    }
  }
  m = LaneOps<V>::fma(V(h.one_minus_beta1), g - m, m);
  v = LaneOps<V>::fma(V(h.one_minus_beta2) * g, g, v * V(h.beta2));
  if (v_max != nullptr) {
    *v_max = LaneOps<V>::max(*v_max, v);
  }
  const V root = LaneOps<V>::sqrt(v_max != nullptr ? *v_max : v);
  if (sqrt_v != nullptr) {
    *sqrt_v = root;
  }
  const V denom = root / V(c.bc2_sqrt) + V(h.eps);
  p = p - V(c.step_size) * m / denom;
}

// adam_step_ at the operator boundary (fusedamp/ops.h FUSEDAMP_STEP_ALGORITHMS): its
// hyper-parameters from the operator's arguments, their checks, its state lists. Its kernels
// are its own (cpu/adam_kernel.cpp, cuda/adam_kernel.cu): AMSGrad, the bias corrections per
// tensor and the quantized moments are shaped for speed there.
struct Adam {
  using Hyper = AdamHyper;

  template <typename Args>
  static Hyper hyper(const Args& a) {
    return make_adam_hyper(a.beta1, a.beta2, a.eps, a.weight_decay, a.decoupled_weight_decay,
                           a.maximize);
  }

  // After the lr's check (every algorithm's); `c` words the messages (ops/step_checks.cpp).
  template <typename Args, typename Check>
  static void check(const Args& a, const Check& c) {
    c.betas(a.beta1, a.beta2);
    c.finite_nonneg("eps", a.eps);
    c.finite_nonneg("weight_decay", a.weight_decay);
  }

  // exp_avgs, exp_avg_sqs[, max_exp_avg_sqs (AMSGrad)]; quantized: moment_scales.
  template <typename Args, typename Lists>
  static void lists(const Args& a, Lists& s) {
    s.state.add("exp_avgs", a.exp_avgs);
    s.state.add("exp_avg_sqs", a.exp_avg_sqs);
    if (a.max_exp_avg_sqs.has_value() && !a.max_exp_avg_sqs->empty()) {
      s.state.add("max_exp_avg_sqs", *a.max_exp_avg_sqs);
    }
    s.set_block_scales("moment_scales", a.moment_scales);
  }
};

}  // namespace fusedamp::math
