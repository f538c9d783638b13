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

}  // namespace fusedamp::math
