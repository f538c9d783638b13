// CPU: fused Adam/AdamW step. Per element: read grad, param (or FP32 master), m, v; write
// param (and master), m, v. The formula is fusedamp::math::adam_update, shared with CUDA.
// Compiled once per instruction set; see cpu_kernels.h.
#include "../ops/static_switch.h"
#include <fusedamp/math/adam_math.h>
#include <fusedamp/math/quantized_moments_math.h>

#include "quantized_blocks.h"
#include "step_loop.h"

namespace fusedamp::cpu::CPU_CAPABILITY {
namespace {

// Each tensor's bias-corrected coefficients, from its step count before the update.
void fill_tensor_coeffs(const CpuStep& step, const math::AdamHyper& h,
                        ScratchVector<math::AdamCoeffs>& coeffs) {
  for (size_t i = 0; i < step.params.size(); ++i) {
    // Usually every tensor is at the same step: two pow() per tensor are then wasted work.
    coeffs[i] = i > 0 && step.steps_before[i] == step.steps_before[i - 1]
                    ? coeffs[i - 1]
                    : math::adam_coeffs<double>(h, step.lr, step.steps_before[i]);
  }
}

template <typename TP, typename TG, WeightStore kStore, bool kAmsgrad, typename TS>
void adam_range(const StepWeights<TP, kStore>& w, TG* g, TS* m, TS* v, TS* v_max, int64_t n,
                const math::AdamHyper& hyper, const math::AdamCoeffs& coeffs, float grad_mult,
                bool write_grads) {
  // Copies: through the references every vector store (which may alias anything) reloads
  // them; local, they stay in registers.
  const math::AdamHyper h = hyper;
  const math::AdamCoeffs c = coeffs;
  step_pairs(w, g, n, grad_mult, write_grads, [&](int64_t i, int64_t k, Vec& p0, Vec& p1,
                                                  Vec& g0, Vec& g1, auto ahead) {
    Vec m0, m1, v0, v1;
    if constexpr (decltype(ahead)::value) {
      prefetch_pair_ahead(m + i);
      prefetch_pair_ahead(v + i);
      if constexpr (kAmsgrad) {
        prefetch_pair_ahead(v_max + i);
      }
    }
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

// Adam's lists, both formats (step_lists_by_format).
struct AdamLists {
  template <typename TP, typename TG, WeightStore kStore, bool kAmsgrad, typename TS>
  static void dense(const CpuStep& step, const math::AdamHyper& h) {
    ScratchVector<math::AdamCoeffs> coeffs(step.params.size());
    fill_tensor_coeffs(step, h, coeffs);
    for_each_step_chunk(step, [&](int64_t i, const StepRow& row, int64_t b, int64_t e) {
      adam_range<TP, TG, kStore, kAmsgrad>(
          step_weights<TP, kStore>(step, i, b), static_cast<TG*>(row.grad) + b,
          static_cast<TS*>(row.state[0]) + b, static_cast<TS*>(row.state[1]) + b,
          kAmsgrad ? static_cast<TS*>(row.state[2]) + b : nullptr, e - b, h, coeffs[i],
          step.grad_mult, step.write_back_grads);
    });
  }

  // Quantized moments (math/quantized_moments_math.h): the walk of quantized_blocks.h, with
  // adam_update over each pair's stored moments.
  template <typename TP, typename TG, WeightStore kStore>
  static void quantized(const CpuStep& step, const math::AdamHyper& h) {
    ScratchVector<math::AdamCoeffs> coeffs(step.params.size());
    fill_tensor_coeffs(step, h, coeffs);
    quantized_lists<2, TP, TG, kStore>(step, [&](int64_t i) {
      return [h, c = coeffs[i]](int64_t k, Vec& p0, Vec& p1, Vec& g0, Vec& g1, Vec* m, Vec* v) {
        Vec r0(0.f), r1(0.f);  // sqrt(v), whose square root is what v's code is formed from
        math::adam_update(p0, m[0], v[0], g0, h, c, static_cast<Vec*>(nullptr), &r0);
        // A tail of at most one vector leaves the second all padding (see adam_range).
        if (k > Vec::size()) {
          math::adam_update(p1, m[1], v[1], g1, h, c, static_cast<Vec*>(nullptr), &r1);
        }
        v[0] = math::exp_avg_sq_root_of_sqrt(r0);
        v[1] = math::exp_avg_sq_root_of_sqrt(r1);
      };
    });
  }
};

}  // namespace

// The state lists: exp_avgs, exp_avg_sqs, and with AMSGrad its running maxima; int8 exp_avgs
// are quantized moments (the rows' third address: their block scales), which take no AMSGrad
// (the checks refuse it).
template <>
void step<math::Adam>(const CpuStep& step, at::ScalarType state_dtype, size_t state_lists,
                      const math::AdamHyper& h) {
  step_lists_by_format<AdamLists>(step, state_dtype, /*amsgrad=*/state_lists == 3, h);
}

}  // namespace fusedamp::cpu::CPU_CAPABILITY
