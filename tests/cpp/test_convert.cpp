// Module conversion from C++: which tensors convert_module casts (norm layers' parameters and
// every buffer keep their dtype), and AutocastGuard, which runs autocast's FP32 list in FP32
// inside a converted model's forward.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <catch2/catch.hpp>
#include <fusedamp/fusedamp.h>
#include <torch/nn.h>

TEST_CASE("convert_module keeps normalisation layers and buffers in FP32", "[convert]") {
  torch::nn::Sequential net(torch::nn::Linear(4, 8), torch::nn::BatchNorm1d(8),
                            torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})),
                            torch::nn::GroupNorm(2, 8), torch::nn::Linear(8, 2));
  // A buffer that is not a weight (a position table, rotary frequencies) on a cast module.
  net[0]->register_buffer("table", at::linspace(0, 1, 8));
  const auto w0 = net->parameters()[0];
  const int64_t n = fusedamp::convert_module(*net, at::kHalf);
  CHECK(n == 4);  // two Linear weights and biases
  for (const auto& kv : net->named_parameters()) {
    const bool norm = kv.key().rfind("1.", 0) == 0 || kv.key().rfind("2.", 0) == 0 ||
                      kv.key().rfind("3.", 0) == 0;
    INFO(kv.key());
    CHECK(kv.value().scalar_type() == (norm ? at::kFloat : at::kHalf));
  }
  for (const auto& kv : net->named_buffers()) {
    if (kv.value().is_floating_point()) {
      INFO(kv.key());
      CHECK(kv.value().scalar_type() == at::kFloat);  // running stats and the table
    }
  }
  CHECK(net->parameters()[0].is_same(w0));  // identity kept: optimizers stay valid
  CHECK_THROWS_AS(fusedamp::convert_module(*net, at::kDouble), c10::Error);
}

TEST_CASE("AutocastGuard runs a loss in FP32 and restores the previous state", "[convert]") {
  const auto logits = at::randn({4, 10}).to(at::kHalf);
  const auto labels = at::randint(10, {4}, at::kLong);
  const auto loss = [&] { return torch::nn::functional::cross_entropy(logits, labels); };
  CHECK(loss().scalar_type() == at::kHalf);
  {
    fusedamp::AutocastGuard guard(at::kCPU, at::kHalf);
    CHECK(at::autocast::is_autocast_enabled(at::kCPU));
    const auto inside = loss();
    CHECK(inside.scalar_type() == at::kFloat);
    CHECK(at::allclose(inside, torch::nn::functional::cross_entropy(logits.to(at::kFloat),
                                                                   labels)));
    CHECK(at::matmul(logits.to(at::kFloat), logits.to(at::kFloat).t()).scalar_type() ==
          at::kHalf);
  }
  CHECK_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
  CHECK(loss().scalar_type() == at::kHalf);
  CHECK_THROWS_AS(fusedamp::AutocastGuard(at::kCPU, at::kFloat), c10::Error);
}
