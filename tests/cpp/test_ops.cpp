// The operators called from C++ through the dispatcher (fusedamp::ops::*), on the CPU.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <fusedamp/fusedamp.h>

#include <cmath>
#include <vector>

namespace {

at::Tensor scalar(float v) {
  return at::full({1}, v, at::kFloat);
}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) {
    out.push_back(t.clone());
  }
  return out;
}

bool bit_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (!at::equal(a[i].reshape(-1).view(at::kByte), b[i].reshape(-1).view(at::kByte))) {
      return false;
    }
  }
  return true;
}

}  // namespace

TEST_CASE("unscale_and_check_ equals torch's fused unscale", "[ops]") {
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    at::manual_seed(1);
    std::vector<at::Tensor> grads = {at::randn({1001}).mul(50).to(dtype),
                                     at::randn({3, 7}).to(dtype)};
    auto ref = clones(grads);
    auto found = scalar(0), found_ref = scalar(0), inv = scalar(0.375f);
    fusedamp::ops::unscale_and_check_(grads, found, inv);
    at::_amp_foreach_non_finite_check_and_unscale_(ref, found_ref, inv);
    CHECK(bit_equal(grads, ref));
    CHECK(found.item<float>() == 0.f);
    grads[1][2][3] = INFINITY;
    fusedamp::ops::unscale_and_check_(grads, found, inv);
    CHECK(found.item<float>() == 1.f);
  }
}

TEST_CASE("update_scale_ equals torch's _amp_update_scale_", "[ops]") {
  auto scale = scalar(65536.f), ref = scalar(65536.f);
  auto gt = at::zeros({1}, at::kInt), ref_gt = at::zeros({1}, at::kInt);
  auto ht = at::ones({1}, at::kInt);
  at::manual_seed(2);
  auto pattern = at::rand({4000}).lt(0.2);
  for (int64_t i = 0; i < pattern.numel(); ++i) {
    auto found = scalar(pattern[i].item<bool>() ? 1.f : 0.f);
    fusedamp::ops::update_scale_(scale, gt, ht, found, 2.0, 0.5, 7);
    at::_amp_update_scale_(ref, ref_gt, found, 2.0, 0.5, 7);
    REQUIRE(scale.item<float>() == ref.item<float>());
    REQUIRE(gt.item<int>() == ref_gt.item<int>());
  }
}

TEST_CASE("adam_step_ with master weights tracks a double-precision reference", "[ops]") {
  at::manual_seed(3);
  auto init = at::randn({513});
  std::vector<at::Tensor> master = {init.clone()}, params = {init.to(at::kHalf)};
  std::vector<at::Tensor> m = {at::zeros({513})}, v = {at::zeros({513})};
  std::vector<at::Tensor> steps = {at::zeros({})};
  auto p64 = init.to(at::kDouble), m64 = at::zeros_like(p64), v64 = at::zeros_like(p64);
  const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
  fusedamp::ops::AdamArgs args;
  args.lr = lr;
  args.weight_decay = wd;
  for (int t = 1; t <= 30; ++t) {
    auto g = at::randn({513}).to(at::kHalf);
    fusedamp::ops::adam_step_(params, master, {g}, m, v, steps, args);
    auto g64 = g.to(at::kDouble);
    p64.mul_(1 - lr * wd);
    m64.mul_(b1).add_(g64, 1 - b1);
    v64.mul_(b2).addcmul_(g64, g64, 1 - b2);
    p64.sub_(m64.div(v64.sqrt().div(std::sqrt(1 - std::pow(b2, t))).add(eps))
                 .mul(lr / (1 - std::pow(b1, t))));
  }
  const double rel = (master[0].to(at::kDouble) - p64).norm().item<double>() /
                     p64.norm().item<double>();
  CHECK(rel < 1e-6);
  CHECK(at::equal(params[0], master[0].to(at::kHalf)));
  CHECK(steps[0].item<float>() == 30.f);
}

TEST_CASE("a step with found_inf set changes nothing", "[ops]") {
  at::manual_seed(4);
  std::vector<at::Tensor> master = {at::randn({100})}, params = {master[0].to(at::kBFloat16)};
  std::vector<at::Tensor> grads = {at::randn({100}).to(at::kBFloat16)};
  std::vector<at::Tensor> m = {at::randn({100})}, v = {at::rand({100})};
  std::vector<at::Tensor> steps = {at::full({}, 5.f)};
  grads[0][10] = NAN;
  auto found = scalar(0), sq = scalar(0);
  fusedamp::ops::grad_stats_(grads, found, sq);
  REQUIRE(found.item<float>() == 1.f);
  auto before = clones({params[0], master[0], m[0], v[0], steps[0]});
  fusedamp::ops::StepScalars s;
  s.found_inf = found;
  s.inv_scale = scalar(0.5f);
  fusedamp::ops::adam_step_(params, master, grads, m, v, steps, {}, s);
  fusedamp::ops::SgdArgs sgd;
  sgd.momentum = 0.9;
  fusedamp::ops::sgd_step_(params, master, grads, m, steps, sgd, s);
  CHECK(bit_equal(before, {params[0], master[0], m[0], v[0], steps[0]}));
}

TEST_CASE("bad input raises c10::Error and modifies nothing", "[ops]") {
  std::vector<at::Tensor> params = {at::randn({8}).to(at::kHalf)}, master = {at::randn({8})};
  std::vector<at::Tensor> m = {at::zeros({8})}, v = {at::zeros({8})};
  std::vector<at::Tensor> steps = {at::zeros({})};
  auto before = clones({params[0], master[0], m[0], v[0], steps[0]});
  fusedamp::ops::AdamArgs bad;
  bad.beta1 = 1.0;
  std::vector<at::Tensor> grads = {at::randn({8}).to(at::kHalf)};
  CHECK_THROWS_WITH(fusedamp::ops::adam_step_(params, master, grads, m, v, steps, bad),
                    Catch::Contains("invalid beta1"));
  std::vector<at::Tensor> wrong = {at::randn({9}).to(at::kHalf)};
  CHECK_THROWS_WITH(fusedamp::ops::adam_step_(params, master, wrong, m, v, steps, {}),
                    Catch::Contains("has shape"));
  CHECK_THROWS_AS(fusedamp::ops::update_scale_(scalar(1), at::zeros({1}, at::kInt),
                                               at::ones({1}, at::kInt), scalar(0), 0.5, 0.5, 10),
                  c10::Error);
  CHECK(bit_equal(before, {params[0], master[0], m[0], v[0], steps[0]}));
}
