// fusedamp::GradScaler from C++: the scale sequence against a model of torch.amp's rule and
// against torch's own _amp_update_scale_, hysteresis and bounds, the unscale_/step/update
// protocol, torch::optim optimizers, save/load, bad input.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <fusedamp/fusedamp.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <sstream>

namespace {

// torch.amp.GradScaler's rule (torch/amp/grad_scaler.py, _amp_update_scale_ on the CPU): the
// FP32 scale multiplied by the factor in double, rounded to float; growth only if finite.
struct TorchScaleModel {
  float scale;
  int growth_tracker = 0;
  double growth_factor, backoff_factor;
  int interval;
  void update(bool found_inf) {
    if (found_inf) {
      scale = static_cast<float>(scale * backoff_factor);
      growth_tracker = 0;
      return;
    }
    if (growth_tracker + 1 == interval) {
      const float s = static_cast<float>(scale * growth_factor);
      if (std::isfinite(s)) {
        scale = s;
      }
      growth_tracker = 0;
    } else {
      ++growth_tracker;
    }
  }
};

// One tiny fused optimizer whose grad is finite or inf on demand.
struct Rig {
  at::Tensor w = at::zeros({5}).set_requires_grad(true);
  fusedamp::optim::SGD opt{std::vector<at::Tensor>{w}, fusedamp::optim::SGDOptions(0.0)};
  void set_grad(bool overflow) {
    auto g = at::ones({5});
    if (overflow) {
      g[3] = INFINITY;
    }
    w.mutable_grad() = g;
  }
  // One iteration under `scaler`; returns the scale after update().
  double iterate(fusedamp::GradScaler& scaler, bool overflow) {
    set_grad(overflow);
    scaler.step(opt);
    scaler.update();
    return scaler.get_scale();
  }
};

}  // namespace

TEST_CASE("scale sequence equals torch.amp's rule over random overflow patterns", "[scaler]") {
  std::mt19937 rng(1234);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const double growth[] = {2.0, 1.5, 3.0};
  const double backoff[] = {0.5, 0.25, 0.7};
  int64_t steps_checked = 0;
  for (int pattern = 0; pattern < 300; ++pattern) {
    const double gf = growth[pattern % 3];
    const double bf = backoff[(pattern / 3) % 3];
    const int interval = 1 + static_cast<int>(u(rng) * 8);
    const double p_overflow = u(rng) * 0.5;
    const float init = pattern % 7 == 0 ? 3.0e38f : 1000.0f;  // also near FP32 max
    fusedamp::GradScaler scaler(fusedamp::GradScalerOptions()
                                    .init_scale(init)
                                    .growth_factor(gf)
                                    .backoff_factor(bf)
                                    .growth_interval(interval));
    TorchScaleModel model{init, 0, gf, bf, interval};
    auto t_scale = at::full({1}, init, at::kFloat);
    auto t_growth = at::zeros({1}, at::kInt);
    Rig rig;
    for (int step = 0; step < 40; ++step) {
      const bool overflow = u(rng) < p_overflow;
      rig.set_grad(overflow);
      scaler.step(rig.opt);
      scaler.update();
      model.update(overflow);
      at::_amp_update_scale_(t_scale, t_growth, at::full({1}, overflow ? 1.f : 0.f), gf, bf,
                             interval);
      const float got = scaler.scale_tensor().item<float>();
      REQUIRE(got == model.scale);
      REQUIRE(got == t_scale.item<float>());
      REQUIRE(scaler.growth_tracker().item<int>() == model.growth_tracker);
      REQUIRE(rig.opt.last_step_applied().item<float>() == (overflow ? 0.f : 1.f));
      ++steps_checked;
    }
  }
  CHECK(steps_checked == 12000);
}

TEST_CASE("hysteresis is Megatron's: only a growth refills it", "[scaler]") {
  fusedamp::GradScaler scaler(
      fusedamp::GradScalerOptions().init_scale(1024).growth_interval(3).hysteresis(3));
  Rig rig;
  auto run = [&](bool overflow) { return rig.iterate(scaler, overflow); };
  CHECK(run(true) == 1024);   // 1st overflow tolerated
  CHECK(run(true) == 1024);   // 2nd tolerated
  CHECK(run(true) == 512);    // 3rd backs off
  CHECK(run(true) == 256);    // exhausted: every further overflow backs off
  CHECK(run(false) == 256);   // a clean step leaves it exhausted
  CHECK(scaler.hysteresis_tracker().item<int>() == 0);
  CHECK(run(true) == 128);
  CHECK(run(false) == 128);
  CHECK(run(false) == 128);
  CHECK(run(false) == 256);   // growth after 3 clean steps refills the hysteresis
  CHECK(scaler.hysteresis_tracker().item<int>() == 3);
  CHECK(run(true) == 256);    // tolerated again
  CHECK(rig.opt.skipped_steps().item<int64_t>() == 6);
}

