#pragma once
// Row-wise updates of embedding tables from sparse gradients: the rows a batch looked up, each
// with its gradient already summed over the batch's duplicate lookups (in FP32) and multiplied
// by the inverse loss scale. Same operation order as torch.optim's sparse paths. torch adds a
// sparse tensor to a dense one with axpy (dense += alpha * values: one FMA on AVX2/AVX-512, as
// measured on torch 2.11's CPU build), so each `table += coef * x` below is one FMA; every
// other line rounds each operation (libfusedamp is compiled without contraction, lane_ops.h):
//   SGD         p = fma(-lr, g, p)            momentum: buf and the update as math/sgd_math.h's
//   Adagrad     sum = sum + g * g      p = fma(-clr, g / (sqrt(sum) + eps), p)
//               clr = lr / (1 + (t - 1) * lr_decay)
//   SparseAdam  m = m + (g - m) * (1 - beta1)           v = v + (g * g - v) * (1 - beta2)
//               p = p + (-step_size) * (m / (sqrt(v) + eps))   (torch adds with alpha 1)
//               step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)
//   row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD): one accumulator per row
//               acc = acc + (sum over the row of g * g) / dim
//               p = fma(-(lr / (sqrt(acc) + eps)), g, p)
// A row's gradient is its lookups' values summed in FP32, one addition at a time in the order
// the lookups appear in the sparse gradient (the first one's value, plus the second's, ...):
// the CPU kernel walks the lookups in order, the CUDA one sorts them stably by row, so the
// same bits on both.
// The coefficients (-lr, -clr, -step_size) are formed in double once per step and rounded
// once to FP32, as torch passes a Python float to its kernels.
#include <fusedamp/math/lane_ops.h>

#include <cmath>

namespace fusedamp::math {

enum class SparseRowsAlgorithm { kSgd, kAdagrad, kAdam, kRowWiseAdagrad };

// Every algorithm's hyper-parameters (those it does not take stay 0), in this order.
struct SparseRowsHyper {
  double lr = 0.0;
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  double lr_decay = 0.0;
  double eps = 0.0;
  double beta1 = 0.0;
  double beta2 = 0.0;
  bool maximize = false;
};

// torch.optim.SGD on a sparse gradient: without momentum the rows looked up move by -lr * g.
template <typename V>
C10_HOST_DEVICE inline void sparse_sgd_update(V& p, V g, float neg_lr) {
  p = LaneOps<V>::fma(V(neg_lr), g, p);
}

// With momentum: torch keeps the buffer as a sparse tensor that every step scales (buf *
// momentum, every row ever looked up) and extends by this step's gradient, then adds all of it
// to the table. A dense buffer holds the same values: rows not looked up this step take g = 0.
// first_step: torch's buffer is the gradient itself (no dampening).
template <typename V>
C10_HOST_DEVICE inline void sparse_sgd_momentum_update(V& p, V& buf, V g, float neg_lr,
                                                       float momentum,
                                                       float one_minus_dampening, bool nesterov,
                                                       bool first_step) {
  buf = first_step ? g : LaneOps<V>::fma(V(one_minus_dampening), g, V(momentum) * buf);
  const V d = nesterov ? LaneOps<V>::fma(V(momentum), buf, g) : buf;
  p = LaneOps<V>::fma(V(neg_lr), d, p);
}

template <typename V>
C10_HOST_DEVICE inline void sparse_adagrad_update(V& p, V& sum, V g, float neg_clr, float eps) {
  sum = sum + g * g;
  const V std_dev = LaneOps<V>::sqrt(sum) + V(eps);
  p = LaneOps<V>::fma(V(neg_clr), g / std_dev, p);
}

template <typename V>
C10_HOST_DEVICE inline void sparse_adam_update(V& p, V& m, V& v, V g, float one_minus_beta1,
                                               float one_minus_beta2, float neg_step_size,
                                               float eps) {
  m = m + (g - m) * V(one_minus_beta1);
  v = v + (g * g - v) * V(one_minus_beta2);
  const V denom = LaneOps<V>::sqrt(v) + V(eps);
  p = p + V(neg_step_size) * (m / denom);
}

// Row-wise Adagrad: the accumulator's increment is the row's sum of squares divided by the row
// length; the multiplier is computed once per row. The sum of squares of a row's gradient
// (times the inverse loss scale) is grouped the same way by every kernel, whatever its vector
// width or warp size: element i goes into partial sum i mod kRowSquareSums (one FMA each, in
// increasing i), then the partial sums are added in order, starting from +0.
constexpr int kRowSquareSums = 16;

template <typename V>
C10_HOST_DEVICE inline V row_square_partial(V partial, V x) {
  return LaneOps<V>::fma(x, x, partial);
}

C10_HOST_DEVICE inline float rowwise_adagrad_multiplier(float& acc, float row_sum_sq,
                                                        int64_t row_length, float lr, float eps) {
  acc = acc + row_sum_sq / static_cast<float>(row_length);
  return lr / (::sqrtf(acc) + eps);
}

template <typename V>
C10_HOST_DEVICE inline void rowwise_adagrad_update(V& p, V g, float multiplier) {
  p = LaneOps<V>::fma(V(-multiplier), g, p);
}

// Once per step, in double: the coefficients torch computes in Python floats. The CPU
// computes them on the host; CUDA in a one-thread kernel, from the step count on the device.
// Every operation is IEEE-rounded on both but pow (glibc's against CUDA's, which may differ in
// the last bit of the double), so the FP32 coefficient agrees unless that double lies within
// an ulp of a tie between two floats.
C10_HOST_DEVICE inline float adagrad_neg_clr(double lr, double lr_decay, double step_after) {
  return static_cast<float>(-(lr / (1.0 + (step_after - 1.0) * lr_decay)));
}

C10_HOST_DEVICE inline float sparse_adam_neg_step_size(double lr, double beta1, double beta2,
                                                       double step_after) {
  const double bc1 = 1.0 - ::pow(beta1, step_after);
  const double bc2 = 1.0 - ::pow(beta2, step_after);
  return static_cast<float>(-(lr * ::sqrt(bc2) / bc1));
}

}  // namespace fusedamp::math
