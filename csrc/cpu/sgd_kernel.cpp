// CPU: fused SGD step (momentum, dampening, Nesterov, weight decay). Per element: read grad,
// param (or FP32 master) and the momentum buffer; write param (and master) and the buffer.
// The formula is fusedamp::math::sgd_update, shared with CUDA.
// Compiled once per instruction set; see cpu_kernels.h.
#include "../static_switch.h"
#include <fusedamp/math/sgd_math.h>

#include "chunked_for_each.h"
#include "cpu_kernels.h"
#include "vec_io.h"

namespace fusedamp::cpu::CPU_CAPABILITY {
namespace {

template <typename TP, typename TG, bool kMaster, bool kMomentum>
void sgd_range(TP* p, float* master, const TG* g, float* buf, int64_t n, const math::SgdHyper& h,
               float lr, bool first_step, float grad_mult) {
  const Vec mult(grad_mult);
  for (int64_t i = 0; i < n; i += kPair) {
    const int64_t k = n - i;
    Vec g0, g1, p0, p1;
    PairIO<TG>::load(g + i, k, g0, g1);
    if constexpr (kMaster) {
      PairIO<float>::load(master + i, k, p0, p1);
    } else {
      PairIO<TP>::load(p + i, k, p0, p1);
    }
    if constexpr (kMomentum) {
      Vec b0, b1;
      if (!first_step) {
        PairIO<float>::load(buf + i, k, b0, b1);
      }
      math::sgd_update(p0, b0, g0 * mult, h, lr, first_step);
      math::sgd_update(p1, b1, g1 * mult, h, lr, first_step);
      PairIO<float>::store(buf + i, k, b0, b1);
    } else {
      math::sgd_update_no_momentum(p0, g0 * mult, h, lr);
      math::sgd_update_no_momentum(p1, g1 * mult, h, lr);
    }
    if constexpr (kMaster) {
      PairIO<float>::store(master + i, k, p0, p1);
    }
    PairIO<TP>::store(p + i, k, p0, p1);
  }
}

template <typename TP, typename TG, bool kMaster, bool kMomentum>
void sgd_lists(at::TensorList params, at::TensorList master_params, at::TensorList grads,
               at::TensorList bufs, const float* steps_before, const math::SgdHyper& h, float lr,
               float grad_mult) {
  const ChunkPlan plan(params);
  for_each_chunk(params, plan, [&](int64_t, int64_t i, int64_t b, int64_t e) {
    float* master = kMaster ? master_params[i].data_ptr<float>() + b : nullptr;
    float* buf = kMomentum ? bufs[i].data_ptr<float>() + b : nullptr;
    sgd_range<TP, TG, kMaster, kMomentum>(params[i].data_ptr<TP>() + b, master,
                                          grads[i].const_data_ptr<TG>() + b, buf, e - b, h, lr,
                                          steps_before[i] == 0.f, grad_mult);
  });
}

}  // namespace

void sgd(at::TensorList params, at::TensorList master_params, at::TensorList grads,
         at::TensorList momentum_buffers, const float* steps_before, const math::SgdHyper& h,
         float lr, float grad_mult) {
  step_switch(
      params, grads, master_params,
      [&](auto param, auto grad, auto has_master, auto has_momentum) {
        sgd_lists<decltype(param), decltype(grad), has_master, has_momentum>(
            params, master_params, grads, momentum_buffers, steps_before, h, lr, grad_mult);
      },
      BoolSwitch{h.momentum != 0.f});
}

}  // namespace fusedamp::cpu::CPU_CAPABILITY
