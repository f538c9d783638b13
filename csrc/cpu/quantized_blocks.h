#pragma once
// The CPU walk of a quantized optimizer state (math/quantized_moments_math.h) that Adam's and
// SGD's kernels share (adam_kernel.cpp, sgd_kernel.cpp). kLists quantized lists per parameter:
// list 0 in exp_avg's format (int8 codes: Adam's exp_avg, SGD's momentum buffer), list 1 in
// exp_avg_sq's (uint8 codes of v^(1/4)); kLists FP32 scales per block of 32 elements.
//
// A chunk is whole blocks (kChunk is a multiple of kMomentBlock), and each block is read,
// updated and rewritten at once: its codes as FP32 values, the algorithm's update over them,
// then the block's new scales (the largest |m| and v^(1/4)) and codes. Per element: read grad,
// weights, kLists B of codes; write weights, kLists B of codes; per block of 32, 4 kLists B of
// scales read and written.
// kBlocks consecutive blocks at once (n = their elements; only a tensor's last block may be
// partial, and it goes alone), kBlocks * kLists = 16 for full groups. Why it is shaped so,
// measured on Adam's moments (a 4 M-element BF16 tensor, then a 16 M-element one):
// - 8 full blocks of Adam in one pass: each block ends in two horizontal reductions and two
//   divisions whose latency a single block cannot hide; 8 independent ones overlap (one block
//   at a time, its moments kept in registers instead of these arrays, took 13 % longer);
// - the running maxima as integer maxima of the bits (LaneOps::max_magnitude): a
//   NaN-propagating maximum in one instruction where torch's maximum() takes three;
// - a group's 16 scales from one reduction tree (largest_lanes_of_16) instead of 16
//   reductions: 10 % less time (the 16 M-element tensor, "split", one thread, AVX-512);
// - the codes widened into float lanes and narrowed back in registers (load_codes,
//   store_nearest_codes), not converted through the value arrays: 3 % less;
// - the codes rounded by the conversion to integers, which also makes a NaN code 0, and no
//   clamp (math::exp_avg_code_unrounded says why none is needed): 8 % less than rounding,
//   clamping and converting (a 1 M-element BF16 tensor, "split", one thread, AVX-512);
// - constant trip counts for full groups (kFull): the pair loops' tail checks fold away, and
//   with the update's hyper-parameters copied into registers, 3 % less;
// - flatten (vector instruction sets): GCC otherwise called the update, the reductions and the
//   code functions out of line, with their vectors passed through memory. Not for DEFAULT,
//   whose Vectorized is loops over arrays: flattened, Adam's translation unit took 127 s to
//   compile (AVX512's 62 s), for the fallback of CPUs without AVX2.
// GCC 12 on the flattened AVX2 groups also reports torch's Vectorized<BFloat16/Half>::loadu
// tail memset as writing 8 GB (-Wstringop-overflow) on a branch it cannot exclude though the
// group's element count is a constant: a false positive, silenced for these functions only.
#include <fusedamp/math/quantized_moments_math.h>

#include <type_traits>

#include "step_loop.h"