TEST_CASE("telemetry's scale column is the scale each update() judged, oldest first",
          "[scaler][telemetry]") {
  fusedamp::GradScaler scaler(fusedamp::GradScalerOptions().init_scale(64).growth_interval(2));
  Rig rig;
  std::vector<double> after;  // the scale after each update()
  for (const bool overflow : {false, false, true, false}) {
    after.push_back(rig.iterate(scaler, overflow));
  }
  CHECK(after == std::vector<double>{64, 128, 64, 64});
  // Each iteration's row holds the scale its gradients carried: the one before the update,
  // i.e. the previous update's result.
  auto log = scaler.telemetry();
  CHECK(log.scale == std::vector<double>{64, 64, 128, 64});
  CHECK(log.found_inf == std::vector<bool>{false, false, true, false});
  CHECK(log.step == std::vector<int64_t>{0, 1, 2, 3});
  // An explicit scale judges no iteration: it is not a row, the next iteration carries it.
  scaler.update(5.0);
  CHECK(scaler.telemetry().scale.size() == 4);
  rig.iterate(scaler, false);
  log = scaler.telemetry();
  REQUIRE(log.scale.size() == 5);
  CHECK(log.scale.back() == 5.0);
  fusedamp::GradScaler quiet(fusedamp::GradScalerOptions().init_scale(64).telemetry(false));
  rig.iterate(quiet, false);
  CHECK(quiet.telemetry().scale.empty());
}

TEST_CASE("min_scale and max_scale bound the scale", "[scaler]") {
  fusedamp::GradScaler scaler(fusedamp::GradScalerOptions()
                                  .init_scale(8)
                                  .growth_interval(1)
                                  .min_scale(2.0)
                                  .max_scale(32.0));
  Rig rig;
  auto run = [&](bool overflow) { return rig.iterate(scaler, overflow); };
  CHECK(run(true) == 4);
  CHECK(run(true) == 2);
  CHECK(run(true) == 2);  // never below min_scale
  for (int i = 0; i < 10; ++i) {
    run(false);
  }
  CHECK(scaler.get_scale() == 32);  // never above max_scale
}

TEST_CASE("scale(): outputs times the device scale, with torch's type promotion", "[scaler]") {
  fusedamp::GradScaler scaler(fusedamp::GradScalerOptions().init_scale(4));
  auto loss = at::full({}, 1.5, at::kHalf);
  auto s = scaler.scale(loss);
  CHECK(s.scalar_type() == at::kFloat);  // FP16 loss promoted to FP32, as torch does
  CHECK(s.dim() == 0);
  CHECK(s.item<float>() == 6.f);
  // Any tensor of outputs, as torch.amp: its dtype is kept (the scale is a 0-dim tensor).
  auto outputs = scaler.scale(at::ones({3}, at::kHalf));
  CHECK(outputs.scalar_type() == at::kHalf);
  CHECK(at::equal(outputs, at::full({3}, 4.f, at::kHalf)));
  CHECK_THROWS_AS(scaler.scale(at::ones({1}, at::kInt)), c10::Error);
  fusedamp::GradScaler off(fusedamp::GradScalerOptions().enabled(false));
  auto l = at::ones({3});
  CHECK(off.scale(l).is_same(l));
  CHECK(off.get_scale() == 1.0);
  CHECK_FALSE(off.is_enabled());
}

TEST_CASE("unscale_ makes grads true gradients; twice without update is an error", "[scaler]") {
  fusedamp::GradScaler scaler(fusedamp::GradScalerOptions().init_scale(64));
  at::manual_seed(3);
  auto w = at::randn({33}).set_requires_grad(true);
  auto w2 = w.detach().clone().set_requires_grad(true);
  fusedamp::optim::AdamW opt({w}, fusedamp::optim::AdamWOptions(1e-2));
  fusedamp::optim::AdamW opt2({w2}, fusedamp::optim::AdamWOptions(1e-2));
  auto g = at::randn({33});
  w.mutable_grad() = g * 64;
  w2.mutable_grad() = g * 64;
  scaler.unscale_(opt);
  CHECK(at::equal(w.grad(), g));
  CHECK_THROWS_WITH(scaler.unscale_(opt), Catch::Contains("already been called"));
  scaler.step(opt);
  CHECK_THROWS_WITH(scaler.step(opt), Catch::Contains("already been called"));
  // The same step without unscale_ (the fused path) gives the same bits.
  fusedamp::GradScaler scaler2(fusedamp::GradScalerOptions().init_scale(64));
  scaler2.step(opt2);
  CHECK(at::equal(w, w2));
  scaler.update();
  scaler2.update();
  CHECK_THROWS_WITH(scaler.update(), Catch::Contains("no inf checks"));
}

