// fusedamp::optim::{AdamW, Adam, SGD} from C++: parity with torch::optim on FP32 params, FP32
// master weights on FP16/BF16 params against an FP64 reference, skipped steps bit-exact,
// save/load/continue bit-exact, param groups, clipping, bad input, module conversion.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <fusedamp/fusedamp.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <cmath>
#include <sstream>

namespace fo = fusedamp::optim;
using at::Tensor;

namespace {

const std::vector<std::vector<int64_t>> kShapes = {{1001}, {3, 7}, {1}, {64, 17}};

std::vector<Tensor> make_params(at::ScalarType dtype, uint64_t seed = 7) {
  at::manual_seed(seed);
  std::vector<Tensor> ps;
  for (const auto& s : kShapes) {
    ps.push_back(at::randn(s).to(dtype).set_requires_grad(true));
  }
  return ps;
}

std::vector<Tensor> copies(const std::vector<Tensor>& ps) {
  std::vector<Tensor> out;
  for (const auto& p : ps) {
    out.push_back(p.detach().clone().set_requires_grad(true));
  }
  return out;
}

// Deterministic grads for step i (times `mult`), in the params' dtype.
void set_grads(const std::vector<Tensor>& ps, int i, double mult = 1.0) {
  at::manual_seed(1000 + i);
  for (const auto& p : ps) {
    const_cast<Tensor&>(p).mutable_grad() = (at::randn(p.sizes()) * mult).to(p.scalar_type());
  }
}

double max_abs_diff(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    m = std::max(m, (a[i].to(at::kDouble) - b[i].to(at::kDouble)).abs().max().item<double>());
  }
  return m;
}

bool bits_equal(const Tensor& a, const Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         at::equal(a.contiguous().reshape(-1).view(at::kByte),
                   b.contiguous().reshape(-1).view(at::kByte));
}

