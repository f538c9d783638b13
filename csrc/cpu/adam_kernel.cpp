// CPU: fused Adam/AdamW step. Per element: read grad, param (or FP32 master), m, v; write
// param (and master), m, v. The formula is fusedamp::math::adam_update, shared with CUDA.
// Compiled once per instruction set; see cpu_kernels.h.
#include "../static_switch.h"
#include <fusedamp/math/adam_math.h>

#include "chunked_for_each.h"
#include "cpu_kernels.h"
#include "vec_io.h"

namespace fusedamp::cpu::CPU_CAPABILITY {
namespace {

template <typename TP, typename TG, bool kMaster>
void adam_range(TP* p, float* master, const TG* g, float* m, float* v, int64_t n,
                const math::AdamHyper& h, const math::AdamCoeffs& c, float grad_mult) {
  const Vec mult(grad_mult);
  for (int64_t i = 0; i < n; i += kPair) {
    const int64_t k = n - i;
    Vec g0, g1, p0, p1, m0, m1, v0, v1;
    PairIO<TG>::load(g + i, k, g0, g1);
    if constexpr (kMaster) {
      PairIO<float>::load(master + i, k, p0, p1);
    } else {
      PairIO<TP>::load(p + i, k, p0, p1);
    }
    PairIO<float>::load(m + i, k, m0, m1);
    PairIO<float>::load(v + i, k, v0, v1);
    math::adam_update(p0, m0, v0, g0 * mult, h, c);
    math::adam_update(p1, m1, v1, g1 * mult, h, c);
    PairIO<float>::store(m + i, k, m0, m1);
    PairIO<float>::store(v + i, k, v0, v1);
    if constexpr (kMaster) {
      PairIO<float>::store(master + i, k, p0, p1);
    }
    PairIO<TP>::store(p + i, k, p0, p1);
  }
}

template <typename TP, typename TG, bool kMaster>
void adam_lists(at::TensorList params, at::TensorList master_params, at::TensorList grads,
                at::TensorList exp_avgs, at::TensorList exp_avg_sqs, const float* steps_before,
                const math::AdamHyper& h, float lr, float grad_mult) {
  std::vector<math::AdamCoeffs> coeffs(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    // Usually every tensor is at the same step: two pow() per tensor are then wasted work.
    coeffs[i] = i > 0 && steps_before[i] == steps_before[i - 1]
                    ? coeffs[i - 1]
                    : math::adam_coeffs<double>(h, lr, steps_before[i]);
  }
  const ChunkPlan plan(params);
  for_each_chunk(params, plan, [&](int64_t, int64_t i, int64_t b, int64_t e) {
    float* master = kMaster ? master_params[i].data_ptr<float>() + b : nullptr;
    adam_range<TP, TG, kMaster>(params[i].data_ptr<TP>() + b, master,
                                grads[i].const_data_ptr<TG>() + b,
                                exp_avgs[i].data_ptr<float>() + b,
                                exp_avg_sqs[i].data_ptr<float>() + b, e - b, h, coeffs[i],
                                grad_mult);
  });
}

}  // namespace

void adam(at::TensorList params, at::TensorList master_params, at::TensorList grads,
          at::TensorList exp_avgs, at::TensorList exp_avg_sqs, const float* steps_before,
          const math::AdamHyper& h, float lr, float grad_mult) {
  step_switch(params, grads, master_params, [&](auto param, auto grad, auto has_master) {
    adam_lists<decltype(param), decltype(grad), has_master>(
        params, master_params, grads, exp_avgs, exp_avg_sqs, steps_before, h, lr, grad_mult);
  });
}

}  // namespace fusedamp::cpu::CPU_CAPABILITY
