// CPU: unscale_and_check_ (read 1, write 1 element) and grad_stats_ (read 1), vectorised;
// unscale_and_check_ with statistics is grad_stats_'s pass writing the unscaled values back.
// Compiled once per instruction set; see cpu_kernels.h.
#include "../ops/dispatch_float_types.h"
#include "../ops/static_switch.h"
#include <fusedamp/math/telemetry_math.h>
#include <fusedamp/math/unscale_math.h>

#include "chunked_for_each.h"
#include "cpu_kernels.h"
#include "half_patterns.h"
#include "lane_reduce.h"
#include "vec_io.h"

namespace fusedamp::cpu::CPU_CAPABILITY {
namespace {

// One chunk's telemetry, reduced from its lanes (counts exact: < 2^24 per lane).
struct ChunkTelemetry {
  float amax = 0.f;
  float n_small = 0.f;
  float n_zero = 0.f;
};

// A plain unscale: read, check, multiply, write; nothing else accumulated.
template <typename T>
bool unscale_range(T* p, int64_t n, float inv_scale) {
  const Vec s(inv_scale);
  Vec bad(0.f);
  for (int64_t i = 0; i < n; i += kPair) {
    Vec a, b;
    PairIO<T>::load(p + i, n - i, a, b);
    bad = math::accumulate_nonfinite(math::accumulate_nonfinite(bad, a), b);
    PairIO<T>::store(p + i, n - i, math::unscale(a, s), math::unscale(b, s));
  }
  // Under one vector's worth of elements, the lanes from n on held padding (zeros).
  return has_nan(bad, std::min<int64_t>(n, Vec::size()));
}

// The statistics pass over one chunk: check, sum of squares and (kTelemetry) telemetry of the
// values as read; with kUnscale they are then unscaled and written back in the same pass.
// The tail load pads with zeros: those lanes must not count as zero elements.
// A chunk of at most one vector (all of a tensor under 17 elements): the pair's second vector
// and the first's lanes from n on are padding, so only the first n lanes are accumulated and
// reduced. Bit for bit stats_range's result: its padding lanes add +0 to the sums (in lane
// order, after the live ones), never raise the max, and are subtracted from the counts.
template <typename T, bool kUnscale, bool kTelemetry>
bool stats_one_vector(T* p, int64_t n, float inv_scale, float* sum_sq,
                      ChunkTelemetry* telemetry) {
  Vec a, padding;
  PairIO<T>::load(p, n, a, padding);
  const Vec bad = math::accumulate_nonfinite(Vec(0.f), a);
  *sum_sq = lane_sum(math::accumulate_square(Vec(0.f), a), n);
  if constexpr (kTelemetry) {
    auto tele = math::telemetry_zero<Vec>();
    math::accumulate_telemetry(tele, a, Vec(math::smallest_normal<T>()));
    telemetry->amax = lane_max(tele.amax, n);
    telemetry->n_small = lane_sum(tele.n_small, n);
    telemetry->n_zero = lane_sum(tele.n_zero, n);
  }
  if constexpr (kUnscale) {
    PairIO<T>::store(p, n, math::unscale(a, Vec(inv_scale)), padding);
  }
  return has_nan(bad, n);
}

// A chunk of FP32 (or FP64) gradients; see stats_one_vector.
template <typename T, bool kUnscale, bool kTelemetry>
bool stats_range(T* p, int64_t n, float inv_scale, float* sum_sq, ChunkTelemetry* telemetry) {
  if (n <= Vec::size()) {
    return stats_one_vector<T, kUnscale, kTelemetry>(p, n, inv_scale, sum_sq, telemetry);
  }
  const Vec s(inv_scale);
  // The pair's halves accumulate apart: two dependency chains per accumulator instead of one
  // twice as long. Combined below (exact: a NaN stays a NaN, counts are integers, the maximum
  // is a maximum). The squares go to their lanes of the sum (SquareSums).
  Vec bad0(0.f), bad1(0.f);
  SquareSums sq;
  auto tele = math::telemetry_zero<Vec>();
  auto tele1 = math::telemetry_zero<Vec>();
  const Vec smallest_normal(math::smallest_normal<T>());
  for_each_pair_in_groups(n, [&](int64_t i, int64_t k, auto j) __attribute__((always_inline)) {
    Vec a, b;
    PairIO<T>::load(p + i, k, a, b);
    bad0 = math::accumulate_nonfinite(bad0, a);
    bad1 = math::accumulate_nonfinite(bad1, b);
    sq.add(j, a, b);
    if constexpr (kTelemetry) {
      math::accumulate_telemetry(tele, a, smallest_normal);
      math::accumulate_telemetry(tele1, b, smallest_normal);
    }
    if constexpr (kUnscale) {
      PairIO<T>::store(p + i, k, math::unscale(a, s), math::unscale(b, s));
    }
  });
  *sum_sq = sq.fold();
  if constexpr (kTelemetry) {
    const float padding = static_cast<float>((kPair - n % kPair) % kPair);
    telemetry->amax =
        lane_max(math::LaneOps<Vec>::max_finite_magnitude(tele.amax, tele1.amax));
    telemetry->n_small = lane_sum(tele.n_small + tele1.n_small) - padding;
    telemetry->n_zero = lane_sum(tele.n_zero + tele1.n_zero) - padding;
  }
  return has_nan(bad0 + bad1);
}

// A chunk of FP16/BF16 gradients: the same results, the check and the telemetry taken from the
// bit patterns (half_patterns.h) and only the sum of squares from the values, summed as above
// (the same lanes, the padded last pair), so the sum has the same bits.
template <typename T, bool kUnscale, bool kTelemetry>
bool stats_range_16(T* p, int64_t n, float inv_scale, float* sum_sq, ChunkTelemetry* telemetry) {
  if (n <= Vec::size()) {
    return stats_one_vector<T, kUnscale, kTelemetry>(p, n, inv_scale, sum_sq, telemetry);
  }
  const Vec s(inv_scale);
  SquareSums sq;
  HalfPatternLanes<T, kTelemetry, kUnscale && kTelemetry> lanes;
  for_each_pair_in_groups(n, [&](int64_t i, int64_t k, auto j) __attribute__((always_inline)) {
    Vec a, b;
    PairIO<T>::load(p + i, k, a, b);
    lanes.add(p + i, k);
    sq.add(j, a, b);
    if constexpr (kUnscale) {  // after the patterns were read
      PairIO<T>::store(p + i, k, math::unscale(a, s), math::unscale(b, s));
    }
  });
  *sum_sq = sq.fold();
  const bool bad = lanes.nonfinite();
  if constexpr (kTelemetry) {
    const int64_t padding = (kPair - n % kPair) % kPair;
    using Patterns = math::HalfPatterns<T>;
    if constexpr (kUnscale) {
      telemetry->amax = Patterns::value(lanes.largest(lanes.finite_top));
    } else {
      // Where nothing was inf or NaN, the largest pattern is the largest finite one.
      telemetry->amax = bad ? largest_finite_value(p, n) : Patterns::value(lanes.largest(lanes.top));
    }
    telemetry->n_small = static_cast<float>(lanes.sum(lanes.n_small) - padding);
    telemetry->n_zero = static_cast<float>(lanes.sum(lanes.n_zero) - padding);
  }
  return bad;
}

// f(chunk, i, grads[i], begin, end) over every chunk of the grads (all threads), with the
// metadata and the first elements of the grads a few positions ahead asked for at each
// grad's first chunk.
template <typename F>
void for_each_grad_chunk(at::TensorList grads, const ChunkPlan& plan, const F& f) {
  for_each_chunk(plan, [&](int64_t c, int64_t i, int64_t begin, int64_t end) {
    if (begin == 0) {
      prefetch_ahead(static_cast<size_t>(i), {grads});
      prefetch_data_ahead(static_cast<size_t>(i), grads);
    }
    f(c, i, grads[i], begin, end);
  });
}

// The statistics of every chunk of `plan`'s gradients (unscaling them too when inv_scale is
// given): for_each(chunk) calls chunk(c, i, dtype, elements, n) for every chunk c (of gradient
// i, its n elements from `elements` on) on all threads; then the chunks' results combined.
template <typename ForEach>
bool stats_chunks(const ChunkPlan& plan, size_t count, const float* inv_scale, double* sum_sq,
                  std::vector<char>* flags, GradTelemetry* telemetry, const ForEach& for_each) {
  ScratchVector<char> chunk_bad(plan.total, 0);
  ScratchVector<float> chunk_sq(plan.total, 0.f);
  ScratchVector<ChunkTelemetry> chunk_tele(telemetry != nullptr ? plan.total : 0);
  const float inv = inv_scale != nullptr ? *inv_scale : 1.f;
  for_each([&](int64_t c, int64_t /*i*/, at::ScalarType dtype, void* elements, int64_t n) {
    FUSEDAMP_DISPATCH_FLOAT_TYPES(dtype, "grad_stats", [&] {
      auto* p = static_cast<scalar_t*>(elements);
      ChunkTelemetry* tele = telemetry != nullptr ? &chunk_tele[c] : nullptr;
      static_switch(
          [&](auto unscale, auto with_telemetry) {
            constexpr bool kUnscale = decltype(unscale)::value;
            constexpr bool kTelemetry = decltype(with_telemetry)::value;
            if constexpr (sizeof(scalar_t) == 2) {
              chunk_bad[c] =
                  stats_range_16<scalar_t, kUnscale, kTelemetry>(p, n, inv, &chunk_sq[c], tele);
            } else {
              chunk_bad[c] =
                  stats_range<scalar_t, kUnscale, kTelemetry>(p, n, inv, &chunk_sq[c], tele);
            }
          },
          BoolSwitch{inv_scale != nullptr}, BoolSwitch{telemetry != nullptr});
    });
  });
  // Combined in chunk order, so the result does not depend on the number of threads.
  double total = 0.0;
  for (float sq : *chunk_sq) {
    total += sq;
  }
  *sum_sq += total;
  bool any = false;
  for (size_t i = 0; i < count; ++i) {
    for (int64_t c = plan.first_chunk[i]; c < plan.first_chunk[i + 1]; ++c) {
      if (chunk_bad[c]) {
        if (telemetry != nullptr && !any) {
          telemetry->first_nonfinite = static_cast<int64_t>(i);
        }
        any = true;
        if (flags != nullptr) {
          (*flags)[i] = 1;
        }
      }
    }
  }
  for (const auto& t : *chunk_tele) {
    telemetry->amax = std::max(telemetry->amax, static_cast<double>(t.amax));
    telemetry->n_subnormal += static_cast<double>(t.n_small - t.n_zero);
    telemetry->n_zero += static_cast<double>(t.n_zero);
  }
  return any;
}

// grad_stats over `grads`, unscaling them too when inv_scale is given (see cpu_kernels.h).
bool stats_pass(at::TensorList grads, const float* inv_scale, double* sum_sq,
                std::vector<char>* flags, GradTelemetry* telemetry) {
  const ChunkPlan plan(grads);
  return stats_chunks(plan, grads.size(), inv_scale, sum_sq, flags, telemetry,
                      [&](const auto& chunk) {
    for_each_grad_chunk(grads, plan, [&](int64_t c, int64_t i, const at::Tensor& g,
                                         int64_t begin, int64_t end) {
      FUSEDAMP_DISPATCH_FLOAT_TYPES(g.scalar_type(), "grad_stats", [&] {
        // Read-only unless unscaling: grad_stats_ may be given tensors it must not write (the
        // const accessor), while unscaling writes them (the mutable one, which gives
        // copy-on-write memory its own copy first). TensorImpl's inline accessors: the Tensor
        // ones are calls into torch, one per tensor.
        const c10::TensorImpl& impl = *g.unsafeGetTensorImpl();
        scalar_t* p = inv_scale != nullptr
                          ? elements_of<scalar_t>(g)
                          : const_cast<scalar_t*>(impl.data_dtype_initialized<scalar_t>());
        chunk(c, i, g.scalar_type(), p + begin, end - begin);
      });
    });
  });
}

}  // namespace

bool unscale_and_check(at::TensorList grads, float inv_scale, double* sum_sq,
                       GradTelemetry* telemetry) {
  if (sum_sq != nullptr) {
    return stats_pass(grads, &inv_scale, sum_sq, nullptr, telemetry);
  }
  const ChunkPlan plan(grads);
  ScratchVector<char> chunk_bad(plan.total, 0);
  for_each_grad_chunk(grads, plan, [&](int64_t c, int64_t i, const at::Tensor& g,
                                       int64_t begin, int64_t end) {
    FUSEDAMP_DISPATCH_FLOAT_TYPES(g.scalar_type(), "unscale", [&] {
      chunk_bad[c] = unscale_range(elements_of<scalar_t>(g) + begin, end - begin, inv_scale);
    });
  });
  return std::any_of((*chunk_bad).begin(), (*chunk_bad).end(), [](char b) { return b != 0; });
}

bool grad_stats(at::TensorList grads, double* sum_sq, std::vector<char>* flags,
                GradTelemetry* telemetry) {
  return stats_pass(grads, nullptr, sum_sq, flags, telemetry);
}

bool grad_stats_spans(const GradSpan* grads, size_t count, double* sum_sq,
                      GradTelemetry* telemetry) {
  const ChunkPlan plan(count, [&](size_t i) { return grads[i].numel; });
  return stats_chunks(plan, count, nullptr, sum_sq, nullptr, telemetry, [&](const auto& chunk) {
    for_each_chunk(plan, [&](int64_t c, int64_t i, int64_t begin, int64_t end) {
      const GradSpan& g = grads[i];
      if (begin == 0 && static_cast<size_t>(i) + kDataAhead < count) {
        __builtin_prefetch(grads[i + kDataAhead].data);
      }
      const int64_t item = static_cast<int64_t>(c10::elementSize(g.dtype));
      chunk(c, i, g.dtype, const_cast<char*>(static_cast<const char*>(g.data)) + begin * item,
            end - begin);
    });
  });
}

}  // namespace fusedamp::cpu::CPU_CAPABILITY
