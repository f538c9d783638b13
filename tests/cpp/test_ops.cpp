// The operators called from C++ through the dispatcher (fusedamp::ops::*), on the CPU.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <catch2/catch.hpp>
#include <fusedamp/fusedamp.h>

#include <cmath>
#include <initializer_list>
#include <map>
#include <sstream>
#include <string>
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

// adam_step_'s arguments over these lists, with torch.optim.Adam's default hyper-parameters.
fusedamp::ops::AdamStep adam_args(at::TensorList params, at::TensorList master,
                                  at::TensorList grads, at::TensorList m, at::TensorList v,
                                  at::TensorList steps) {
  fusedamp::ops::AdamStep a{params, master, grads, m, v, steps, 1e-3, 0.9, 0.999, 1e-8, 0.0,
                            true};
  return a;
}

// Op's declared argument names, in order, against its registered schema's.
template <typename Op>
void check_declaration() {
  const auto& schema = c10::Dispatcher::singleton().findSchemaOrThrow(Op::kName, "").schema();
  std::vector<std::string> declared, registered;
  Op op;
  op.for_each_field([&](const auto&, size_t, const char* name) { declared.emplace_back(name); });
  for (const auto& arg : schema.arguments()) {
    registered.push_back(arg.name());
  }
  INFO(Op::kName);
  CHECK(declared == registered);
  CHECK(Op::kArgCount == registered.size());
}

template <typename... Ops>
void check_declarations(fusedamp::ops::OpList<Ops...>) {
  (check_declaration<Ops>(), ...);
}

}  // namespace

TEST_CASE("each operator's declaration lists its schema's arguments in order", "[ops]") {
  check_declarations(fusedamp::ops::AllOps{});
#define FUSEDAMP_CHECK_SPARSE_ROW_OP(Op, op, Algorithm) check_declaration<fusedamp::ops::Op>();
  FUSEDAMP_SPARSE_ROW_OPS(FUSEDAMP_CHECK_SPARSE_ROW_OP)
#undef FUSEDAMP_CHECK_SPARSE_ROW_OP
  check_declaration<fusedamp::ops::SparseRowsSum>();
}

namespace {

// The defaults of a schema's arguments, by name, as the schema prints them.
std::map<std::string, std::string> schema_defaults(const char* op) {
  std::map<std::string, std::string> out;
  const auto& schema = c10::Dispatcher::singleton().findSchemaOrThrow(op, "").schema();
  for (const auto& arg : schema.arguments()) {
    std::ostringstream value;
    if (arg.default_value()) {
      value << *arg.default_value();
    }
    out[arg.name()] = value.str();
  }
  return out;
}

// Group's fields start at the defaults of Group::kName's schema: every op taking it must give
// the same ones.
template <typename Group>
void check_group_defaults(std::initializer_list<const char*> ops) {
  const auto group = schema_defaults(Group::kName);
  for (const char* op : ops) {
    const auto own = schema_defaults(op);
    Group shared;
    size_t count = 0;
    shared.for_each_field(
        [&](const auto&, size_t, const char* name) {
          INFO(op << " " << name);
          REQUIRE(own.count(name) == 1);
          CHECK(own.at(name) == group.at(name));
        },
        count);
    CHECK(count == Group::kArgCount);
  }
}

}  // namespace

TEST_CASE("the step ops' shared arguments have one set of schema defaults", "[ops]") {
#define FUSEDAMP_STEP_OP_NAME(Algorithm, Op, op, kernels) fusedamp::ops::Op::kName,
  check_group_defaults<fusedamp::ops::StepShared>(
      {FUSEDAMP_STEP_ALGORITHMS(FUSEDAMP_STEP_OP_NAME)});
#undef FUSEDAMP_STEP_OP_NAME
#define FUSEDAMP_SPARSE_OP_NAME(Op, op, Algorithm) fusedamp::ops::Op::kName,
  check_group_defaults<fusedamp::ops::SparseRowsShared>(
      {FUSEDAMP_SPARSE_ROW_OPS(FUSEDAMP_SPARSE_OP_NAME)});
#undef FUSEDAMP_SPARSE_OP_NAME
}

