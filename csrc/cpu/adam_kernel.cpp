// CPU: fused Adam/AdamW step. Per element: read grad, param (or FP32 master), m, v; write
// param (and master), m, v. The formula is fusedamp::math::adam_update, shared with CUDA.
// Compiled once per instruction set; see cpu_kernels.h.
#include "../ops/static_switch.h"
#include <fusedamp/math/adam_math.h>
#include <fusedamp/math/quantized_moments_math.h>

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

// Quantized moments (math/quantized_moments_math.h): a chunk is whole blocks (kChunk is a
// multiple of kMomentBlock), and each block is read, updated and rewritten at once: its codes
// as FP32 moments, adam_update over them, then the block's new scales (the largest |m| and
// v^(1/4)) and codes. Per element: read grad, weights, 2 B of codes; write weights, 2 B of
// codes; per block of 32, 8 B of scales read and written.
// kBlocks consecutive blocks at once (n = their elements; only a tensor's last block may be
// partial, and it goes alone). Why it is shaped so, measured on a 4 M-element BF16 tensor:
// - kBlocks = 8 full blocks in one pass: each block ends in two horizontal reductions and two
//   divisions whose latency a single block cannot hide; 8 independent ones overlap (one block
//   at a time, its moments kept in registers instead of these arrays, took 13 % longer);
// - the running maxima as integer maxima of the bits (LaneOps::max_magnitude) and the codes'
//   clamp without NaN propagation: 15 % less time than torch's NaN-propagating maximum and
//   minimum, with the same results;
// - the 8 blocks' 16 scales from one reduction tree (largest_lanes_of_16) instead of 16
//   reductions: 10 % less time (one 16 M-element BF16 tensor, "split", one thread, AVX-512);
// - the codes widened into float lanes and narrowed back in registers (load_codes,
//   store_codes), not converted through the moment arrays: 3 % less;
// - constant trip counts for full groups (kFull): the pair loops' tail checks fold away;
// - flatten (vector instruction sets): GCC otherwise called adam_update, the reductions and the
//   code functions out of line, with their vectors passed through memory. Not for DEFAULT,
//   whose Vectorized is loops over arrays: flattened, its translation unit took 127 s to
//   compile (AVX512's 62 s), for the fallback of CPUs without AVX2.
// GCC 12 on the flattened AVX2 groups also reports torch's Vectorized<BFloat16/Half>::loadu
// tail memset as writing 8 GB (-Wstringop-overflow) on a branch it cannot exclude though the
// group's element count is a constant: a false positive, silenced for these functions only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#define FUSEDAMP_FLATTEN __attribute__((flatten))
#else
#define FUSEDAMP_FLATTEN
#endif
template <typename TP, typename TG, WeightStore kStore, int64_t kBlocks, bool kFull>
FUSEDAMP_FLATTEN void adam_quantized_blocks(
    const StepWeights<TP, kStore>& w, TG* g, int8_t* m_codes, uint8_t* v_codes, float* scales,
    int64_t count, const math::AdamHyper& h, const math::AdamCoeffs& c, float grad_mult,
    bool write_grads) {
  constexpr int64_t B = math::kMomentBlock;
  constexpr int64_t kPairsPerBlock = B / kPair;
  static_assert(B % kPair == 0 && kChunk % (B * kBlocks) == 0,
                "a block is whole pairs, a chunk whole groups");
  static_assert(kFull || kBlocks == 1, "a partial block goes alone");
  const int64_t n = kFull ? B * kBlocks : count;
  alignas(64) float m[B * kBlocks];
  alignas(64) float v[B * kBlocks];  // the new moments until their codes are formed; v: v^(1/4)
  math::QuantizedBlock stored[kBlocks];
  for (int64_t b = 0; b < kBlocks; ++b) {
    stored[b] = math::quantized_block(scales[2 * b], scales[2 * b + 1]);
  }
  // Each block's running largest |m| and v^(1/4) lanes, set by its first pair: as floats, not
  // Vecs, whose constructor zeroes them (a memset of the arrays for every call).
  alignas(64) float m_top[kBlocks][Vec::size()];
  alignas(64) float v_top[kBlocks][Vec::size()];
  step_pairs(w, g, n, grad_mult, write_grads, [&](int64_t i, int64_t k, Vec& p0, Vec& p1,
                                                  Vec& g0, Vec& g1) {
    const int64_t b = i / kPair / kPairsPerBlock;
    Vec m0, m1, v0, v1;
    load_codes(m_codes + i, k, m0, m1);  // lanes past k are 0, and stay 0 in the update
    load_codes(v_codes + i, k, v0, v1);
    Vec r0(0.f), r1(0.f);  // sqrt(v), then v^(1/4)
    m0 = math::exp_avg_value(m0, stored[b].exp_avg_step);
    v0 = math::exp_avg_sq_value(v0, stored[b].exp_avg_sq_step);
    math::adam_update(p0, m0, v0, g0, h, c, static_cast<Vec*>(nullptr), &r0);
    if (k > Vec::size()) {
      m1 = math::exp_avg_value(m1, stored[b].exp_avg_step);
      v1 = math::exp_avg_sq_value(v1, stored[b].exp_avg_sq_step);
      math::adam_update(p1, m1, v1, g1, h, c, static_cast<Vec*>(nullptr), &r1);
    }
    v0 = math::exp_avg_sq_root_of_sqrt(r0);
    v1 = math::exp_avg_sq_root_of_sqrt(r1);
    using Ops = math::LaneOps<Vec>;
    const Vec m_pair = Ops::max_magnitude(m0, m1);
    const Vec v_pair = Ops::max_magnitude(v0, v1);  // v^(1/4) >= 0
    const bool first = i % B == 0;
    (first ? m_pair : Ops::max_magnitude(Vec::loadu(m_top[b]), m_pair)).store(m_top[b]);
    (first ? v_pair : Ops::max_magnitude(Vec::loadu(v_top[b]), v_pair)).store(v_top[b]);
    PairIO<float>::store(m + i, kPair, m0, m1);
    PairIO<float>::store(v + i, kPair, v0, v1);
  });
  const auto larger = [](const Vec& a, const Vec& b) {
    return math::LaneOps<Vec>::max_magnitude(a, b);
  };
  // All the blocks' scales, then their reciprocals: the divisions of one block then overlap
  // the others' instead of each waiting for the previous block's codes.
  math::QuantizingBlock next[kBlocks];
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if constexpr (kBlocks == 8) {  // the 16 scales, in their order in memory, from one tree
    PatternLanes tops[16];
    for (int64_t b = 0; b < kBlocks; ++b) {
      tops[2 * b] = PatternLanes::loadu(m_top[b]);
      tops[2 * b + 1] = PatternLanes::loadu(v_top[b]);
    }
    largest_lanes_of_16(tops, scales);
  } else
#endif
  {
    for (int64_t b = 0; b < kBlocks; ++b) {
      scales[2 * b] = at::vec::vec_reduce_all<float>(larger, Vec::loadu(m_top[b]));
      scales[2 * b + 1] = at::vec::vec_reduce_all<float>(larger, Vec::loadu(v_top[b]));
    }
  }
  for (int64_t b = 0; b < kBlocks; ++b) {
    next[b] = math::quantizing_block(scales[2 * b], scales[2 * b + 1]);
  }
  for (int64_t b = 0; b < kBlocks; ++b) {
    for (int64_t i = b * B; i < std::min(n, (b + 1) * B); i += kPair) {
      const Vec m0 = Vec::loadu(m + i), m1 = Vec::loadu(m + i + Vec::size());
      const Vec v0 = Vec::loadu(v + i), v1 = Vec::loadu(v + i + Vec::size());
      store_codes(m_codes + i, n - i, math::exp_avg_code(m0, next[b]),
                  math::exp_avg_code(m1, next[b]));
      store_codes(v_codes + i, n - i, math::exp_avg_sq_code(v0, next[b]),
                  math::exp_avg_sq_code(v1, next[b]));
    }
  }
}

