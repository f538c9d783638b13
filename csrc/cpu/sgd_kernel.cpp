// CPU: fused SGD step (momentum, dampening, Nesterov, weight decay). Per element: read grad,
// param (or FP32 master) and the momentum buffer; write param (and master) and the buffer.
// The formula is fusedamp::math::sgd_update, shared with CUDA.
// Compiled once per instruction set; see cpu_kernels.h.
#include "../ops/static_switch.h"
#include <fusedamp/math/sgd_math.h>

#include "quantized_blocks.h"
#include "step_loop.h"

namespace fusedamp::cpu::CPU_CAPABILITY {
namespace {

template <typename TP, typename TG, WeightStore kStore, bool kMomentum, typename TS>
void sgd_range(const StepWeights<TP, kStore>& w, TG* g, TS* buf, int64_t n,
               const math::SgdHyper& hyper, float lr, bool first_step, float grad_mult,
               bool write_grads) {
  const math::SgdHyper h = hyper;  // in registers, not reloaded after every store (adam_range)
  step_pairs(w, g, n, grad_mult, write_grads, [&](int64_t i, int64_t k, Vec& p0, Vec& p1,
                                                  Vec& g0, Vec& g1, auto ahead) {
    if constexpr (kMomentum) {
      Vec b0, b1;
      if constexpr (decltype(ahead)::value) {
        prefetch_pair_ahead(buf + i);
      }
      if (!first_step) {
        PairIO<TS>::load(buf + i, k, b0, b1);
      }
      math::sgd_update(p0, b0, g0, h, lr, first_step);
      math::sgd_update(p1, b1, g1, h, lr, first_step);
      PairIO<TS>::store(buf + i, k, b0, b1);
    } else {
      math::sgd_update_no_momentum(p0, g0, h, lr);
      math::sgd_update_no_momentum(p1, g1, h, lr);
    }
  });
}

// SGD's lists, both formats (step_lists_by_format).
struct SgdLists {
  template <typename TP, typename TG, WeightStore kStore, bool kMomentum, typename TS>
  static void dense(const CpuStep& step, const math::SgdHyper& h) {
    for_each_step_chunk(step, [&](int64_t i, const StepRow& row, int64_t b, int64_t e) {
      TS* buf = kMomentum ? static_cast<TS*>(row.state[0]) + b : nullptr;
      sgd_range<TP, TG, kStore, kMomentum>(
          step_weights<TP, kStore>(step, i, b), static_cast<TG*>(row.grad) + b, buf, e - b, h,
          step.lr, step.steps_before[i] == 0.f, step.grad_mult, step.write_back_grads);
    });
  }

  // int8 momentum buffers (math/quantized_moments_math.h, exp_avg's format): the walk of
  // quantized_blocks.h, with sgd_update over each pair's stored buffer.
  template <typename TP, typename TG, WeightStore kStore>
  static void quantized(const CpuStep& step, const math::SgdHyper& h) {
    quantized_lists<1, TP, TG, kStore>(step, [&](int64_t i) {
      const bool first_step = step.steps_before[i] == 0.f;
      return [h, lr = step.lr, first_step](int64_t, Vec& p0, Vec& p1, Vec& g0, Vec& g1,
                                          Vec* buf, Vec*) {
        math::sgd_update(p0, buf[0], g0, h, lr, first_step);
        math::sgd_update(p1, buf[1], g1, h, lr, first_step);
      };
    });
  }
};

}  // namespace

// The state list: the momentum buffers, where there is momentum; int8 buffers are quantized
// (the rows' second address: their block scales), and come with momentum != 0 (the checks).
// Without momentum there are no buffers and the state dtype is FP32. Whether there are is the
// state list's say (momentum != 0 in double), not the FP32 hyper-parameter's, which a momentum
// below 2^-150 rounds to 0.
template <>
void step<math::Sgd>(const CpuStep& step, at::ScalarType state_dtype, size_t state_lists,
                     const math::SgdHyper& h) {
  step_lists_by_format<SgdLists>(step, state_dtype, /*momentum=*/state_lists != 0, h);
}

}  // namespace fusedamp::cpu::CPU_CAPABILITY
