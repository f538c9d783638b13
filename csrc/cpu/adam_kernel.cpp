// CPU: fused Adam/AdamW step. Per element: read grad, param (or FP32 master), m, v; write
// param (and master), m, v. The formula is fusedamp::math::adam_update, shared with CUDA.
// Compiled once per instruction set; see cpu_kernels.h.
#include "../ops/static_switch.h"
#include <fusedamp/math/adam_math.h>

#include "step_loop.h"

namespace fusedamp::cpu::CPU_CAPABILITY {
namespace {

template <typename TP, typename TG, WeightStore kStore, bool kAmsgrad, typename TS>
void adam_range(const StepWeights<TP, kStore>& w, TG* g, TS* m, TS* v, TS* v_max, int64_t n,
                const math::AdamHyper& h, const math::AdamCoeffs& c, float grad_mult,
                bool write_grads) {
  step_pairs(w, g, n, grad_mult, write_grads, [&](int64_t i, int64_t k, Vec& p0, Vec& p1,
                                                  Vec& g0, Vec& g1) {
    Vec m0, m1, v0, v1;
    PairIO<TS>::load(m + i, k, m0, m1);
    PairIO<TS>::load(v + i, k, v0, v1);
    // A tail of at most one vector (all of a tensor under 17 elements: biases, scales, gains)
    // leaves the second vector all padding, which the stores leave unwritten: its update, a
    // vector sqrt and two vector divisions (the slowest instructions here), is skipped.
    const bool second_vec = k > Vec::size();
    if constexpr (kAmsgrad) {
      Vec x0, x1;
      PairIO<TS>::load(v_max + i, k, x0, x1);
      math::adam_update(p0, m0, v0, g0, h, c, &x0);
      if (second_vec) {
        math::adam_update(p1, m1, v1, g1, h, c, &x1);
      }
      PairIO<TS>::store(v_max + i, k, x0, x1);
    } else {
      math::adam_update(p0, m0, v0, g0, h, c);
      if (second_vec) {
        math::adam_update(p1, m1, v1, g1, h, c);
      }
    }
    PairIO<TS>::store(m + i, k, m0, m1);
    PairIO<TS>::store(v + i, k, v0, v1);
  });
}

template <typename TP, typename TG, WeightStore kStore, bool kAmsgrad, typename TS>
void adam_lists(const CpuStep& step, const math::AdamHyper& h) {
  const size_t n = step.params.size();
  ScratchVector<math::AdamCoeffs> coeffs(n);
  for (size_t i = 0; i < n; ++i) {
    // Usually every tensor is at the same step: two pow() per tensor are then wasted work.
    coeffs[i] = i > 0 && step.steps_before[i] == step.steps_before[i - 1]
                    ? coeffs[i - 1]
                    : math::adam_coeffs<double>(h, step.lr, step.steps_before[i]);
  }
  for_each_step_chunk(step, [&](int64_t i, const StepRow& row, int64_t b, int64_t e) {
    adam_range<TP, TG, kStore, kAmsgrad>(
        step_weights<TP, kStore>(step, i, b), static_cast<TG*>(row.grad) + b,
        static_cast<TS*>(row.state[0]) + b, static_cast<TS*>(row.state[1]) + b,
        kAmsgrad ? static_cast<TS*>(row.state[2]) + b : nullptr, e - b, h, coeffs[i],
        step.grad_mult, step.write_back_grads);
  });
}

}  // namespace

void adam(const CpuStep& step, at::ScalarType state_dtype, bool amsgrad,
          const math::AdamHyper& h) {
  // The moments are FP32 or BF16 (state_dtype), all lists alike.
  step_switch(step, [&](auto param, auto grad, auto store, auto with_amsgrad, auto state) {
    adam_lists<decltype(param), decltype(grad), store, with_amsgrad, decltype(state)>(step, h);
  }, BoolSwitch{amsgrad}, DtypeSwitch<float, c10::BFloat16>{state_dtype});
}

}  // namespace fusedamp::cpu::CPU_CAPABILITY
