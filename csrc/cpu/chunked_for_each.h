#pragma once
// Parallel traversal of a list of tensors in fixed-size chunks: every (tensor, chunk) pair is
// one work item of one at::parallel_for, so a list of many small tensors and a list of a few
// huge ones both spread over all threads. Chunk boundaries depend only on the sizes, never on
// the thread count, which keeps reductions deterministic.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <algorithm>
#include <vector>

#include "../ops/scratch_vector.h"

namespace fusedamp::cpu {

constexpr int64_t kChunk = 16384;  // elements; multiple of every vector width

struct ChunkPlan {
  ScratchVector<int64_t> first_chunk;  // first_chunk[i]: index of tensor i's first chunk
  ScratchVector<int64_t> numel;        // of tensor i
  int64_t total = 0;

  explicit ChunkPlan(at::TensorList tensors)
      : ChunkPlan(tensors.size(), [&](size_t i) { return tensors[i].numel(); }) {}

  // count tensors of numel_of(i) elements.
  template <typename NumelOf>
  ChunkPlan(size_t count, const NumelOf& numel_of) : first_chunk(count + 1), numel(count) {
    for (size_t i = 0; i < count; ++i) {
      const int64_t n = numel_of(i);
      first_chunk[i] = total;
      numel[i] = n;
      total += (n + kChunk - 1) / kChunk;
    }
    first_chunk[count] = total;
  }
};

// f(chunk_index, tensor_index, begin, end) over element ranges [begin, end) of each tensor.
template <typename F>
void for_each_chunk(const ChunkPlan& plan, const F& f) {
  if (plan.total == 0) {
    return;
  }
  at::parallel_for(0, plan.total, 1, [&](int64_t c0, int64_t c1) {
    // Tensor holding chunk c0: last i with first_chunk[i] <= c0 (skipping empty tensors).
    const std::vector<int64_t>& first_chunk = *plan.first_chunk;
    auto it = std::upper_bound(first_chunk.begin(), first_chunk.end(), c0);
    int64_t i = static_cast<int64_t>(it - first_chunk.begin()) - 1;
    for (int64_t c = c0; c < c1; ++c) {
      while (c >= plan.first_chunk[i + 1]) {
        ++i;
      }
      const int64_t begin = (c - plan.first_chunk[i]) * kChunk;
      const int64_t end = std::min(begin + kChunk, plan.numel[i]);
      f(c, i, begin, end);
    }
  });
}

}  // namespace fusedamp::cpu
