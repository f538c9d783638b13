// fusedamp::optim::sparse_step from C++: the tables stepped as their operators step them, one
// inf/NaN anywhere skips every table, and a bad table is refused before any is written.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <fusedamp/fusedamp.h>

#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace fo = fusedamp::optim;
using at::Tensor;

constexpr int64_t kRows = 50;
constexpr int64_t kDim = 8;

// A table whose gradient looks rows up with duplicates, as nn.Embedding(sparse=True) gives.
Tensor table_with_grad(uint64_t seed) {
  at::manual_seed(seed);
  Tensor p = at::randn({kRows, kDim}).set_requires_grad(true);
  const Tensor indices = at::randint(kRows, {1, 30}, at::kLong);
  p.mutable_grad() = at::sparse_coo_tensor(indices, at::randn({30, kDim}), {kRows, kDim});
  return p;
}

fo::SparseTable adagrad_table(const Tensor& p) {
  fo::SparseHyper h;
  h.lr = 0.1;
  h.eps = 1e-10;
  return {p, std::nullopt, {at::zeros({kRows, kDim})}, at::zeros({}), h};
}

fo::SparseStepOptions adagrad() {
  fo::SparseStepOptions o;
  o.algorithm = fo::SparseAlgorithm::kAdagrad;
  return o;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return at::equal(a.view(at::kInt), b.view(at::kInt));
}

}  // namespace

TEST_CASE("sparse_step steps each table as its operator does") {
  const std::vector<fo::SparseTable> tables = {adagrad_table(table_with_grad(1)),
                                               adagrad_table(table_with_grad(2))};
  std::vector<Tensor> want;
  for (const auto& t : tables) {
    Tensor w = t.param.detach().clone();
    Tensor sum = at::zeros({kRows, kDim});
    const Tensor g = t.param.grad();
    fusedamp::ops::SparseAdagradStep op;  // the declaration's defaults, then the table's
    op.table = w;
    op.indices = g._indices();
    op.values = g._values();
    op.state_sum = sum;
    op.step = at::zeros({});
    op.lr = 0.1;
    op.eps = 1e-10;
    fusedamp::ops::sparse_adagrad_step_(op);
    want.push_back(w);
  }
  const Tensor flag = fo::sparse_step(tables, adagrad());
  REQUIRE(flag.defined());
  CHECK(flag.item<float>() == 0.f);
  for (size_t i = 0; i < tables.size(); ++i) {
    CHECK(same_bits(tables[i].param.detach(), want[i]));
    CHECK(tables[i].step.item<float>() == 1.f);
  }
}

TEST_CASE("sparse_step: an inf in one table's gradient skips every table") {
  const std::vector<fo::SparseTable> tables = {adagrad_table(table_with_grad(3)),
                                               adagrad_table(table_with_grad(4))};
  tables[1].param.grad()._values()[5][2] = std::numeric_limits<float>::infinity();
  const Tensor before = tables[0].param.detach().clone();
  const Tensor flag = fo::sparse_step(tables, adagrad());
  CHECK(flag.item<float>() != 0.f);
  CHECK(same_bits(tables[0].param.detach(), before));
  for (const auto& t : tables) {
    CHECK(t.step.item<float>() == 0.f);
    CHECK(!t.state[0].any().item<bool>());
  }
}

TEST_CASE("sparse_step refuses a bad table before writing any") {
  std::vector<fo::SparseTable> tables = {adagrad_table(table_with_grad(5)),
                                         adagrad_table(table_with_grad(6))};
  const Tensor before = tables[0].param.detach().clone();
  SECTION("an index out of range") {
    tables[1].param.grad()._indices()[0][3] = kRows;
    CHECK_THROWS_WITH(fo::sparse_step(tables, adagrad()), Catch::Contains("out of range"));
  }
  SECTION("a dense gradient") {
    tables[1].param.mutable_grad() = at::ones({kRows, kDim});
    CHECK_THROWS_WITH(fo::sparse_step(tables, adagrad()),
                      Catch::Contains("takes sparse gradients"));
  }
  SECTION("a missing state tensor") {
    tables[1].state.clear();
    CHECK_THROWS_WITH(fo::sparse_step(tables, adagrad()), Catch::Contains("state tensors"));
  }
  SECTION("a negative learning rate") {
    tables[1].hyper.lr = -1.0;
    CHECK_THROWS_AS(fo::sparse_step(tables, adagrad()), c10::ValueError);
  }
  CHECK(same_bits(tables[0].param.detach(), before));
  CHECK(tables[0].step.item<float>() == 0.f);
}

TEST_CASE("sparse_rows_sum_ from C++: each row's lookups summed, in first-lookup order") {
  const Tensor indices = at::tensor({3, 1, 3, 3}, at::kLong).unsqueeze(0);
  const Tensor values = at::arange(8, at::kFloat).reshape({4, 2});
  const Tensor found = at::zeros({}, at::kFloat);
  fusedamp::ops::SparseRowsSum op;  // the declaration's defaults: no unscale, no statistics
  CHECK(op.position == 0);
  op.indices = indices[0];
  op.values = values;
  op.num_rows = 4;
  op.found_inf = found;
  const auto [rows, sums] = fusedamp::ops::sparse_rows_sum_(op);
  CHECK(at::equal(rows, at::tensor({3, 1}, at::kLong)));
  // Row 3: lookups 0, 2 and 3 ({0, 1} + {4, 5} + {6, 7}); row 1: lookup 1.
  CHECK(at::equal(sums, at::tensor({10.f, 13.f, 2.f, 3.f}).reshape({2, 2})));
  CHECK(found.item<float>() == 0.f);
  op.num_rows = 3;  // row 3 out of range: refused, the values untouched
  CHECK_THROWS_WITH(fusedamp::ops::sparse_rows_sum_(op), Catch::Contains("out of range"));
  CHECK(at::equal(values, at::arange(8, at::kFloat).reshape({4, 2})));
}

TEST_CASE("new_sparse_master: what each master-weight mode keeps beside a table") {
  using fo::MasterWeights;
  const Tensor bf16 = at::randn({kRows, kDim}).to(at::kBFloat16);
  const auto fp32 = fo::new_sparse_master(bf16, MasterWeights(true), "test");
  REQUIRE(fp32.has_value());
  CHECK(std::string(fp32->first) == "master_param");
  CHECK(at::equal(fp32->second, bf16.to(at::kFloat)));
  for (const auto& [name, dtype] : {std::pair{"split", at::kShort}, {"split8", at::kChar}}) {
    const auto kept = fo::new_sparse_master(bf16, MasterWeights::from_name(name), "test");
    REQUIRE(kept.has_value());
    CHECK(std::string(kept->first) == "param_remainder");
    CHECK(kept->second.scalar_type() == dtype);
    CHECK(!kept->second.any().item<bool>());  // weight + 0 is the weight
  }
  CHECK(!fo::new_sparse_master(bf16, MasterWeights(false), "test").has_value());
  CHECK(!fo::new_sparse_master(bf16, MasterWeights::from_name("stochastic"), "test"));
  CHECK(!fo::new_sparse_master(at::zeros({2, 2}), MasterWeights(true), "test"));  // its own
  CHECK_THROWS_AS(fo::new_sparse_master(bf16, MasterWeights::from_name("kahan"), "test"),
                  c10::ValueError);
  CHECK_THROWS_WITH(fo::check_sparse_master_weights(MasterWeights::from_name("kahan"), "test"),
                    Catch::Contains("not supported for sparse tables"));
}
