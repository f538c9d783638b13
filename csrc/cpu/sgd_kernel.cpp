// CPU: fused SGD step (momentum, dampening, Nesterov, weight decay). Per element: read grad,
// param (or FP32 master) and the momentum buffer; write param (and master) and the buffer.
// The formula is fusedamp::math::sgd_update, shared with CUDA.
// Compiled once per instruction set; see cpu_kernels.h.
#include "../ops/static_switch.h"
#include <fusedamp/math/sgd_math.h>

#include "chunked_for_each.h"
#include "cpu_kernels.h"
#include "vec_io.h"

namespace fusedamp::cpu::CPU_CAPABILITY {
namespace {

template <typename TP, typename TG, WeightStore kStore, bool kWriteGrads, bool kMomentum,
          typename TS>
void sgd_range(const StepWeights<TP, kStore>& w, TG* g, TS* buf, int64_t n,
               const math::SgdHyper& h, float lr, bool first_step, float grad_mult) {
  const Vec mult(grad_mult);
  for (int64_t i = 0; i < n; i += kPair) {
    const int64_t k = n - i;
    Vec g0, g1, p0, p1;
    PairIO<TG>::load(g + i, k, g0, g1);
    g0 = g0 * mult;
    g1 = g1 * mult;
    w.load(i, k, p0, p1);
    if constexpr (kMomentum) {
      Vec b0, b1;
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
    w.store(i, k, p0, p1);
    if constexpr (kWriteGrads) {
      PairIO<TG>::store(g + i, k, g0, g1);
    }
  }
}

template <typename TP, typename TG, WeightStore kStore, bool kWriteGrads, bool kMomentum,
          typename TS>
void sgd_lists(const CpuStep& step, const math::SgdHyper& h) {
  const ChunkPlan plan(step.params.size(), [&](size_t i) { return step.rows[i].numel; });
  for_each_chunk(plan, [&](int64_t, int64_t i, int64_t b, int64_t e) {
    prefetch_elements_ahead(step, i, b);
    const StepRow& row = step.rows[i];
    const auto w = step_weights<TP, kStore>(step, i, b);
    TS* buf = kMomentum ? static_cast<TS*>(row.state[0]) + b : nullptr;
    sgd_range<TP, TG, kStore, kWriteGrads, kMomentum>(
        w, static_cast<TG*>(row.grad) + b, buf, e - b, h, step.lr,
        step.steps_before[i] == 0.f, step.grad_mult);
  });
}

}  // namespace

void sgd(const CpuStep& step, at::ScalarType state_dtype, const math::SgdHyper& h) {
  // The momentum buffers are FP32 or BF16 (state_dtype); without momentum there are none and
  // the caller passes FP32.
  step_switch(step, [&](auto param, auto grad, auto store, auto write_grads, auto with_momentum,
                        auto state) {
    sgd_lists<decltype(param), decltype(grad), store, write_grads, with_momentum,
              decltype(state)>(step, h);
  }, BoolSwitch{h.momentum != 0.f}, DtypeSwitch<float, c10::BFloat16>{state_dtype});
}

}  // namespace fusedamp::cpu::CPU_CAPABILITY