namespace fusedamp::cpu::CPU_CAPABILITY {

// A chunk's quantized lists from its first element, and its blocks' scales.
struct QuantizedChunk {
  int8_t* values;    // list 0's codes
  uint8_t* roots;    // list 1's codes (kLists == 2)
  float* scales;     // kLists per block
};

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#define FUSEDAMP_FLATTEN __attribute__((flatten))
#else
#define FUSEDAMP_FLATTEN
#endif
// update(k, p0, p1, g0, g1, x0, x1) with x0[2] the stored values of list 0 (and, kLists == 2,
// x1[2] those of list 1) for the pair's two vectors; it leaves in x0 (x1) the new values whose
// codes are stored: list 0's values, list 1's fourth roots. Lanes past k hold 0, and must be
// left 0 or at least no larger in magnitude than the pair's real lanes (Adam and SGD leave 0).
template <int kLists, typename TP, typename TG, WeightStore kStore, int64_t kBlocks, bool kFull,
          typename Update>
FUSEDAMP_FLATTEN void quantized_blocks(const StepWeights<TP, kStore>& w, TG* g,
                                       const QuantizedChunk& q, int64_t count, float grad_mult,
                                       bool write_grads, const Update& shared_update) {
  // A copy: its captures (the hyper-parameters) then stay in registers, where through the
  // reference every store to x0, x1 and top (floats, which may alias them) reloads them.
  const Update update = shared_update;
  constexpr int64_t B = math::kMomentBlock;
  constexpr int64_t kPairsPerBlock = B / kPair;
  static_assert(kLists == 1 || kLists == 2, "exp_avg's format, and exp_avg_sq's");
  static_assert(B % kPair == 0 && kChunk % (B * kBlocks) == 0,
                "a block is whole pairs, a chunk whole groups");
  static_assert(kFull || kBlocks == 1, "a partial block goes alone");
  const int64_t n = kFull ? B * kBlocks : count;
  float* const scales = q.scales;
  const auto scale = [&](int64_t b, int list) {
    return list < kLists ? scales[kLists * b + list] : 0.f;
  };
  alignas(64) float x0[B * kBlocks];  // the new values until their codes are formed
  alignas(64) float x1[kLists == 2 ? B * kBlocks : 1];  // the new fourth roots
  math::QuantizedBlock stored[kBlocks];
  for (int64_t b = 0; b < kBlocks; ++b) {
    stored[b] = math::quantized_block(scale(b, 0), scale(b, 1));
  }
  // Each block's running largest |x0| (and x1) lanes, set by its first pair: as floats, not
  // Vecs, whose constructor zeroes them (a memset of the arrays for every call).
  alignas(64) float top[kBlocks][kLists][Vec::size()];
  using Ops = math::LaneOps<Vec>;
  // The gradient and weights are asked for ahead (step_pairs); the 8-bit codes, a byte an
  // element, are left to the hardware's prefetchers.
  step_pairs(w, g, n, grad_mult, write_grads, [&](int64_t i, int64_t k, Vec& p0, Vec& p1,
                                                  Vec& g0, Vec& g1, auto /*ahead*/) {
    const int64_t b = i / kPair / kPairsPerBlock;
    const bool first = i % B == 0;
    const auto keep_top = [&](int list, const Vec& a, const Vec& c) {
      const Vec pair = Ops::max_magnitude(a, c);
      (first ? pair : Ops::max_magnitude(Vec::loadu(top[b][list]), pair)).store(top[b][list]);
    };
    Vec list0[2], list1[2];  // the pair's values of each list
    load_codes(q.values + i, k, list0[0], list0[1]);  // lanes past k are 0, and stay 0
    list0[0] = math::exp_avg_value(list0[0], stored[b].exp_avg_step);
    list0[1] = math::exp_avg_value(list0[1], stored[b].exp_avg_step);
    if constexpr (kLists == 2) {
      load_codes(q.roots + i, k, list1[0], list1[1]);
      list1[0] = math::exp_avg_sq_value(list1[0], stored[b].exp_avg_sq_step);
      list1[1] = math::exp_avg_sq_value(list1[1], stored[b].exp_avg_sq_step);
    }
    update(k, p0, p1, g0, g1, list0, list1);
    keep_top(0, list0[0], list0[1]);
    PairIO<float>::store(x0 + i, kPair, list0[0], list0[1]);
    if constexpr (kLists == 2) {
      keep_top(1, list1[0], list1[1]);  // v^(1/4) >= 0
      PairIO<float>::store(x1 + i, kPair, list1[0], list1[1]);
    }
  });
  // All the blocks' scales, then their reciprocals: the divisions of one block then overlap
  // the others' instead of each waiting for the previous block's codes.
  math::QuantizingBlock next[kBlocks];
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if constexpr (kBlocks * kLists == 16) {  // the scales, in their order in memory, from one tree
    PatternLanes tops[16];
    for (int64_t b = 0; b < kBlocks; ++b) {
      for (int list = 0; list < kLists; ++list) {
        tops[kLists * b + list] = PatternLanes::loadu(top[b][list]);
      }
    }
    largest_lanes_of_16(tops, scales);
  } else
#endif
  {
    const auto larger = [](const Vec& a, const Vec& c) { return Ops::max_magnitude(a, c); };
    for (int64_t b = 0; b < kBlocks; ++b) {
      for (int list = 0; list < kLists; ++list) {
        scales[kLists * b + list] =
            at::vec::vec_reduce_all<float>(larger, Vec::loadu(top[b][list]));
      }
    }
  }
  // The maxima above let inf and NaN through (one integer maximum per vector), so a scale is
  // not finite only where one of its block's values is not: that block's scale is taken again
  // from its finite values alone (math::block_scale_magnitude, as CUDA takes every scale), off
  // the common path, which pays one compare per scale.
  for (int64_t b = 0; b < kBlocks; ++b) {
    for (int list = 0; list < kLists; ++list) {
      float& s = scales[kLists * b + list];
      if (!(s <= math::kFloatLargest)) {
        const float* x = (list == 0 ? x0 : x1) + b * B;
        s = 0.f;
        for (int64_t l = 0; l < std::min(n - b * B, B); ++l) {
          s = math::LaneOps<float>::max(s, math::block_scale_magnitude(x[l]));
        }
      }
    }
    next[b] = math::quantizing_block(scale(b, 0), scale(b, 1));
  }
  for (int64_t b = 0; b < kBlocks; ++b) {
    for (int64_t i = b * B; i < std::min(n, (b + 1) * B); i += kPair) {
      const int64_t k = kFull ? kPair : n - i;  // full groups: no tail checks
      const Vec a0 = Vec::loadu(x0 + i), a1 = Vec::loadu(x0 + i + Vec::size());
      store_nearest_codes(q.values + i, k, math::exp_avg_code_unrounded(a0, next[b]),
                          math::exp_avg_code_unrounded(a1, next[b]));
      if constexpr (kLists == 2) {
        const Vec r0 = Vec::loadu(x1 + i), r1 = Vec::loadu(x1 + i + Vec::size());
        store_nearest_codes(q.roots + i, k, math::exp_avg_sq_code_unrounded(r0, next[b]),
                            math::exp_avg_sq_code_unrounded(r1, next[b]));
      }
    }
  }
}
#undef FUSEDAMP_FLATTEN
#pragma GCC diagnostic pop

// Every chunk of the step in groups of blocks (the full groups, full single blocks, then a
// tensor's partial last block): update_for(i) gives position i's update (quantized_blocks).
template <int kLists, typename TP, typename TG, WeightStore kStore, typename UpdateFor>
void quantized_lists(const CpuStep& step, const UpdateFor& update_for) {
  constexpr int64_t B = math::kMomentBlock;
  constexpr int64_t kGroup = 16 / kLists;  // blocks: 16 scales, one reduction tree
  for_each_step_chunk(step, [&](int64_t i, const StepRow& row, int64_t b, int64_t e) {
    const auto update = update_for(i);
    for (int64_t start = b; start < e;) {
      const QuantizedChunk q{static_cast<int8_t*>(row.state[0]) + start,
                             kLists == 2 ? static_cast<uint8_t*>(row.state[1]) + start : nullptr,
                             static_cast<float*>(row.state[kLists]) + kLists * (start / B)};
      const auto blocks = [&](auto group, auto full) {
        quantized_blocks<kLists, TP, TG, kStore, decltype(group)::value, decltype(full)::value>(
            step_weights<TP, kStore>(step, i, start), static_cast<TG*>(row.grad) + start, q,
            e - start, step.grad_mult, step.write_back_grads, update);
      };
      using One = std::integral_constant<int64_t, 1>;
      if (e - start >= B * kGroup) {
        blocks(std::integral_constant<int64_t, kGroup>{}, std::true_type{});
        start += B * kGroup;
      } else if (e - start >= B) {
        blocks(One{}, std::true_type{});
        start += B;
      } else {
        blocks(One{}, std::false_type{});
        start = e;
      }
    }
  });
}

}  // namespace fusedamp::cpu::CPU_CAPABILITY
