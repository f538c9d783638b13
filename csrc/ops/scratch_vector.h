#pragma once
// The vectors a kernel or its checks need for one call (per-tensor coefficients and step counts,
// chunk plan, per-chunk partial results), lent from a pool of this thread's and given back when
// the call ends, so that a step over thousands of tensors allocates nothing once warm. Fresh
// allocations of their sizes (10-160 KB each at 10,000 tensors) cost more than the kernels'
// work on small tensors: glibc serves them from the top of the heap, after first consolidating
// every small chunk freed since (e.g. the last step's gradients, dropped by zero_grad).
// Leases nest: each has a vector of its own. A pooled vector keeps its capacity, so a thread
// holds at most the largest sizes it has used, for as long as it lives.
#include <cstddef>
#include <utility>
#include <vector>

namespace fusedamp {

template <typename T>
class ScratchVector {
 public:
  // n elements, each `value`.
  explicit ScratchVector(size_t n, const T& value = T()) : v_(take()) { v_.assign(n, value); }
  ~ScratchVector() {
    v_.clear();
    try {
      pool().push_back(std::move(v_));
    } catch (...) {  // no room to keep it: it is freed instead
    }
  }
  ScratchVector(const ScratchVector&) = delete;
  ScratchVector& operator=(const ScratchVector&) = delete;

  std::vector<T>& operator*() { return v_; }
  const std::vector<T>& operator*() const { return v_; }
  T& operator[](size_t i) { return v_[i]; }
  const T& operator[](size_t i) const { return v_[i]; }

 private:
  static std::vector<std::vector<T>>& pool() {
    thread_local std::vector<std::vector<T>> vectors;
    return vectors;
  }
  static std::vector<T> take() {
    auto& p = pool();
    if (p.empty()) {
      return {};
    }
    std::vector<T> v = std::move(p.back());
    p.pop_back();
    return v;
  }

  std::vector<T> v_;
};

}  // namespace fusedamp
