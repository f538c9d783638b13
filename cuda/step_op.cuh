#pragma once
// The one scaffold of the dense step kernels (adam_kernel.cu, sgd_kernel.cu, step_kernel.cu):
// what a thread block does around an algorithm's element update — return at once on a skipped
// step, find the chunk, read and write the weights (StepWeights) and the multiplied grads
// (StepGrads), and walk the chunk (chunk_loop). An algorithm brings a rule: a StepRule (its
// hyper-parameters, list positions, state element type and launch shape) with its state
// registers and lists, and its update:
//   template <int L> struct State;                              its registers for L lanes
//   static Start begin(const StepBatch<Pos>&, const Hyper&, const StepScalarPointers&);
//       what the block starts from: a StepBlock's members and what the rule reads once for the
//       block (learning rate, coefficients); called by every thread (it may hold a barrier)
//   static Rule at(const StepBatch<Pos>&, const Start&, const Hyper&);
//       the rule at this block's chunk
//   template <int L> void load(int i, State<L>&) const;        its state lists' elements
//   template <int L> void update(int l, float& p, float g, State<L>&) const;   lane l
//   template <int L> void store(int i, const State<L>&) const;
#include <c10/util/BFloat16.h>

#include "../csrc/ops/static_switch.h"
#include "../csrc/ops/step_lists.h"
#include "cuda_kernels.h"
#include "multi_tensor_apply.cuh"
#include "step_weights.cuh"

namespace fusedamp::cuda {

// What a step kernel's thread block starts from: its chunk, the tensor's step count before
// this step's increment, and the gradient multiplier (inverse loss scale times clip
// coefficient).
struct StepBlock {
  ChunkRef ch;
  float step_before;
  float mult;
};

// What a rule declares of itself, as the base of the rule: its hyper-parameters, its list
// positions (StepPositions), the element type of its state lists, the elements in flight per
// thread (chunk_loop's kElems), and whether ptxas is asked for 2 blocks per SM (up to 128
// registers) rather than 1.
template <typename HyperT, typename PosT, typename TS, int kElemsV = kElemsPerThread,
          bool kTwoBlocksV = false>
struct StepRule {
  using Hyper = HyperT;
  using Pos = PosT;
  using StateElem = TS;
  static constexpr int kElems = kElemsV;
  static constexpr bool kTwoBlocks = kTwoBlocksV;
};

// The per-thread op of chunk_loop: the weights and grads around the rule's state. Loads go
// grads, weights, state; stores state, then weights.
template <typename TP, typename TG, WeightStore kStore, typename Rule>
struct StepOp {
  StepWeights<TP, kStore> weights;
  StepGrads<TG> grads;
  Rule rule;
  float mult;

  template <int L>
  struct Regs {
    float p[L], g[L];
    typename Rule::template State<L> s;
  };
  template <int L>
  __device__ __forceinline__ void load(int i, Regs<L>& r) const {
    grads.load(i, r.g);
    weights.load(i, r.p);
    rule.template load<L>(i, r.s);
  }
  template <int L>
  __device__ __forceinline__ void apply(int i, Regs<L>& r) const {
    grads.multiply_and_write_back(i, r.g, mult);
#pragma unroll
    for (int l = 0; l < L; ++l) {
      rule.template update<L>(l, r.p[l], r.g[l], r.s);
    }
  }
  template <int L>
  __device__ __forceinline__ void store(int i, const Regs<L>& r) const {
    rule.template store<L>(i, r.s);
    weights.store(i, r.p);
  }
};

// A dense step kernel's body over its batch (positions Rule::Pos).
template <typename Rule, typename TP, typename TG>
__device__ __forceinline__ void step_body(const StepBatch<typename Rule::Pos>& b,
                                          const typename Rule::Hyper& h,
                                          const StepScalarPointers& s, bool write_back_grads) {
  using Pos = typename Rule::Pos;
  if (s.skipped()) {
    return;  // skipped step: nothing is read or written
  }
  const typename Rule::Start start = Rule::begin(b, h, s);
  const ChunkRef& ch = start.ch;
  StepOp<TP, TG, Pos::kWeights, Rule> op{
      step_weights_at<TP, Pos::kWeights>(b, ch, Pos::kP, Pos::kStore, start.step_before),
      {list_at<TG>(b, ch, true, Pos::kG), write_back_grads},
      Rule::at(b, start, h),
      start.mult};
  constexpr int W = vec_width_of<TP, TG, typename Rule::StateElem>();
  chunk_loop<W, Rule::kElems>(op, ch.n, ch.aligned);
}

template <typename Rule, typename TP, typename TG>
__global__ void __launch_bounds__(kThreads)
    dense_step_kernel(const __grid_constant__ StepBatch<typename Rule::Pos> b,
                      typename Rule::Hyper h, StepScalarPointers s, bool write_back_grads) {
  step_body<Rule, TP, TG>(b, h, s, write_back_grads);
}

template <typename Rule, typename TP, typename TG>
__global__ void __launch_bounds__(kThreads, 2)
    dense_step_kernel_two_blocks(const __grid_constant__ StepBatch<typename Rule::Pos> b,
                                 typename Rule::Hyper h, StepScalarPointers s,
                                 bool write_back_grads) {
  step_body<Rule, TP, TG>(b, h, s, write_back_grads);
}

// The rule's kernel over the step's lists (launch_step).
template <typename Rule, typename TP, typename TG>
void launch_dense_step(const Step<typename Rule::Hyper>& step, const StepScalarPointers& s) {
  using Pos = typename Rule::Pos;
  using TS = typename Rule::StateElem;
  // Only the kernel launched is instantiated (the other would be compiled for nothing).
  if constexpr (Rule::kTwoBlocks) {
    launch_step<Pos, TP, TG, TS>(step, s, &dense_step_kernel_two_blocks<Rule, TP, TG>);
  } else {
    launch_step<Pos, TP, TG, TS>(step, s, &dense_step_kernel<Rule, TP, TG>);
  }
}

// The step's dense kernels: Rule<TS, kStore, flags...> for the dtypes of its params, grads and
// state lists (FP32 or BF16) and its weight store, each flag a BoolSwitch. The caller advances
// the step counts.
template <template <typename, WeightStore, bool...> class Rule, typename Hyper,
          typename... Flags>
void dense_step(const Step<Hyper>& step, const StepScalarPointers& s, Flags... flags) {
  const auto state_dtype =
      step.state.count != 0 ? step.state.lists[0][0].scalar_type() : at::kFloat;
  step_switch(
      step.params, step.grads, step.weight_store(),
      [&](auto param, auto grad, auto kept, auto state, auto... flag) {
        launch_dense_step<Rule<decltype(state), decltype(kept)::value, decltype(flag)::value...>,
                          decltype(param), decltype(grad)>(step, s);
      },
      DtypeSwitch<float, c10::BFloat16>{state_dtype}, flags...);
}

// The step of an algorithm with kernels for a quantized state too (quantized_kernel.cu): those
// where the step has block scales, else its dense kernels; then the step counts advance.
template <template <typename, WeightStore, bool...> class Rule, typename Hyper,
          typename... Flags>
void dense_or_quantized_step(const Step<Hyper>& step, const StepScalarPointers& s,
                             void (*quantized)(const Step<Hyper>&, const StepScalarPointers&),
                             Flags... flags) {
  if (!step.block_scales.empty()) {
    quantized(step, s);
  } else {
    dense_step<Rule>(step, s, flags...);
  }
  advance_steps(step.steps, s.found_inf);
}

}  // namespace fusedamp::cuda
