// fusedamp::optim's option tables (csrc/engine/option_table.h, shared_options.h): every option
// a kind's param groups take, by name, through set_group_option, archives (each with its key
// and IValue type) and default_option_values.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <fusedamp/fusedamp.h>
#include <torch/serialize/archive.h>

#include <map>
#include <optional>
#include <string>

#include "optim_test_util.h"

using namespace optim_test;

namespace {

// The options every kind shares, each with a value other than its default, and the IValue
// type its archive key holds.
struct SharedOption {
  const char* name;
  double value;
  bool (c10::IValue::*is)() const;
};
const SharedOption kShared[] = {
    {"lr", 0.25, &c10::IValue::isDouble},
    {"weight_decay", 0.125, &c10::IValue::isDouble},
    {"maximize", 1.0, &c10::IValue::isBool},
    {"master_weights", static_cast<double>(fo::MasterWeights::kKahan), &c10::IValue::isInt},
    {"state_dtype", static_cast<double>(at::kBFloat16), &c10::IValue::isInt},
    {"rounding_seed", 12345.0, &c10::IValue::isInt},
    {"skip_nonfinite", 0.0, &c10::IValue::isBool},
    {"adopt_param_edits", 0.0, &c10::IValue::isBool},
    {"write_back_grads", 0.0, &c10::IValue::isBool},
    {"max_grad_norm", 2.5, &c10::IValue::isDouble},
};

}  // namespace

TEST_CASE("the shared options survive an archive under their keys and types",
          "[optim][checkpoint]") {
  fo::SGD saved(make_params(at::kFloat));
  for (const auto& option : kShared) {
    saved.set_group_option(0, option.name, option.value);
  }
  fo::SGDOptions written_options = saved.group_options(0);
  torch::serialize::OutputArchive written;
  written_options.serialize(written);
  torch::serialize::InputArchive read;
  read_back(written, read);
  fo::SGDOptions loaded;
  loaded.serialize(read);
  c10::IValue v;
  for (const auto& option : kShared) {
    INFO(option.name);
    REQUIRE(read.try_read(option.name, v));
    CHECK((v.*option.is)());
  }
  CHECK(loaded.lr() == 0.25);
  CHECK(loaded.weight_decay() == 0.125);
  CHECK(loaded.maximize());
  CHECK(loaded.master_weights() == fo::MasterWeights(fo::MasterWeights::kKahan));
  CHECK(loaded.state_dtype() == at::kBFloat16);
  CHECK(loaded.rounding_seed() == 12345);
  CHECK(!loaded.skip_nonfinite());
  CHECK(!loaded.adopt_param_edits());
  CHECK(!loaded.write_back_grads());
  CHECK(loaded.max_grad_norm() == std::optional<double>(2.5));
}

TEST_CASE("an archive from before the later options reads their defaults",
          "[optim][checkpoint]") {
  // What the first archives held: master_weights a flag, no state_dtype, rounding_seed,
  // adopt_param_edits, write_back_grads, max_grad_norm (clipping off) or amsgrad.
  torch::serialize::OutputArchive written;
  written.write("lr", c10::IValue(0.5));
  written.write("weight_decay", c10::IValue(0.0));
  written.write("maximize", c10::IValue(false));
  written.write("master_weights", c10::IValue(false));
  written.write("skip_nonfinite", c10::IValue(true));
  written.write("beta1", c10::IValue(0.8));
  written.write("beta2", c10::IValue(0.9));
  written.write("eps", c10::IValue(1e-6));
  written.write("decoupled_weight_decay", c10::IValue(true));
  torch::serialize::InputArchive read;
  read_back(written, read);
  fo::AdamOptions loaded;
  loaded.state_dtype(at::kBFloat16).rounding_seed(7).max_grad_norm(1.0).amsgrad(true);
  loaded.adopt_param_edits(false).write_back_grads(false);
  loaded.serialize(read);
  CHECK(loaded.lr() == 0.5);
  CHECK(loaded.master_weights() == fo::MasterWeights(false));
  CHECK(loaded.state_dtype() == at::kFloat);
  CHECK(loaded.rounding_seed() == 0);
  CHECK(!loaded.max_grad_norm().has_value());
  CHECK(loaded.adopt_param_edits());
  CHECK(loaded.write_back_grads());
  CHECK(!loaded.amsgrad());
  CHECK(loaded.decoupled_weight_decay());
  CHECK(loaded.eps() == 1e-6);
}

TEST_CASE("a kind's option values are its table with its defaults", "[optim]") {
  fo::AdamW adamw(make_params(at::kFloat));
  std::map<std::string, fo::OptionValue> by_name;
  const auto values = adamw.default_option_values();
  for (const auto& option : values) {
    by_name.emplace(option.name, option);
    INFO(option.name);
    if (option.value) {  // every option it names is one group_option reads, at the default
      CHECK(adamw.group_option(0, option.name) == *option.value);
    }
  }
  CHECK(by_name.size() == values.size());  // each name once
  for (const auto& option : kShared) {  // the shared ones and Adam's own
    CHECK(by_name.count(option.name) == 1);
  }
  for (const char* own : {"beta1", "beta2", "eps", "decoupled_weight_decay", "amsgrad"}) {
    CHECK(by_name.count(own) == 1);
  }
  CHECK(by_name.at("weight_decay").value == std::optional<double>(1e-2));
  CHECK(by_name.at("decoupled_weight_decay").form == fo::OptionForm::kFlag);
  CHECK(by_name.at("master_weights").form == fo::OptionForm::kMasterWeights);
  CHECK(!by_name.at("max_grad_norm").value.has_value());  // no clipping: none, not 0
  CHECK(by_name.at("max_grad_norm").form == fo::OptionForm::kNumberOrNone);
}

TEST_CASE("clear_group_option empties only an option that may be none", "[optim]") {
  fo::SGD sgd(make_params(at::kFloat), fo::SGDOptions(0.1));
  const auto norm = [&] {
    return static_cast<const fo::SGDOptions&>(sgd.param_groups()[0].options()).max_grad_norm();
  };
  sgd.set_group_option(0, "max_grad_norm", 2.5);
  CHECK(norm() == std::optional<double>(2.5));
  sgd.clear_group_option(0, "max_grad_norm");
  CHECK(!norm().has_value());
  sgd.set_group_max_grad_norm(0, 1.5);
  CHECK(norm() == std::optional<double>(1.5));
  CHECK_THROWS_WITH(sgd.clear_group_option(0, "lr"), Catch::Contains("'lr' cannot be none"));
  CHECK_THROWS_WITH(sgd.clear_group_option(0, "no_such"), Catch::Contains("unknown option"));
  CHECK(sgd.group_lr(0) == 0.1);
  CHECK(norm() == std::optional<double>(1.5));  // a refused clear changes nothing
}
