// fusedamp::optim::{AdamW, Adam, SGD} from C++, stepping: parity with torch::optim on FP32
// params, FP32 master weights on FP16/BF16 params against an FP64 reference, skipped steps
// bit-exact, clipping, param groups and LR schedules (saving, loading and the state of each
// master-weight mode: test_optim_state.cpp).
#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <fusedamp/fusedamp.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>

#include <cmath>

#include "optim_test_util.h"

using namespace optim_test;

namespace {

double max_abs_diff(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    m = std::max(m, (a[i].to(at::kDouble) - b[i].to(at::kDouble)).abs().max().item<double>());
  }
  return m;
}

// FP64 references for master-weight tracking.
struct AdamWRef {
  std::vector<Tensor> p, m, v;
  double lr, b1, b2, eps, wd;
  int t = 0;
  void step(const std::vector<Tensor>& grads) {
    ++t;
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      const auto g = grads[i].to(at::kDouble);
      p[i].mul_(1 - lr * wd);
      m[i] = m[i] * b1 + g * (1 - b1);
      v[i] = v[i] * b2 + g * g * (1 - b2);
      p[i] -= (lr / bc1) * m[i] / (v[i].sqrt() / std::sqrt(bc2) + eps);
    }
  }
};

struct SgdRef {
  std::vector<Tensor> p, buf;
  double lr, momentum, wd;
  bool nesterov;
  int t = 0;
  void step(const std::vector<Tensor>& grads) {
    for (size_t i = 0; i < p.size(); ++i) {
      auto g = grads[i].to(at::kDouble) + wd * p[i];
      buf[i] = t == 0 ? g : buf[i] * momentum + g;
      g = nesterov ? g + momentum * buf[i] : buf[i];
      p[i] -= lr * g;
    }
    ++t;
  }
};

std::vector<Tensor> grads_of(const std::vector<Tensor>& ps) {
  std::vector<Tensor> g;
  for (const auto& p : ps) {
    g.push_back(p.grad());
  }
  return g;
}

std::vector<Tensor> to_double(const std::vector<Tensor>& ps) {
  std::vector<Tensor> out;
  for (const auto& p : ps) {
    out.push_back(p.detach().to(at::kDouble));
  }
  return out;
}

std::vector<Tensor> zeros_double(const std::vector<Tensor>& ps) {
  std::vector<Tensor> out;
  for (const auto& p : ps) {
    out.push_back(at::zeros(p.sizes(), at::kDouble));
  }
  return out;
}

std::vector<Tensor> masters_of(const fo::Optimizer& opt) {
  std::vector<Tensor> out;
  for (const auto& p : opt.all_params()) {
    out.push_back(opt.param_state(p).at(fo::kMasterParam));
  }
  return out;
}

}  // namespace

TEST_CASE("AdamW/Adam/SGD on FP32 params equal torch::optim", "[optim]") {
  const int kSteps = 100;
  SECTION("AdamW") {
    auto a = make_params(at::kFloat), b = copies(a);
    fo::AdamW ours(a, fo::AdamWOptions(1e-2).betas({0.8, 0.99}).eps(1e-6).weight_decay(0.05));
    torch::optim::AdamW ref(b, torch::optim::AdamWOptions(1e-2)
                                   .betas({0.8, 0.99})
                                   .eps(1e-6)
                                   .weight_decay(0.05));
    const auto start = copies(a);
    for (int i = 0; i < kSteps; ++i) {
      set_grads(a, i);
      set_grads(b, i);
      ours.step();
      ref.step();
    }
    CHECK(max_abs_diff(a, start) > 0.2);  // it trained
    CHECK(max_abs_diff(a, b) < 2e-5);
    CHECK(ours.param_state(a[0]).at(fo::kStep).item<float>() == kSteps);
  }
  SECTION("Adam with L2 weight decay") {
    auto a = make_params(at::kFloat), b = copies(a);
    fo::Adam ours(a, fo::AdamOptions(3e-3).weight_decay(0.1));
    torch::optim::Adam ref(b, torch::optim::AdamOptions(3e-3).weight_decay(0.1));
    for (int i = 0; i < kSteps; ++i) {
      set_grads(a, i);
      set_grads(b, i);
      ours.step();
      ref.step();
    }
    CHECK(max_abs_diff(a, b) < 2e-5);
  }
  SECTION("SGD: momentum, dampening, Nesterov, weight decay") {
    struct Case {
      double momentum, dampening, wd;
      bool nesterov;
    };
    for (const auto c : {Case{0.0, 0.0, 0.0, false}, Case{0.9, 0.0, 1e-2, false},
                         Case{0.9, 0.1, 0.0, false}, Case{0.8, 0.0, 1e-3, true}}) {
      auto a = make_params(at::kFloat), b = copies(a);
      fo::SGD ours(a, fo::SGDOptions(1e-2)
                          .momentum(c.momentum)
                          .dampening(c.dampening)
                          .weight_decay(c.wd)
                          .nesterov(c.nesterov));
      torch::optim::SGD ref(b, torch::optim::SGDOptions(1e-2)
                                   .momentum(c.momentum)
                                   .dampening(c.dampening)
                                   .weight_decay(c.wd)
                                   .nesterov(c.nesterov));
      for (int i = 0; i < kSteps; ++i) {
        set_grads(a, i);
        set_grads(b, i);
        ours.step();
        ref.step();
      }
      INFO("momentum " << c.momentum << " nesterov " << c.nesterov);
      CHECK(max_abs_diff(a, b) < 1e-4 * (1 + max_abs_diff(b, zeros_double(b))));
    }
  }
}