// Every tensor an optimizer step could touch: params, then each param's state.
std::vector<Tensor> snapshot(const fo::Optimizer& opt) {
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

bool snapshots_equal(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
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

// Five steps of `opt` over ps, saved to an archive and loaded into `resumed` (over
// resumed_ps, which take ps's values then), then three more steps of both on the same
// gradients.
template <typename Opt>
void steps_save_resume(std::vector<Tensor>& ps, std::vector<Tensor>& resumed_ps, Opt& opt,
                       Opt& resumed) {
  for (int i = 0; i < 5; ++i) {
    set_grads(ps, i);
    opt.step();
  }
  std::stringstream buf;
  {
    torch::serialize::OutputArchive out;
    opt.save(out);
    out.save_to(buf);
  }
  for (size_t k = 0; k < ps.size(); ++k) {
    resumed_ps[k].detach().copy_(ps[k].detach());
  }
  {
    torch::serialize::InputArchive in;
    in.load_from(buf);
    resumed.load(in);
  }
  for (int i = 5; i < 8; ++i) {
    set_grads(ps, i);
    for (size_t k = 0; k < ps.size(); ++k) {
      resumed_ps[k].mutable_grad() = ps[k].grad().clone();
    }
    opt.step();
    resumed.step();
  }
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

namespace {

// Two groups, FP16 with master weights, a scaler, clipping, and an overflow every 7th step.
struct Trainer {
  std::vector<Tensor> ps;
  std::unique_ptr<fo::AdamW> opt;
  fusedamp::GradScaler scaler{fusedamp::GradScalerOptions().init_scale(2048).growth_interval(4)};
  explicit Trainer(std::vector<Tensor> params) : ps(std::move(params)) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<Tensor>{ps[0], ps[1]},
                        std::make_unique<fo::AdamOptions>(fo::AdamWOptions(1e-3).max_grad_norm(3.0)));
    groups.emplace_back(std::vector<Tensor>{ps[2], ps[3]},
                        std::make_unique<fo::AdamOptions>(
                            fo::AdamWOptions(5e-3).weight_decay(0.0).max_grad_norm(3.0)));
    opt = std::make_unique<fo::AdamW>(groups);
  }
  void run(int from, int to) {
    for (int i = from; i < to; ++i) {
      set_grads(ps, i, scaler.get_scale());
      if (i % 7 == 3) {
        ps[3].mutable_grad()[0][0] = INFINITY;
      }
      scaler.step(*opt);
      scaler.update();
    }
  }
};

}  // namespace

TEST_CASE("save -> load -> continue equals uninterrupted training, bit for bit", "[optim][io]") {
  Trainer full(make_params(at::kHalf, 11));
  full.run(0, 40);

  Trainer first(make_params(at::kHalf, 11));
  first.run(0, 20);
  std::stringstream buf;
  {
    torch::serialize::OutputArchive out;
    torch::serialize::OutputArchive o, s;
    first.opt->save(o);
    first.scaler.save(s);
    out.write("optimizer", o);
    out.write("scaler", s);
    out.save_to(buf);
  }
  // A new process: fresh optimizer and scaler on the checkpointed model weights.
  Trainer resumed(copies(first.ps));
  {
    torch::serialize::InputArchive in, o, s;
    in.load_from(buf);
    in.read("optimizer", o);
    in.read("scaler", s);
    resumed.opt->load(o);
    resumed.scaler.load(s);
  }
  resumed.run(20, 40);
  CHECK(full.opt->skipped_steps().item<int64_t>() == 6);
  CHECK(snapshots_equal(snapshot(*full.opt), snapshot(*resumed.opt)));
  CHECK(full.scaler.get_scale() == resumed.scaler.get_scale());
  CHECK(full.scaler.growth_tracker().item<int>() == resumed.scaler.growth_tracker().item<int>());
  CHECK(resumed.opt->skipped_steps().item<int64_t>() == 6);
  CHECK(resumed.opt->group_lr(1) == 5e-3);

  SECTION("the wrong optimizer kind is rejected") {
    fo::SGD sgd(copies(first.ps));
    torch::serialize::OutputArchive out;
    first.opt->save(out);
    std::stringstream b2;
    out.save_to(b2);
    torch::serialize::InputArchive in;
    in.load_from(b2);
    CHECK_THROWS_WITH(sgd.load(in), Catch::Contains("Adam"));
  }
}

TEST_CASE("bad input: c10::Error with a clear message, nothing modified", "[optim][bad-input]") {
  auto ps = make_params(at::kHalf);
  CHECK_THROWS_WITH(fo::AdamW(ps, fo::AdamWOptions(-1.0)), Catch::Contains("Invalid learning rate"));
  CHECK_THROWS_WITH(fo::Adam(ps, fo::AdamOptions(1e-3).betas({1.0, 0.999})),
                    Catch::Contains("Invalid beta parameter at index 0"));
  CHECK_THROWS_WITH(fo::Adam(ps, fo::AdamOptions(1e-3).betas({0.9, -0.1})),
                    Catch::Contains("Invalid beta parameter at index 1"));
  CHECK_THROWS_WITH(fo::SGD(ps, fo::SGDOptions(0.1).nesterov(true)), Catch::Contains("Nesterov"));
  CHECK_THROWS_WITH(fo::SGD(ps, fo::SGDOptions(0.1).weight_decay(-1)),
                    Catch::Contains("weight_decay"));
  CHECK_THROWS_WITH(fo::AdamW(ps, fo::AdamWOptions(1e-3).max_grad_norm(-2.0)),
                    Catch::Contains("max_grad_norm"));
  CHECK_THROWS_WITH(fo::AdamW(ps, fo::AdamWOptions(1e-3).lr_tensor(at::ones({2}))),
                    Catch::Contains("lr_tensor"));

  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<Tensor>{ps[0], ps[1]});
  groups.emplace_back(std::vector<Tensor>{ps[2], ps[3]});
  fo::AdamW opt(groups, fo::AdamWOptions(1e-3));
  set_grads(ps, 0);
  opt.step();
  const auto before = snapshot(opt);

  SECTION("an invalid lr pushed by a scheduler") {
    opt.set_group_option(1, "lr", -0.5);
    set_grads(ps, 1);
    CHECK_THROWS_WITH(opt.step(), Catch::Contains("Invalid learning rate"));
    CHECK(snapshots_equal(before, snapshot(opt)));
    opt.set_group_option(1, "lr", 1e-3);
    opt.step();
    CHECK_FALSE(snapshots_equal(before, snapshot(opt)));
  }
  SECTION("a sparse gradient in the second group") {
    set_grads(ps, 1);
    ps[2].mutable_grad() = at::ones({1}).to(at::kHalf).to_sparse();
    CHECK_THROWS_WITH(opt.step(), Catch::Contains("sparse"));
    CHECK(snapshots_equal(before, snapshot(opt)));
  }
  SECTION("a gradient of the wrong shape or dtype") {
    set_grads(ps, 1);
    ps[3].mutable_grad() = at::ones({17, 64}, at::kHalf);
    CHECK_THROWS_WITH(opt.step(), Catch::Contains("shape"));
    ps[3].mutable_grad() = at::ones({64, 17}, at::kBFloat16);
    CHECK_THROWS_WITH(opt.step(), Catch::Contains("dtype"));
    CHECK(snapshots_equal(before, snapshot(opt)));
  }
  SECTION("unknown options and groups") {
    CHECK_THROWS_WITH(opt.set_group_option(0, "momentum", 0.9), Catch::Contains("unknown option"));
    CHECK_THROWS_WITH(opt.set_group_lr(5, 0.1), Catch::Contains("does not exist"));
  }
  SECTION("set_param_state checks before replacing") {
    auto bad = opt.param_state(ps[0]);
    bad[fo::kExpAvg] = at::zeros({3});
    CHECK_THROWS_WITH(opt.set_param_state(ps[0], bad), Catch::Contains("shape"));
    CHECK_THROWS_WITH(opt.set_param_state(at::ones({2}), {}), Catch::Contains("not a parameter"));
    CHECK(snapshots_equal(before, snapshot(opt)));
  }
}

