// fusedamp::optim from C++, its state: save/load/continue bit-exact, bad input, the
// per-parameter state and its conversions, every master-weight mode and the 8-bit formats.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <fusedamp/fusedamp.h>
#include <torch/serialize/archive.h>

#include <cmath>
#include <sstream>
#include <utility>

#include "optim_test_util.h"

using namespace optim_test;

namespace {

// Two optimizers of type Opt with the same options over BF16 params: five steps of `opt`
// over ps, saved to an archive and loaded into `resumed` (over resumed_ps, which take ps's
// values then), then three more steps of both on the same gradients.
template <typename Opt>
struct SavedAndResumed {
  std::vector<Tensor> ps = make_params(at::kBFloat16);
  std::vector<Tensor> resumed_ps = copies(ps);
  Opt opt;
  Opt resumed;

  template <typename Options>
  explicit SavedAndResumed(const Options& options)
      : opt(ps, options), resumed(resumed_ps, options) {
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
      step_both(i, ps, opt, resumed_ps, resumed);
    }
  }
};

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
    step_both(i, ps, fp32_opt, split_ps, split_opt);
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
    SavedAndResumed<fo::AdamW> run(
        fo::AdamWOptions(1e-2).master_weights(mode).state_dtype(at::kChar));
    const auto& [ps, resumed_ps, opt, resumed] = run;
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
  SavedAndResumed<fo::SGD> run(fo::SGDOptions(0.05).momentum(0.9).nesterov(true).master_weights(
      fo::MasterWeights::kSplit8).state_dtype(at::kChar));
  const auto& [ps, resumed_ps, opt, resumed] = run;
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
      auto ps = make_params(at::kBFloat16);
      CHECK_THROWS_WITH(fo::AdamW(ps, fo::AdamWOptions(1e-2).master_weights(info.mode)),
                        Catch::Contains("Invalid master_weights"));
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

// Every kind's own options (its option table, engine/option_table.h) through an archive: each
// set to a value other than its default comes back.
template <typename Kind>
void check_options_survive_an_archive(
    const std::vector<std::pair<std::string, double>>& options) {
  Kind saved(make_params(at::kFloat));
  for (const auto& [name, value] : options) {
    saved.set_group_option(0, name, value);
  }
  torch::serialize::OutputArchive out;
  saved.save(out);
  torch::serialize::InputArchive in;
  read_back(out, in);
  Kind loaded(make_params(at::kFloat));
  loaded.load(in);
  for (const auto& [name, value] : options) {
    INFO(name);
    CHECK(loaded.group_option(0, name) == value);
  }
}

TEST_CASE("each kind's own options survive an archive", "[optim][checkpoint]") {
  check_options_survive_an_archive<fo::Adam>({{"beta1", 0.8}, {"beta2", 0.95}, {"eps", 1e-6},
                                              {"decoupled_weight_decay", 1.0},
                                              {"amsgrad", 1.0}});
  check_options_survive_an_archive<fo::SGD>({{"momentum", 0.5}, {"nesterov", 1.0}});
  check_options_survive_an_archive<fo::Lion>({{"beta1", 0.8}, {"beta2", 0.95}});
}
