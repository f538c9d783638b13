#pragma once
// What the tests of fusedamp::optim share (test_optim.cpp, test_optim_state.cpp): parameters
// and gradients made the same way in every test, and bit-level comparisons of an optimizer's
// tensors.
#include <ATen/ATen.h>
#include <fusedamp/fusedamp.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <sstream>
#include <vector>

namespace optim_test {

namespace fo = fusedamp::optim;
using at::Tensor;

inline const std::vector<std::vector<int64_t>> kShapes = {{1001}, {3, 7}, {1}, {64, 17}};

inline std::vector<Tensor> make_params(at::ScalarType dtype, uint64_t seed = 7) {
  at::manual_seed(seed);
  std::vector<Tensor> ps;
  for (const auto& s : kShapes) {
    ps.push_back(at::randn(s).to(dtype).set_requires_grad(true));
  }
  return ps;
}

inline std::vector<Tensor> copies(const std::vector<Tensor>& ps) {
  std::vector<Tensor> out;
  for (const auto& p : ps) {
    out.push_back(p.detach().clone().set_requires_grad(true));
  }
  return out;
}

// Deterministic grads for step i (times `mult`), in the params' dtype.
inline void set_grads(const std::vector<Tensor>& ps, int i, double mult = 1.0) {
  at::manual_seed(1000 + i);
  for (const auto& p : ps) {
    const_cast<Tensor&>(p).mutable_grad() = (at::randn(p.sizes()) * mult).to(p.scalar_type());
  }
}

// Step i of two optimizers on the same gradients: set_grads(ps, i), copied to `others`.
template <typename A, typename B>
void step_both(int i, const std::vector<Tensor>& ps, A& opt, const std::vector<Tensor>& others,
               B& other) {
  set_grads(ps, i);
  for (size_t k = 0; k < ps.size(); ++k) {
    const_cast<Tensor&>(others[k]).mutable_grad() = ps[k].grad().clone();
  }
  opt.step();
  other.step();
}

// What `out` holds, into `in` as a load from a file reads it.
inline void read_back(torch::serialize::OutputArchive& out, torch::serialize::InputArchive& in) {
  std::stringstream buffer;
  out.save_to(buffer);
  in.load_from(buffer);
}

inline bool bits_equal(const Tensor& a, const Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         at::equal(a.contiguous().reshape(-1).view(at::kByte),
                   b.contiguous().reshape(-1).view(at::kByte));
}

// Every tensor an optimizer step could touch: params, then each param's state.
inline std::vector<Tensor> snapshot(const fo::Optimizer& opt) {
  std::vector<Tensor> out;
  for (const auto& p : opt.all_params()) {
    out.push_back(p.detach().clone());
    auto st = opt.param_state(p);
    for (const char* k : {fo::kStep, fo::kMasterParam, fo::kExpAvg, fo::kExpAvgSq,
                          fo::kMomentumBuffer, fo::kParamRemainder, fo::kMomentScales,
                          fo::kMomentumScales}) {
      if (st.count(k)) {
        out.push_back(st.at(k).clone());
      }
    }
  }
  return out;
}

inline bool snapshots_equal(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  if (a.size() != b.size()) {
    return false;
  }
  for (size_t i = 0; i < a.size(); ++i) {
    if (!bits_equal(a[i], b[i])) {
      return false;
    }
  }
  return true;
}

}  // namespace optim_test