TEST_CASE("a declaration starts from its schema's defaults", "[ops]") {
  const fusedamp::ops::UpdateScale u;
  CHECK(u.hysteresis == 1);
  CHECK(!u.min_scale.has_value());
  CHECK(!u.amax_target.has_value());
  const fusedamp::ops::AccountStep acc;
  CHECK(!acc.grad_norm.has_value());
  CHECK(std::isnan(u.growth_factor));  // no default: NaN, which the checks refuse
  const fusedamp::ops::AdamStep a;
  CHECK(a.shared.adopt_param_edits);
  CHECK(!a.shared.write_back_grads);
  CHECK(!a.maximize);
  CHECK(!a.rounding_seeds.has_value());
  CHECK(std::isnan(a.lr));
  std::vector<at::Tensor> params = {at::randn({4})}, grads = {at::randn({4})};
  std::vector<at::Tensor> steps = {at::zeros({})};
  fusedamp::ops::SgdStep forgot_lr;
  forgot_lr.params = params;
  forgot_lr.grads = grads;
  forgot_lr.steps = steps;
  forgot_lr.momentum = forgot_lr.dampening = forgot_lr.weight_decay = 0.0;
  CHECK_THROWS_WITH(fusedamp::ops::sgd_step_(forgot_lr), Catch::Contains("invalid lr nan"));
}

TEST_CASE("unscale_and_check_ equals torch's fused unscale", "[ops]") {
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    at::manual_seed(1);
    std::vector<at::Tensor> grads = {at::randn({1001}).mul(50).to(dtype),
                                     at::randn({3, 7}).to(dtype)};
    auto ref = clones(grads);
    auto found = scalar(0), found_ref = scalar(0), inv = scalar(0.375f);
    fusedamp::ops::unscale_and_check_({grads, found, inv});
    at::_amp_foreach_non_finite_check_and_unscale_(ref, found_ref, inv);
    CHECK(bit_equal(grads, ref));
    CHECK(found.item<float>() == 0.f);
    grads[1][2][3] = INFINITY;
    fusedamp::ops::unscale_and_check_({grads, found, inv});
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
    fusedamp::ops::update_scale_({scale, gt, ht, found, 2.0, 0.5, 7});
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
  for (int t = 1; t <= 30; ++t) {
    auto g = at::randn({513}).to(at::kHalf);
    const std::vector<at::Tensor> grads = {g};
    auto args = adam_args(params, master, grads, m, v, steps);
    args.lr = lr;
    args.weight_decay = wd;
    fusedamp::ops::adam_step_(args);
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
  fusedamp::ops::grad_stats_({grads, found, sq});
  REQUIRE(found.item<float>() == 1.f);
  auto before = clones({params[0], master[0], m[0], v[0], steps[0]});
  auto adam = adam_args(params, master, grads, m, v, steps);
  adam.shared.found_inf = found;
  adam.shared.inv_scale = scalar(0.5f);
  fusedamp::ops::adam_step_(adam);
  fusedamp::ops::SgdStep sgd{params, master, grads, m, steps, 1e-2, 0.9, 0.0, 0.0, false};
  sgd.shared = adam.shared;
  fusedamp::ops::sgd_step_(sgd);
  CHECK(bit_equal(before, {params[0], master[0], m[0], v[0], steps[0]}));
}

TEST_CASE("bad input raises c10::Error and modifies nothing", "[ops]") {
  std::vector<at::Tensor> params = {at::randn({8}).to(at::kHalf)}, master = {at::randn({8})};
  std::vector<at::Tensor> m = {at::zeros({8})}, v = {at::zeros({8})};
  std::vector<at::Tensor> steps = {at::zeros({})};
  auto before = clones({params[0], master[0], m[0], v[0], steps[0]});
  std::vector<at::Tensor> grads = {at::randn({8}).to(at::kHalf)};
  auto bad = adam_args(params, master, grads, m, v, steps);
  bad.beta1 = 1.0;
  CHECK_THROWS_WITH(fusedamp::ops::adam_step_(bad), Catch::Contains("invalid beta1"));
  std::vector<at::Tensor> wrong = {at::randn({9}).to(at::kHalf)};
  CHECK_THROWS_WITH(fusedamp::ops::adam_step_(adam_args(params, master, wrong, m, v, steps)),
                    Catch::Contains("has shape"));
  CHECK_THROWS_AS(fusedamp::ops::update_scale_({scalar(1), at::zeros({1}, at::kInt),
                                                at::ones({1}, at::kInt), scalar(0), 0.5, 0.5,
                                                10}),
                  c10::Error);
  CHECK(bit_equal(before, {params[0], master[0], m[0], v[0], steps[0]}));
}