TEST_CASE("master weights on FP16/BF16 params track an FP64 reference", "[optim][master]") {
  const int kSteps = 200;
  for (auto dtype : {at::kHalf, at::kBFloat16}) {
    INFO("dtype " << dtype);
    SECTION(std::string("AdamW ") + c10::toString(dtype)) {
      auto ps = make_params(dtype);
      fo::AdamW opt(ps, fo::AdamWOptions(1e-3).weight_decay(1e-2));
      AdamWRef ref{to_double(ps), zeros_double(ps), zeros_double(ps), 1e-3, 0.9, 0.999, 1e-8,
                   1e-2};
      auto fp32 = copies(ps);  // torch::optim in FP32 on the same grads: its own error
      for (auto& p : fp32) {
        p = p.detach().to(at::kFloat).set_requires_grad(true);
      }
      torch::optim::AdamW torch_fp32(fp32, torch::optim::AdamWOptions(1e-3).weight_decay(1e-2));
      for (int i = 0; i < kSteps; ++i) {
        set_grads(ps, i);
        for (size_t k = 0; k < ps.size(); ++k) {
          fp32[k].mutable_grad() = ps[k].grad().to(at::kFloat);
        }
        ref.step(grads_of(ps));
        opt.step();
        torch_fp32.step();
      }
      const auto masters = masters_of(opt);
      const double our_err = max_abs_diff(masters, ref.p);
      const double torch_err = max_abs_diff(fp32, ref.p);
      CHECK(our_err <= 2 * torch_err + 1e-7);
      CHECK(our_err < 1e-4);  // |p| ~ 4, 200 FP32 steps
      // The model weights are exactly the master weights rounded.
      for (size_t k = 0; k < ps.size(); ++k) {
        CHECK(bits_equal(ps[k].detach(), masters[k].to(dtype)));
      }
      // Without master weights the low-precision params drift far more.
      CHECK(max_abs_diff(ps, ref.p) > our_err);
    }
    SECTION(std::string("SGD nesterov ") + c10::toString(dtype)) {
      auto ps = make_params(dtype);
      fo::SGD opt(ps, fo::SGDOptions(1e-2).momentum(0.9).nesterov(true).weight_decay(1e-3));
      SgdRef ref{to_double(ps), zeros_double(ps), 1e-2, 0.9, 1e-3, true};
      for (int i = 0; i < kSteps; ++i) {
        set_grads(ps, i);
        ref.step(grads_of(ps));
        opt.step();
      }
      const double scale = max_abs_diff(ref.p, zeros_double(ps));
      CHECK(max_abs_diff(masters_of(opt), ref.p) < 2e-6 * scale * kSteps);
    }
  }
}

TEST_CASE("a skipped step changes nothing, bit for bit", "[optim][skip]") {
  auto ps = make_params(at::kHalf);
  fo::AdamW opt(ps, fo::AdamWOptions(1e-3).max_grad_norm(1.0));
  fusedamp::GradScaler scaler(fusedamp::GradScalerOptions().init_scale(1024));
  for (int i = 0; i < 3; ++i) {
    set_grads(ps, i, 1024);
    scaler.step(opt);
    scaler.update();
  }
  const auto before = snapshot(opt);
  set_grads(ps, 3, 1024);
  ps[1].mutable_grad()[2][5] = INFINITY;
  scaler.step(opt);
  scaler.update();
  CHECK(snapshots_equal(before, snapshot(opt)));
  CHECK(opt.last_step_applied().item<float>() == 0.f);
  CHECK(opt.skipped_steps().item<int64_t>() == 1);
  CHECK(scaler.get_scale() == 512);
  CHECK(opt.param_state(ps[0]).at(fo::kStep).item<float>() == 3.f);
  set_grads(ps, 4, 512);
  scaler.step(opt);
  scaler.update();
  CHECK(opt.last_step_applied().item<float>() == 1.f);
  CHECK_FALSE(snapshots_equal(before, snapshot(opt)));
}