TEST_CASE("GradScaler drives a torch::optim optimizer", "[scaler]") {
  fusedamp::GradScaler scaler(fusedamp::GradScalerOptions().init_scale(16));
  auto w = at::ones({4}).set_requires_grad(true);
  torch::optim::SGD opt({w}, torch::optim::SGDOptions(0.5));
  w.mutable_grad() = at::full({4}, 16.f);
  scaler.step(opt);
  scaler.update();
  CHECK(at::allclose(w, at::full({4}, 0.5f)));
  w.mutable_grad() = at::full({4}, NAN);
  scaler.step(opt);
  scaler.update();
  CHECK(at::allclose(w, at::full({4}, 0.5f)));  // skipped
  CHECK(scaler.get_scale() == 8);
}

TEST_CASE("GradScaler save/load restores every counter", "[scaler]") {
  auto opts = fusedamp::GradScalerOptions().init_scale(256).growth_interval(3).hysteresis(2);
  fusedamp::GradScaler a(opts);
  Rig rig;
  const bool pattern[] = {false, true, false, false, true, true, false, false,
                          false, false, true, false, false};
  std::stringstream buf;
  fusedamp::GradScaler b(fusedamp::GradScalerOptions().init_scale(1));
  for (int i = 0; i < 13; ++i) {
    if (i == 6) {
      torch::serialize::OutputArchive out;
      a.save(out);
      out.save_to(buf);
      torch::serialize::InputArchive in;
      in.load_from(buf);
      b.load(in);
      CHECK(b.get_scale() == a.get_scale());
      CHECK(b.options().hysteresis() == 2);
    }
    rig.set_grad(pattern[i]);
    a.step(rig.opt);
    a.update();
    if (i >= 6) {
      b.step(rig.opt);  // found_inf is recomputed for b from the same grads
      b.update();
      CHECK(b.get_scale() == a.get_scale());
      CHECK(b.growth_tracker().item<int>() == a.growth_tracker().item<int>());
      CHECK(b.hysteresis_tracker().item<int>() == a.hysteresis_tracker().item<int>());
    }
  }
}

TEST_CASE("GradScaler rejects invalid options", "[scaler][bad-input]") {
  using O = fusedamp::GradScalerOptions;
  CHECK_THROWS_WITH(fusedamp::GradScaler(O().growth_factor(1.0)),
                    Catch::Contains("growth_factor must be > 1"));
  CHECK_THROWS_WITH(fusedamp::GradScaler(O().backoff_factor(1.0)),
                    Catch::Contains("backoff_factor must be in (0, 1)"));
  CHECK_THROWS_WITH(fusedamp::GradScaler(O().backoff_factor(0.0)), Catch::Contains("backoff"));
  CHECK_THROWS_WITH(fusedamp::GradScaler(O().growth_interval(0)),
                    Catch::Contains("growth_interval"));
  CHECK_THROWS_WITH(fusedamp::GradScaler(O().hysteresis(0)), Catch::Contains("hysteresis"));
  CHECK_THROWS_WITH(fusedamp::GradScaler(O().init_scale(-1)), Catch::Contains("init_scale"));
  CHECK_THROWS_WITH(fusedamp::GradScaler(O().min_scale(8.0).max_scale(4.0)),
                    Catch::Contains("must not exceed"));
  fusedamp::GradScaler s;
  CHECK_THROWS_AS(s.set_growth_factor(0.5), c10::Error);
  CHECK(s.options().growth_factor() == 2.0);  // unchanged
  CHECK_THROWS_AS(s.load_state(-1.0, 0, 1), c10::Error);
  CHECK(s.get_scale() == 65536.0);
}