TEST_CASE("set_param_state/param_state round trip", "[optim][io]") {
  auto a = make_params(at::kBFloat16), b = copies(a);
  fo::AdamW x(a, fo::AdamWOptions(1e-3)), y(b, fo::AdamWOptions(1e-3));
  for (int i = 0; i < 3; ++i) {
    set_grads(a, i);
    x.step();
  }
  for (size_t k = 0; k < a.size(); ++k) {
    b[k].detach().copy_(a[k].detach());
    y.set_param_state(b[k], x.param_state(a[k]));
  }
  set_grads(a, 3);
  set_grads(b, 3);
  x.step();
  y.step();
  CHECK(snapshots_equal(snapshot(x), snapshot(y)));
}

TEST_CASE("master_weights kSplit from C++: weight + remainder is kFp32's master",
          "[optim][master][split]") {
  auto ps = make_params(at::kBFloat16);
  auto split_ps = copies(ps);
  fo::AdamW fp32_opt(ps, fo::AdamWOptions(1e-2));
  fo::AdamW split_opt(split_ps, fo::AdamWOptions(1e-2)
                                    .master_weights(fo::MasterWeights::kSplit)
                                    .state_dtype(at::kFloat));
  for (int i = 0; i < 50; ++i) {
    set_grads(ps, i);
    for (size_t k = 0; k < ps.size(); ++k) {
      split_ps[k].mutable_grad() = ps[k].grad().clone();
    }
    fp32_opt.step();
    split_opt.step();
  }
  for (size_t k = 0; k < ps.size(); ++k) {
    const auto state = split_opt.param_state(split_ps[k]);
    REQUIRE(state.count(fo::kParamRemainder) == 1);
    REQUIRE(state.count(fo::kMasterParam) == 0);
    // The pair as FP32 bits: weight pattern << 16 plus the signed remainder.
    const auto high = split_ps[k].detach().view(at::kShort).to(at::kInt).bitwise_left_shift(16);
    const auto rebuilt = (high + state.at(fo::kParamRemainder).to(at::kInt)).view(at::kFloat);
    const auto master = fp32_opt.param_state(ps[k]).at(fo::kMasterParam);
    CHECK(at::equal(rebuilt.view(at::kInt), master.view(at::kInt)));
  }
  // A mode that does not fit FP16 weights is refused before anything changes.
  auto half = make_params(at::kHalf);
  fo::SGD refused(half, fo::SGDOptions(0.1).master_weights(fo::MasterWeights::kStochastic));
  set_grads(half, 0);
  const auto before = half[0].detach().clone();
  CHECK_THROWS_WITH(refused.step(), Catch::Contains("keeps bfloat16 weights"));
  CHECK(at::equal(half[0].detach(), before));
}