TEST_CASE("BF16 without a scaler: a non-finite grad still skips the step", "[optim][skip]") {
  auto ps = make_params(at::kBFloat16);
  fo::AdamW opt(ps, fo::AdamWOptions(1e-3));
  set_grads(ps, 0);
  opt.step();
  const auto before = snapshot(opt);
  set_grads(ps, 1);
  ps[0].mutable_grad()[17] = NAN;
  opt.step();
  CHECK(snapshots_equal(before, snapshot(opt)));
  CHECK(opt.last_step_applied().item<float>() == 0.f);
  CHECK(opt.skipped_steps().item<int64_t>() == 1);
  SECTION("the protection can be turned off") {
    opt.set_group_option(0, "skip_nonfinite", 0.0);
    opt.step();
    CHECK(at::isnan(ps[0]).any().item<bool>());
    CHECK(opt.last_step_applied().item<float>() == 1.f);
  }
}

TEST_CASE("fused clipping equals clip_grad_norm_ then step", "[optim][clip]") {
  auto a = make_params(at::kFloat), b = copies(a), c = copies(a);
  fo::AdamW ours(a, fo::AdamWOptions(1e-2).max_grad_norm(0.5));
  fo::AdamW scaled(c, fo::AdamWOptions(1e-2).max_grad_norm(0.5));
  fusedamp::GradScaler scaler(fusedamp::GradScalerOptions().init_scale(4096));
  torch::optim::AdamW ref(b, torch::optim::AdamWOptions(1e-2));
  for (int i = 0; i < 50; ++i) {
    set_grads(a, i);
    set_grads(b, i);
    set_grads(c, i, 4096);
    ours.step();
    torch::nn::utils::clip_grad_norm_(b, 0.5);
    ref.step();
    scaler.step(scaled);
    scaler.update();
  }
  CHECK(max_abs_diff(a, b) < 2e-5);
  CHECK(max_abs_diff(c, b) < 2e-5);
  CHECK(scaler.get_scale() == 4096);
}

TEST_CASE("grad_norm() is the last step's unscaled global norm, a tensor of its own",
          "[optim][clip]") {
  Tensor w = at::zeros({4}).set_requires_grad(true);
  fo::SGD opt(std::vector<Tensor>{w}, fo::SGDOptions(0.0));
  CHECK_FALSE(opt.grad_norm().defined());  // before a step
  fusedamp::GradScaler scaler(fusedamp::GradScalerOptions().init_scale(8));
  w.mutable_grad() = at::full({4}, 8.f * 1.5f);  // unscaled: 1.5 each, norm 3
  scaler.step(opt);
  scaler.update();
  const Tensor first = opt.grad_norm();
  REQUIRE(first.defined());
  CHECK(first.item<float>() == 3.f);
  w.mutable_grad() = at::full({4}, 8.f * 0.5f);  // norm 1
  scaler.step(opt);
  scaler.update();
  CHECK(opt.grad_norm().item<float>() == 1.f);
  CHECK(first.item<float>() == 3.f);  // the next step did not write into it
  CHECK(scaler.telemetry().grad_norm == std::vector<double>{3.0, 1.0});
  // Unscaled by the scaler first and not clipped: the step runs no statistics pass.
  w.mutable_grad() = at::full({4}, 8.f);
  scaler.unscale_(opt);
  scaler.step(opt);
  scaler.update();
  CHECK_FALSE(opt.grad_norm().defined());
  opt.step();  // without a scaler (skip_nonfinite's pass): the norm of the grads as they are
  CHECK(opt.grad_norm().item<float>() == 2.f);
}

