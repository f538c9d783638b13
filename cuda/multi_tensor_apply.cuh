#pragma once
// fusedamp's multi-tensor apply: one kernel launch walks the chunks of many tensors.
//
// Work decomposition. Every tensor is cut into chunks of kChunk elements and every chunk is
// one thread block. A launch's metadata (TensorBatch) travels as the kernel's by-value
// argument: per tensor, the pointers of each walked list, extra per-tensor pointers (a step
// count, a flag slot), the element count, an alignment bit and the index of its first block.
// A block finds its tensor by binary search over those first-block indices, so a huge tensor
// costs no more metadata than a tiny one: only the number of *tensors* per launch is bounded.
//
// Metadata size. CUDA 12.1 raised the kernel-argument limit from 4 KB to 32 KB for sm_70 and
// newer. Every architecture a CUDA 12.1+ toolkit builds for torch here is sm_75+ (CUDA 13
// dropped the rest), so with such a toolkit a launch takes ~8x the tensors of the 4 KB layout
// (e.g. ~500 Adam tensors with master weights instead of ~65): a real model's step is one
// launch per list group, and the many-tiny-tensors case needs few launches. The arguments are
// copied once per launch (and baked into a captured CUDA graph), a few microseconds at most
// next to a step that moves gigabytes. Older toolkits fall back to the 4 KB layout.
//
// Vector access. W elements per vector, chosen by each kernel so that its narrowest list
// moves 16 bytes per access (W = 8 for FP16/BF16, 4 for FP32; wider lists use several 16-byte
// accesses). When every pointer of a tensor is aligned to its access width (decided on the
// host, per tensor), the body runs on vectors, with a scalar tail for the last n % W
// elements; otherwise the whole chunk runs element by element. Either way each thread keeps
// kElems elements (ILP = kElems / W vectors) of every list in flight per iteration: 16 by
// default, 8 for Adam, whose five lists would not fit the registers at 16.
//
// Each kernel's file states its memory traffic per element; the scalars (found_inf, inv_scale,
// lr, sum_sq, a step count) are read once per block.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <type_traits>

namespace fusedamp::cuda {

constexpr int kThreads = 256;          // threads per block, every multi-tensor kernel
constexpr int kChunk = 32768;          // elements per block; a multiple of every W
constexpr int kElemsPerThread = 16;    // default elements in flight per thread and iteration
constexpr int kMaxVecBytes = 16;       // widest global access (LDG/STG.128)

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int kArgBytes = 32000;       // < 32764, the CUDA 12.1+ limit (sm_70+)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#error "fusedamp: kernel arguments > 4 KB need sm_70 or newer; drop older architectures"
#endif
#else
constexpr int kArgBytes = 4000;        // < 4096, the classic limit
#endif

// ---- metadata --------------------------------------------------------------------------

// kLists lists are walked element by element; kExtra lists hold one pointer per tensor that
// the kernel reads or writes as a scalar (e.g. the step count).
template <int kLists, int kExtra>
struct TensorBatch {
  static constexpr int kExtraSlots = kExtra > 0 ? kExtra : 1;
  static constexpr int kHeaderBytes = 64;
  static constexpr int kBytesPerTensor =
      8 * (kLists + kExtraSlots) + 8 /*numel*/ + 4 /*first_block*/ + 1 /*aligned*/;
  static constexpr int kMaxTensors = (kArgBytes - kHeaderBytes) / kBytesPerTensor;