TEST_CASE("convert_param_state: FP32 master -> split -> FP32 master, bit for bit",
          "[optim][master][convert]") {
  auto ps = make_params(at::kBFloat16);
  fo::AdamW opt(ps, fo::AdamWOptions(1e-2));
  for (int i = 0; i < 5; ++i) {
    set_grads(ps, i);
    opt.step();
  }
  for (const auto& p : ps) {
    const auto saved = opt.param_state(p);
    const auto saved_copy = saved.at(fo::kMasterParam).clone();
    const auto split =
        fo::convert_param_state(p, saved, fo::MasterWeights::kSplit, at::kBFloat16);
    CHECK(split.state.count(fo::kMasterParam) == 0);
    REQUIRE(split.state.count(fo::kParamRemainder) == 1);
    CHECK(split.state.at(fo::kExpAvg).scalar_type() == at::kBFloat16);
    const auto back = fo::convert_param_state(split.weight, split.state, fo::MasterWeights::kFp32,
                                              at::kFloat);
    CHECK(at::equal(back.state.at(fo::kMasterParam).view(at::kInt), saved_copy.view(at::kInt)));
    // Only the weights whose master lies halfway may have moved (by one ulp), and the inputs
    // are untouched.
    CHECK(at::equal(saved.at(fo::kMasterParam), saved_copy));
    CHECK(split.weight.to(at::kFloat).sub(p.detach().to(at::kFloat)).abs().le(
        p.detach().to(at::kFloat).abs().mul(1.0 / 128)).all().item<bool>());
  }
  // A state that does not belong beside the weight: the parameter's index in the message.
  auto half = make_params(at::kHalf);
  CHECK_THROWS_WITH(fo::convert_param_state(half[0], {{fo::kStep, at::zeros({})}},
                                            fo::MasterWeights::kSplit, at::kFloat, 7),
                    Catch::Contains("parameter 7"));
}

TEST_CASE("state_dtype kChar from C++ (split and split8 masters): saved and resumed bit for bit",
          "[optim][int8]") {
  for (const auto mode : {fo::MasterWeights::kSplit, fo::MasterWeights::kSplit8}) {
    auto ps = make_params(at::kBFloat16);
    auto resumed_ps = copies(ps);
    const auto options = fo::AdamWOptions(1e-2).master_weights(mode).state_dtype(at::kChar);
    fo::AdamW opt(ps, options);
    fo::AdamW resumed(resumed_ps, options);
    steps_save_resume(ps, resumed_ps, opt, resumed);
    for (const auto& p : ps) {
      const auto state = opt.param_state(p);
      CHECK(state.at(fo::kExpAvg).scalar_type() == at::kChar);
      CHECK(state.at(fo::kExpAvgSq).scalar_type() == at::kByte);
      const auto& scales = state.at(fo::kMomentScales);
      CHECK(scales.scalar_type() == at::kFloat);
      CHECK(scales.sizes() == at::IntArrayRef({(p.numel() + 31) / 32, 2}));
    }
    CHECK(snapshots_equal(snapshot(opt), snapshot(resumed)));
    for (size_t k = 0; k < ps.size(); ++k) {
      const auto remainder = opt.param_state(ps[k]).at(fo::kParamRemainder);
      CHECK(remainder.scalar_type() ==
            (mode == fo::MasterWeights::kSplit8 ? at::kChar : at::kShort));
      CHECK(bits_equal(remainder, resumed.param_state(resumed_ps[k]).at(fo::kParamRemainder)));
    }
  }
  auto ps = make_params(at::kBFloat16);
  CHECK_THROWS_WITH(fo::Adam(ps, fo::AdamOptions(1e-3).amsgrad(true).state_dtype(at::kChar)),
                    Catch::Contains("AMSGrad"));
}