TEST_CASE("param groups keep their own hyper-parameters; the LR hook", "[optim][groups]") {
  auto a = make_params(at::kFloat), b = copies(a);
  auto group = [](std::vector<Tensor> ps, double lr, double wd) {
    return torch::optim::OptimizerParamGroup(
        std::move(ps), std::make_unique<fo::AdamOptions>(fo::AdamWOptions(lr).weight_decay(wd)));
  };
  auto tgroup = [](std::vector<Tensor> ps, double lr, double wd) {
    return torch::optim::OptimizerParamGroup(
        std::move(ps),
        std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(lr).weight_decay(wd)));
  };
  fo::AdamW ours({group({a[0], a[1]}, 1e-2, 0.1), group({a[2], a[3]}, 1e-3, 0.0)});
  torch::optim::AdamW ref({tgroup({b[0], b[1]}, 1e-2, 0.1), tgroup({b[2], b[3]}, 1e-3, 0.0)});
  CHECK(ours.num_groups() == 2);
  for (int i = 0; i < 60; ++i) {
    if (i == 30) {  // what an LR scheduler does
      ours.set_group_option(0, "lr", 5e-3);
      ours.param_groups()[1].options().set_lr(2e-3);
      ref.param_groups()[0].options().set_lr(5e-3);
      ref.param_groups()[1].options().set_lr(2e-3);
    }
    set_grads(a, i);
    set_grads(b, i);
    ours.step();
    ref.step();
  }
  CHECK(ours.group_lr(1) == 2e-3);
  CHECK(ours.group_option(0, "weight_decay") == 0.1);
  CHECK(max_abs_diff(a, b) < 2e-5);
}

TEST_CASE("torch::optim LR schedulers drive the fused optimizers", "[optim][groups]") {
  auto ps = make_params(at::kHalf);
  fo::SGD opt(ps, fo::SGDOptions(0.4).momentum(0.9));
  torch::optim::StepLR sched(opt, /*step_size=*/2, /*gamma=*/0.5);
  for (int i = 0; i < 4; ++i) {
    set_grads(ps, i);
    opt.step();
    sched.step();
  }
  // torch::optim::StepLR decays at its 3rd call (step counts 0..3 seen): 0.4 -> 0.2.
  CHECK(opt.group_lr(0) == Approx(0.2));
  CHECK(opt.group_options(0).lr() == Approx(0.2));
}

TEST_CASE("lr_tensor overrides lr; state is exposed without copies", "[optim]") {
  auto a = make_params(at::kHalf), b = copies(a);
  fo::SGD x(a, fo::SGDOptions(0.1).momentum(0.9));
  fo::SGD y(b, fo::SGDOptions(0.5).momentum(0.9));
  auto lr = at::full({1}, 0.1f);
  y.set_group_lr_tensor(0, lr);
  for (int i = 0; i < 5; ++i) {
    set_grads(a, i);
    set_grads(b, i);
    x.step();
    y.step();
  }
  for (size_t k = 0; k < a.size(); ++k) {
    CHECK(bits_equal(a[k].detach(), b[k].detach()));
  }
  auto st = x.param_state(a[0]);
  CHECK(st.count(fo::kMomentumBuffer) == 1);
  CHECK(st.count(fo::kMasterParam) == 1);
  CHECK(st.at(fo::kMomentumBuffer).is_same(x.param_state(a[0]).at(fo::kMomentumBuffer)));
  const auto buf_before = st.at(fo::kMomentumBuffer).clone();
  set_grads(a, 9);
  x.step();
  CHECK_FALSE(at::equal(buf_before, st.at(fo::kMomentumBuffer)));  // live, not a copy
}

TEST_CASE("params without a grad are skipped; buckets follow the grads", "[optim]") {
  auto ps = make_params(at::kFloat);
  fo::AdamW opt(ps, fo::AdamWOptions(1e-2));
  const auto p2 = ps[2].detach().clone();
  set_grads(ps, 0);
  ps[2].mutable_grad() = Tensor();
  opt.step();
  set_grads(ps, 0);
  ps[2].mutable_grad() = Tensor();
  opt.step();
  CHECK(opt.bucket_builds() == 1);  // grouped once, not per step
  CHECK(at::equal(ps[2], p2));
  CHECK(opt.param_state(ps[2]).empty());
  CHECK(opt.param_state(ps[0]).at(fo::kStep).item<float>() == 2.f);
  set_grads(ps, 1);
  opt.step();
  CHECK(opt.bucket_builds() == 2);  // ps[2] got a grad: rebuilt once
  CHECK_FALSE(at::equal(ps[2], p2));
  CHECK(opt.param_state(ps[2]).at(fo::kStep).item<float>() == 1.f);
  CHECK(opt.param_state(ps[0]).at(fo::kStep).item<float>() == 3.f);
  opt.zero_grad();
  CHECK_FALSE(ps[0].grad().defined());
  opt.step();  // no grads: a no-op
  CHECK(opt.param_state(ps[0]).at(fo::kStep).item<float>() == 3.f);
}
