#pragma once
// The loops every CPU step kernel shares (adam_kernel.cpp, sgd_kernel.cpp): over a step's
// chunks, and over a chunk two vectors at a time, so that an algorithm writes only its update.
#include "chunked_for_each.h"
#include "cpu_kernels.h"
#include "step_weights.h"

#include <type_traits>

namespace fusedamp::cpu::CPU_CAPABILITY {

// body(i, row, begin, end) for every chunk [begin, end) of every row i of the step (all
// threads), with the elements of the row a few rows ahead asked for at each row's first chunk.
template <typename Body>
void for_each_step_chunk(const CpuStep& step, const Body& body) {
  const ChunkPlan plan(step.params.size(), [&](size_t i) { return step.rows[i].numel; });
  for_each_chunk(plan, [&](int64_t, int64_t i, int64_t b, int64_t e) {
    prefetch_elements_ahead(step, i, b);
    body(i, step.rows[i], b, e);
  });
}

// A chunk of n elements, two vectors at a time: the gradient (times grad_mult) and the weights
// loaded, update(i, k, p0, p1, g0, g1, ahead) applied (k: the elements left from i, at most
// kPair counted), then the weights stored as their store keeps them and, with write_grads, the
// multiplied gradient written back. The whole pairs run with k the constant kPair, so that the
// loads', stores' and update's tail checks fold away, and a partial last pair after them.
// While the chunk holds kPrefetchAhead more elements, the gradient's and the weights' memory
// that far ahead is asked for, and `ahead` (std::true_type) tells the update to ask for its
// state's; past that, and in chunks shorter than that, nothing is (it would be another
// tensor's memory: for steps over many small tensors a cost and no gain).
template <typename TG, typename Weights, typename Update>
C10_ALWAYS_INLINE void step_pairs(const Weights& w, TG* g, int64_t n, float grad_mult,
                                  bool write_grads, const Update& update) {
  const Vec mult(grad_mult);
  const auto pair = [&](int64_t i, int64_t k, auto ahead) __attribute__((always_inline)) {
    Vec g0, g1, p0, p1;
    if constexpr (decltype(ahead)::value) {
      prefetch_pair_ahead(g + i);
      w.prefetch_ahead(i);
    }
    PairIO<TG>::load(g + i, k, g0, g1);
    g0 = g0 * mult;
    g1 = g1 * mult;
    w.load(i, k, p0, p1);
    update(i, k, p0, p1, g0, g1, ahead);
    w.store(i, k, p0, p1);
    if (write_grads) {
      PairIO<TG>::store(g + i, k, g0, g1);
    }
  };
  int64_t i = 0;
  for (; i + kPrefetchAhead + kPair <= n; i += kPair) {
    pair(i, kPair, std::true_type{});
  }
  for (; i + kPair <= n; i += kPair) {
    pair(i, kPair, std::false_type{});
  }
  if (i < n) {
    pair(i, n - i, std::false_type{});
  }
}

// A step over its state format: 8-bit codes with block scales (state_dtype int8) to
// Lists::quantized<TP, TG, kStore>(step, h), FP32 or BF16 lists (state_dtype, all alike) with
// the algorithm's flag (AMSGrad, momentum) as a compile-time value to
// Lists::dense<TP, TG, kStore, kFlag, TS>(step, h).
template <typename Lists, typename Hyper>
void step_lists_by_format(const CpuStep& step, at::ScalarType state_dtype, bool flag,
                          const Hyper& h) {
  if (state_dtype == at::kChar) {
    step_switch(step, [&](auto param, auto grad, auto store) {
      Lists::template quantized<decltype(param), decltype(grad), store>(step, h);
    });
    return;
  }
  step_switch(step, [&](auto param, auto grad, auto store, auto with_flag, auto state) {
    Lists::template dense<decltype(param), decltype(grad), store, with_flag, decltype(state)>(
        step, h);
  }, BoolSwitch{flag}, DtypeSwitch<float, c10::BFloat16>{state_dtype});
}

}  // namespace fusedamp::cpu::CPU_CAPABILITY