#undef FUSEDAMP_FLATTEN
#pragma GCC diagnostic pop

template <typename TP, typename TG, WeightStore kStore>
void adam_quantized_lists(const CpuStep& step, const math::AdamHyper& h) {
  constexpr int64_t B = math::kMomentBlock;
  constexpr int64_t kGroup = 8;  // blocks
  ScratchVector<math::AdamCoeffs> coeffs(step.params.size());
  fill_tensor_coeffs(step, h, coeffs);
  for_each_step_chunk(step, [&](int64_t i, const StepRow& row, int64_t b, int64_t e) {
    for (int64_t start = b; start < e;) {
      const auto blocks = [&](auto group, auto full) {
        adam_quantized_blocks<TP, TG, kStore, decltype(group)::value, decltype(full)::value>(
            step_weights<TP, kStore>(step, i, start), static_cast<TG*>(row.grad) + start,
            static_cast<int8_t*>(row.state[0]) + start,
            static_cast<uint8_t*>(row.state[1]) + start,
            static_cast<float*>(row.state[2]) + 2 * (start / B), e - start, h, coeffs[i],
            step.grad_mult, step.write_back_grads);
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

}  // namespace

void adam(const CpuStep& step, at::ScalarType state_dtype, bool amsgrad,
          const math::AdamHyper& h) {
  if (state_dtype == at::kChar) {  // quantized moments (no AMSGrad: the checks refuse it)
    step_switch(step, [&](auto param, auto grad, auto store) {
      adam_quantized_lists<decltype(param), decltype(grad), store>(step, h);
    });
    return;
  }
  // The moments are FP32 or BF16 (state_dtype), all lists alike.
  step_switch(step, [&](auto param, auto grad, auto store, auto with_amsgrad, auto state) {
    adam_lists<decltype(param), decltype(grad), store, with_amsgrad, decltype(state)>(step, h);
  }, BoolSwitch{amsgrad}, DtypeSwitch<float, c10::BFloat16>{state_dtype});
}

}  // namespace fusedamp::cpu::CPU_CAPABILITY
