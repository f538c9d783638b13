// CPU: the fused step of every algorithm whose kernels are generic (fusedamp/ops.h
// FUSEDAMP_STEP_ALGORITHMS): its descriptor's element update (math/<algorithm>_math.h,
// shared with cuda/step_kernel.cu) over the step's lists, two vectors at a time. Per element:
// read grad, the weights and the algorithm's kStateLists state lists (FP32 or BF16); write the
// weights and the state lists. Compiled once per instruction set; see cpu_kernels.h.
#include "../ops/static_switch.h"

#include "step_loop.h"

namespace fusedamp::cpu::CPU_CAPABILITY {
namespace {

template <typename Algorithm>
struct GenericStep {
  static constexpr int kLists = Algorithm::kStateLists;
  static constexpr int kArray = kLists > 0 ? kLists : 1;
  using Hyper = typename Algorithm::Hyper;

  template <typename TP, typename TG, WeightStore kStore, typename TS>
  static void dense(const CpuStep& step, const Hyper& hyper) {
    for_each_step_chunk(step, [&](int64_t i, const StepRow& row, int64_t b, int64_t e) {
      // Copies: in registers, not reloaded after every vector store (which may alias them).
      const Hyper h = hyper;
      const auto c = Algorithm::template coeffs<double>(h, step.lr, step.steps_before[i]);
      TS* state[kArray] = {};
      for (int k = 0; k < kLists; ++k) {
        state[k] = static_cast<TS*>(row.state[k]) + b;
      }
      step_pairs(step_weights<TP, kStore>(step, i, b), static_cast<TG*>(row.grad) + b, e - b,
                 step.grad_mult, step.write_back_grads,
                 [&](int64_t j, int64_t n, Vec& p0, Vec& p1, Vec& g0, Vec& g1, auto ahead) {
                   Vec s0[kArray], s1[kArray];
                   for (int k = 0; k < kLists; ++k) {
                     if constexpr (decltype(ahead)::value) {
                       prefetch_pair_ahead(state[k] + j);
                     }
                     PairIO<TS>::load(state[k] + j, n, s0[k], s1[k]);
                   }
                   Algorithm::update(p0, s0, g0, h, c);
                   Algorithm::update(p1, s1, g1, h, c);
                   for (int k = 0; k < kLists; ++k) {
                     PairIO<TS>::store(state[k] + j, n, s0[k], s1[k]);
                   }
                 });
    });
  }

  // The state lists are all of state_dtype, FP32 or BF16 (the checks refuse 8-bit codes for
  // an algorithm without block scales).
  static void run(const CpuStep& step, at::ScalarType state_dtype, const Hyper& h) {
    step_switch(
        step,
        [&](auto param, auto grad, auto store, auto state) {
          dense<decltype(param), decltype(grad), store, decltype(state)>(step, h);
        },
        DtypeSwitch<float, c10::BFloat16>{state_dtype});
  }
};

}  // namespace

// step<Algorithm> for each algorithm of the list with generic kernels.
#define FUSEDAMP_GENERIC_CPU_STEP_own(Algorithm)
#define FUSEDAMP_GENERIC_CPU_STEP_generic(Algorithm)                                         \
  template <>                                                                                \
  void step<math::Algorithm>(const CpuStep& s, at::ScalarType state_dtype, size_t,           \
                             const math::Algorithm::Hyper& h) {                              \
    GenericStep<math::Algorithm>::run(s, state_dtype, h);                                    \
  }
#define FUSEDAMP_GENERIC_CPU_STEP(Algorithm, Op, op, kernels) \
  FUSEDAMP_GENERIC_CPU_STEP_##kernels(Algorithm)
FUSEDAMP_STEP_ALGORITHMS(FUSEDAMP_GENERIC_CPU_STEP)
#undef FUSEDAMP_GENERIC_CPU_STEP
#undef FUSEDAMP_GENERIC_CPU_STEP_generic
#undef FUSEDAMP_GENERIC_CPU_STEP_own

}  // namespace fusedamp::cpu::CPU_CAPABILITY