  void* ptr[kLists][kMaxTensors];
  void* extra[kExtraSlots][kMaxTensors];
  int64_t numel[kMaxTensors];
  int64_t block_base;                       // blocks of earlier launches of the same call
  int32_t first_block[kMaxTensors + 1];     // first_block[ntensors] = blocks in this launch
  int32_t ntensors;
  uint8_t aligned[kMaxTensors];
};

// The tensor that block `b` belongs to: last t with first_block[t] <= b. Uniform per block.
template <typename Batch>
__device__ __forceinline__ int find_tensor(const Batch& m, int b) {
  int lo = 0;
  int hi = m.ntensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (m.first_block[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Where this block works: tensor t, element range [offset, offset + n).
struct ChunkRef {
  int t;
  int64_t offset;
  int n;
  bool aligned;
};

template <typename Batch>
__device__ __forceinline__ ChunkRef this_chunk(const Batch& m) {
  ChunkRef c;
  c.t = find_tensor(m, static_cast<int>(blockIdx.x));
  c.offset = static_cast<int64_t>(static_cast<int>(blockIdx.x) - m.first_block[c.t]) * kChunk;
  const int64_t left = m.numel[c.t] - c.offset;
  c.n = static_cast<int>(left < kChunk ? left : kChunk);
  c.aligned = m.aligned[c.t] != 0;
  return c;
}

// ---- vector loads and stores -------------------------------------------------------------

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Elements of T moved per access when W elements are wanted.
template <typename T, int W>
constexpr int access_elems() {
  return W * static_cast<int>(sizeof(T)) < kMaxVecBytes ? W
                                                        : kMaxVecBytes / static_cast<int>(sizeof(T));
}

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  return static_cast<T>(x);
}

// W consecutive elements at p (aligned to the access width when W > 1) as they are, moved in
// accesses of up to kMaxVecBytes: the bit patterns of the 16-bit weight formats
// (math/split_math.h, math/stochastic_rounding_math.h), and the loads under load_lanes.
template <int W, typename T>
__device__ __forceinline__ void load_raw(const T* p, T (&out)[W]) {
  constexpr int A = access_elems<T, W>();
  static_assert(W % A == 0, "W must be a multiple of the access width");
#pragma unroll
  for (int q = 0; q < W / A; ++q) {
    const Pack<T, A> pk = *reinterpret_cast<const Pack<T, A>*>(p + q * A);
#pragma unroll
    for (int l = 0; l < A; ++l) {
      out[q * A + l] = pk.v[l];
    }
  }
}

template <int W, typename T>
__device__ __forceinline__ void store_raw(T* p, const T (&in)[W]) {
  constexpr int A = access_elems<T, W>();
  static_assert(W % A == 0, "W must be a multiple of the access width");
#pragma unroll
  for (int q = 0; q < W / A; ++q) {
    Pack<T, A> pk;
#pragma unroll
    for (int l = 0; l < A; ++l) {
      pk.v[l] = in[q * A + l];
    }
    *reinterpret_cast<Pack<T, A>*>(p + q * A) = pk;
  }
}

// W consecutive elements at p into FP32 lanes, and back (rounded to nearest).
template <int W, typename T>
__device__ __forceinline__ void load_lanes(const T* p, float (&out)[W]) {
  T raw[W];
  load_raw<W>(p, raw);
#pragma unroll
  for (int l = 0; l < W; ++l) {
    out[l] = to_float(raw[l]);
  }
}

template <int W, typename T>
__device__ __forceinline__ void store_lanes(T* p, const float (&in)[W]) {
  T raw[W];
#pragma unroll
  for (int l = 0; l < W; ++l) {
    raw[l] = from_float<T>(in[l]);
  }
  store_raw<W>(p, raw);
}

// W for a kernel whose narrowest list has element type T: 16 bytes of it per vector.
template <typename T>
constexpr int vec_width() {
  return kMaxVecBytes / static_cast<int>(sizeof(T));
}

template <typename... Ts>
constexpr int vec_width_of() {
  int w = 1;
  ((w = vec_width<Ts>() > w ? vec_width<Ts>() : w), ...);
  return w;
}

// ---- the per-chunk loop ------------------------------------------------------------------
// Op is a per-thread object with, for any lane count L (W on the vector path, 1 otherwise):
//   template <int L> struct Regs;                       registers of one vector of L lanes
//   template <int L> void load(int i, Regs<L>&);         elements [i, i + L) of the chunk
//   template <int L> void apply(int i, Regs<L>&);        the element math, lane by lane
//   template <int L> void store(int i, const Regs<L>&);  write back (may do nothing)
// All loads of an iteration are issued before any math, so kElems elements of every list are
// in flight per thread (kernels with many lists use fewer, to stay within the registers).
template <int W, int kElems = kElemsPerThread, typename Op>
__device__ __forceinline__ void chunk_loop(Op& op, int n, bool aligned) {
  static_assert(kChunk % W == 0 && kElems % W == 0, "bad vector width");
  const int tid = static_cast<int>(threadIdx.x);
  if (aligned) {
    constexpr int ILP = kElems / W;
    const int nvec = n / W;
    for (int v0 = tid; v0 < nvec; v0 += ILP * kThreads) {
      typename Op::template Regs<W> r[ILP];
#pragma unroll
      for (int j = 0; j < ILP; ++j) {
        const int v = v0 + j * kThreads;
        if (v < nvec) {
          op.template load<W>(v * W, r[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < ILP; ++j) {
        const int v = v0 + j * kThreads;
        if (v < nvec) {
          op.template apply<W>(v * W, r[j]);
          op.template store<W>(v * W, r[j]);
        }
      }
    }
    // Tail: fewer than W elements, only in a tensor's last chunk.
    for (int i = nvec * W + tid; i < n; i += kThreads) {
      typename Op::template Regs<1> r;
      op.template load<1>(i, r);
      op.template apply<1>(i, r);
      op.template store<1>(i, r);
    }
  } else {
    for (int i0 = tid; i0 < n; i0 += kElems * kThreads) {
      typename Op::template Regs<1> r[kElems];
#pragma unroll
      for (int j = 0; j < kElems; ++j) {
        const int i = i0 + j * kThreads;
        if (i < n) {
          op.template load<1>(i, r[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < kElems; ++j) {
        const int i = i0 + j * kThreads;
        if (i < n) {
          op.template apply<1>(i, r[j]);
          op.template store<1>(i, r[j]);
        }
      }
    }
  }
}

// ---- host side ---------------------------------------------------------------------------

inline int64_t chunks_of(int64_t numel) {
  return (numel + kChunk - 1) / kChunk;
}

// Fills TensorBatch launches for lists[0..kLists) (all of one length, tensor i of every list
// with the same numel) and calls launch(batch, blocks) for each. Empty tensors are skipped.
// written: bit l set if the kernel writes list l. Those lists' addresses are taken with
// mutable_data_ptr(), which gives a copy-on-write tensor its own storage first (writing through
// const_data_ptr() would change the tensor it was cloned from too); the others are only read.
// extra(i, slot_pointers) fills the kExtra per-tensor pointers of tensor i.
// elem_w is the kernel's W: tensor i takes the vector path if, for every list, its pointer is
// aligned to the width of one access of that list.
template <int kLists, int kExtra, typename ExtraFn, typename LaunchFn>
void multi_tensor_apply(const std::array<at::TensorList, kLists>& lists, uint32_t written,
                        int elem_w, const ExtraFn& extra, const LaunchFn& launch) {
  using Batch = TensorBatch<kLists, kExtra>;
  static_assert(sizeof(Batch) <= static_cast<size_t>(kArgBytes), "metadata too large");
  Batch b;
  b.block_base = 0;
  b.ntensors = 0;
  b.first_block[0] = 0;
  int64_t blocks = 0;
  auto flush = [&] {
    if (b.ntensors == 0) {
      return;
    }
    b.first_block[b.ntensors] = static_cast<int32_t>(blocks);
    launch(static_cast<const Batch&>(b), blocks);
    b.block_base += blocks;
    b.ntensors = 0;
    blocks = 0;
  };
  const size_t n = lists[0].size();
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = lists[0][i].numel();
    if (numel == 0) {
      continue;
    }
    const int64_t c = chunks_of(numel);
    if (b.ntensors == Batch::kMaxTensors || blocks + c > INT32_MAX) {
      flush();
    }
    const int t = b.ntensors;
    bool aligned = true;
    for (int l = 0; l < kLists; ++l) {
      const at::Tensor& x = lists[l][i];
      const bool writes = ((written >> l) & 1u) != 0;
      void* p = writes ? x.mutable_data_ptr() : const_cast<void*>(x.const_data_ptr());
      b.ptr[l][t] = p;
      const int64_t access =
          std::min<int64_t>(kMaxVecBytes, static_cast<int64_t>(elem_w) * x.element_size());
      aligned = aligned && reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(access) == 0;
    }
    void* slots[Batch::kExtraSlots] = {};
    extra(i, slots);
    for (int e = 0; e < Batch::kExtraSlots; ++e) {
      b.extra[e][t] = slots[e];
    }
    b.numel[t] = numel;
    b.aligned[t] = aligned ? 1 : 0;
    b.first_block[t] = static_cast<int32_t>(blocks);
    blocks += c;
    b.ntensors = t + 1;
  }
  flush();
}

// Total blocks multi_tensor_apply will launch over a list (for per-block workspaces).
inline int64_t total_chunks(at::TensorList tensors) {
  int64_t s = 0;
  for (const auto& t : tensors) {
    s += chunks_of(t.numel());
  }
  return s;
}

// A plain pointer list for the scalar follow-up kernels (step counts).
struct PtrBatch {
  static constexpr int kMax = (kArgBytes - 16) / 8;
  float* ptr[kMax];
  int32_t n;
};

}  // namespace fusedamp::cuda