TEST_CASE("telemetry records each iteration; the amax policy moves to the measured scale",
          "[scaler][telemetry]") {
  fusedamp::GradScaler scaler(fusedamp::GradScalerOptions()
                                  .init_scale(std::ldexp(1.0, 24))
                                  .policy(fusedamp::ScalePolicy::kAmax)
                                  .amax_target(1024.0));
  Rig rig;  // grads of magnitude 1 (as the scaled gradients)
  // Clean: amax 1 at 2^24 means true gradients of 2^-24; 2^34 puts them at 1024.
  CHECK(rig.iterate(scaler, false) == std::ldexp(1.0, 34));
  // An overflow proves some gradient passed 65504: 2^34 * 1024 / 65504 = 2^28.0002 -> 2^28.
  CHECK(rig.iterate(scaler, true) == std::ldexp(1.0, 28));
  const auto log = scaler.telemetry();
  REQUIRE(log.step.size() == 2);
  CHECK(log.scale == std::vector<double>{std::ldexp(1.0, 24), std::ldexp(1.0, 34)});
  CHECK(log.found_inf == std::vector<bool>{false, true});
  CHECK(log.amax[0] == 1.0);
  CHECK(log.underflow_fraction[0] == 0.0);
  CHECK(log.grad_norm[0] == Approx(std::sqrt(5.0) / std::ldexp(1.0, 24)));
  CHECK(!log.first_nonfinite[0].defined());
  REQUIRE(log.first_nonfinite[1].defined());
  CHECK(log.first_nonfinite[1].is_same(rig.w));
  CHECK_THROWS_WITH(fusedamp::GradScaler(fusedamp::GradScalerOptions()
                                             .policy(fusedamp::ScalePolicy::kAmax)
                                             .telemetry(false)),
                    Catch::Contains("needs telemetry"));
}

TEST_CASE("sharded gradient passes, reduced, give every process the record of the whole",
          "[scaler][telemetry]") {
  // Two "processes" hold half the rows of each parameter's gradient (as FSDP2 shards them);
  // their passes' sums and maxima are combined here as the caller's all-reduces would.
  const auto w = at::tensor({3.0f, 0.0f, -7.0f, 1.0f});
  const auto b = at::tensor({0.5f, std::numeric_limits<float>::infinity()});
  auto with_grad = [](const at::Tensor& g) {
    auto p = at::zeros_like(g);
    p.mutable_grad() = g.clone();
    return p;
  };
  const fusedamp::GradScalerOptions options = fusedamp::GradScalerOptions().init_scale(4.0);
  const auto key = reinterpret_cast<fusedamp::GradScaler::OptimizerKey>(1);
  fusedamp::GradScaler whole(options);
  whole.scale(at::ones({}));
  const std::vector<at::Tensor> full{with_grad(w), with_grad(b)};
  whole.unscale_(key, full);
  whole.end_step(key);
  whole.update();

  std::vector<fusedamp::GradScaler> scalers;
  std::vector<std::vector<at::Tensor>> shards;
  std::vector<std::unique_ptr<fusedamp::ShardedGradStats>> passes;
  for (int r = 0; r < 2; ++r) {
    scalers.emplace_back(options);
  }
  for (int r = 0; r < 2; ++r) {
    scalers[r].scale(at::ones({}));
    shards.push_back({with_grad(w.narrow(0, 2 * r, 2)), with_grad(b.narrow(0, r, 1))});
    passes.push_back(std::make_unique<fusedamp::ShardedGradStats>(scalers[r].telemetry_sink()));
    scalers[r].unscale_(key, shards[r], *passes[r]);
  }
  const auto sums = passes[0]->sums() + passes[1]->sums();
  const auto maxima = at::maximum(passes[0]->maxima(), passes[1]->maxima());
  for (int r = 0; r < 2; ++r) {
    passes[r]->sums().copy_(sums);
    passes[r]->maxima().copy_(maxima);
    passes[r]->finish(6.0);
    scalers[r].end_step(key);
    scalers[r].update();
  }
  const auto want = whole.telemetry();
  REQUIRE(want.found_inf == std::vector<bool>{true});
  CHECK(want.amax[0] == 7.0);  // the scaled gradients as they are; the inf is not finite
  CHECK(want.underflow_fraction[0] == Approx(1.0 / 6.0));
  for (int r = 0; r < 2; ++r) {
    const auto log = scalers[r].telemetry();
    CHECK(scalers[r].get_scale() == whole.get_scale());  // the inf on one backs off both
    CHECK(log.found_inf == want.found_inf);
    CHECK(log.amax == want.amax);
    CHECK(log.underflow_fraction == want.underflow_fraction);
    REQUIRE(log.first_nonfinite[0].defined());
    CHECK(log.first_nonfinite[0].is_same(shards[r][1]));  // b, named by each one's own shard
  }
}
