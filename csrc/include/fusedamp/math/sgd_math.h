#pragma once
// SGD with momentum, dampening, Nesterov and (L2) weight decay; same order as torch.optim.SGD:
//   g += wd * p
//   first step: buf = g            later: buf = momentum * buf + (1 - dampening) * g
//   nesterov:   g = g + momentum * buf         else g = buf
//   p -= lr * g
// Each of the four lines is one fused multiply-add (the L2 term, the buffer's sum after its
// rounded product momentum * buf, Nesterov's sum, the update), as torch.optim.SGD's CPU kernels
// compute them on AVX2/AVX-512 (mul_ then add(alpha), vectorised with fmadd).
#include <fusedamp/math/lane_ops.h>

namespace fusedamp::math {

// The learning rate is not here: a step reads it per tensor (a device tensor may override the
// number) and passes it to the updates.
struct SgdHyper {
  float momentum;
  float dampening;
  float weight_decay;
  float one_minus_dampening;  // rounded once from the double value
  bool nesterov;
  bool maximize;
};

inline SgdHyper make_sgd_hyper(double momentum, double dampening, double weight_decay,
                               bool nesterov, bool maximize) {
  SgdHyper h;
  h.momentum = static_cast<float>(momentum);
  h.dampening = static_cast<float>(dampening);
  h.weight_decay = static_cast<float>(weight_decay);
  h.one_minus_dampening = static_cast<float>(1.0 - dampening);
  h.nesterov = nesterov;
  h.maximize = maximize;
  return h;
}

// first_step is uniform per tensor (read from its step count), so it is a branch on a scalar.
template <typename V>
C10_HOST_DEVICE inline void sgd_update(
    V& p, V& buf, V g, const SgdHyper& h, float lr, bool first_step) {
  if (h.maximize) {
    g = V(0.f) - g;
  }
  if (h.weight_decay != 0.f) {
    g = LaneOps<V>::fma(V(h.weight_decay), p, g);
  }
  // Called only where a momentum buffer exists (momentum != 0 in double, the caller's test):
  // not tested again on the FP32 momentum, which a momentum below 2^-150 rounds to 0 and would
  // leave a first step's buffer unwritten.
  if (first_step) {
    buf = g;
  } else {
    buf = LaneOps<V>::fma(V(h.one_minus_dampening), g, V(h.momentum) * buf);
  }
  g = h.nesterov ? LaneOps<V>::fma(V(h.momentum), buf, g) : buf;
  p = LaneOps<V>::fma(V(-lr), g, p);
}

// Same without a momentum buffer (momentum == 0): nothing to read or write for it.
template <typename V>
C10_HOST_DEVICE inline void sgd_update_no_momentum(V& p, V g, const SgdHyper& h, float lr) {
  if (h.maximize) {
    g = V(0.f) - g;
  }
  if (h.weight_decay != 0.f) {
    g = LaneOps<V>::fma(V(h.weight_decay), p, g);
  }
  p = LaneOps<V>::fma(V(-lr), g, p);
}

// sgd_step_ at the operator boundary (fusedamp/ops.h FUSEDAMP_STEP_ALGORITHMS): its
// hyper-parameters from the operator's arguments, their checks, its state list. Its kernels
// are its own (cpu/sgd_kernel.cpp, cuda/sgd_kernel.cu): a tensor's first step writes the
// buffer without reading it.
struct Sgd {
  using Hyper = SgdHyper;

  template <typename Args>
  static Hyper hyper(const Args& a) {
    return make_sgd_hyper(a.momentum, a.dampening, a.weight_decay, a.nesterov, a.maximize);
  }

  template <typename Args, typename Check>
  static void check(const Args& a, const Check& c) {
    c.finite_nonneg("momentum", a.momentum);
    c.dampening(a.dampening);
    c.finite_nonneg("weight_decay", a.weight_decay);
    c.nesterov(a.nesterov, a.momentum, a.dampening);
    c.that(a.momentum != 0.0 || a.momentum_buffers.empty(),
           "momentum_buffers must be empty when momentum is 0");
  }

  // momentum_buffers where there is momentum (in double: a momentum below 2^-150 rounds to 0
  // in FP32 and still has its buffers); quantized: momentum_scales.
  template <typename Args, typename Lists>
  static void lists(const Args& a, Lists& s) {
    if (a.momentum != 0.0) {
      s.state.add("momentum_buffers", a.momentum_buffers);
    }
    s.set_block_scales("momentum_scales", a.momentum_scales);
  }
};

}  // namespace fusedamp::math