TEST_CASE("SGD with state_dtype kChar from C++: an 8-bit buffer, saved and resumed bit for bit",
          "[optim][int8]") {
  auto ps = make_params(at::kBFloat16);
  auto resumed_ps = copies(ps);
  const auto options = fo::SGDOptions(0.05).momentum(0.9).nesterov(true).master_weights(
      fo::MasterWeights::kSplit8).state_dtype(at::kChar);
  fo::SGD opt(ps, options);
  fo::SGD resumed(resumed_ps, options);
  steps_save_resume(ps, resumed_ps, opt, resumed);
  for (const auto& p : ps) {
    const auto state = opt.param_state(p);
    CHECK(state.at(fo::kMomentumBuffer).scalar_type() == at::kChar);
    const auto& scales = state.at(fo::kMomentumScales);
    CHECK(scales.scalar_type() == at::kFloat);
    CHECK(scales.sizes() == at::IntArrayRef(fo::momentum_scales_shape(p)));
    CHECK(scales.numel() == (p.numel() + 31) / 32);
  }
  // The snapshots hold the codes and scales: their bits, and the weights', are equal.
  CHECK(snapshots_equal(snapshot(opt), snapshot(resumed)));
}

TEST_CASE("every mode of kMasterModes: its names and code parse, a BF16 step keeps its store",
          "[optim][master]") {
  for (const auto& info : fusedamp::kMasterModes) {
    if (info.spelling == nullptr) {  // a kernel variant: no value of the option
      CHECK_THROWS_WITH(fo::MasterWeights::from_code(static_cast<double>(info.mode)),
                        Catch::Contains("master_weights must be"));
      continue;
    }
    const fo::MasterWeights mode(info.mode);
    CHECK(fo::MasterWeights::from_code(static_cast<double>(info.mode)) == mode);
    for (const char* name : info.names) {
      if (name != nullptr) {
        CHECK(fo::MasterWeights::from_name(name) == mode);
      }
    }
    CHECK(std::string(mode.name()) == info.spelling);
    CHECK_THAT(fo::MasterWeights::choices(), Catch::Contains(info.spelling));
    CHECK(mode.fits(at::kFloat));
    CHECK(mode.fits(at::kHalf) == info.fits_half);
    if (!info.fits_bfloat16) {
      continue;
    }
    auto ps = make_params(at::kBFloat16);
    fo::AdamW opt(ps, fo::AdamWOptions(1e-2).master_weights(mode));
    set_grads(ps, 0);
    opt.step();
    const auto state = opt.param_state(ps[1]);
    const std::pair<fusedamp::MasterKept, const char*> slots[] = {
        {fusedamp::MasterKept::kFp32Master, fo::kMasterParam},
        {fusedamp::MasterKept::kRemainder, fo::kParamRemainder},
        {fusedamp::MasterKept::kCompensation, fo::kKahanCompensation}};
    for (const auto& [kept, slot] : slots) {
      INFO(info.spelling << " " << slot);
      REQUIRE(state.count(slot) == (info.kept == kept ? 1u : 0u));
      if (info.kept == kept) {
        CHECK(state.at(slot).scalar_type() == (kept == fusedamp::MasterKept::kCompensation
                                                   ? at::kBFloat16
                                                   : info.kept_dtype));
      }
    }
  }
  CHECK_THROWS_WITH(fo::MasterWeights::from_name("split16"),
                    Catch::Contains("master_weights must be"));
}
