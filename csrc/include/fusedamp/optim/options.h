#pragma once
// Fields every fusedamp optimizer's options carry, on top of the algorithm's own
// hyper-parameters (declared with TORCH_ARG, so they chain like torch::optim's options):
//   master_weights  how FP16/BF16 parameters keep the bits below their weights between steps
//                   (MasterWeights below; default true: an FP32 master copy)
//   state_dtype     the optimizer state (moments, momentum buffers): at::kFloat (default) or
//                   at::kBFloat16 (half the bytes; rounded to nearest at every step)
//   rounding_seed   master_weights kStochastic: the seed of the rounding's random bits (with
//                   the parameter's index, its step count and the element's index)
//   max_grad_norm   clip the global gradient norm (all groups' grads) to this value, fused
//                   into the step (clip_grad_norm_'s formula); nullopt: no clipping
//   skip_nonfinite  without a loss scaler, skip the step when a gradient holds inf/NaN
//                   (with a scaler every step is checked anyway)
//   lr_tensor       an FP32 one-element device tensor that overrides lr (CUDA-graph friendly)
//   adopt_param_edits  masters follow edits of the model's weights: where a weight is no longer
//                   its master's rounding, the step starts from the weight (default true;
//                   +2 B/param read at FP16)
//   write_back_grads   after a scaled or clipped step, .grad holds the gradient the update used
//                   (unscaled, clipped), as torch's fused optimizers leave it (default true;
//                   +2 B/param written at FP16)
#include <ATen/core/Tensor.h>
#include <fusedamp/master_modes.h>
#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>

namespace fusedamp::optim {

// How an optimizer keeps FP16/BF16 weights (FP32 parameters need nothing): one of the modes of
// fusedamp/master_modes.h, which says what each keeps and which weights it serves. Converts
// from bool (true = kFp32, false = kOff), so options.master_weights(true) reads as a flag.
class MasterWeights : public MasterModes {
 public:
  using Kind = MasterMode;

  constexpr MasterWeights(bool fp32_master = true) : kind_(fp32_master ? kFp32 : kOff) {}
  constexpr MasterWeights(Kind kind) : kind_(kind) {}

  constexpr Kind kind() const { return kind_; }
  constexpr const MasterModeInfo& info() const { return master_mode_info(kind_); }
  constexpr bool operator==(const MasterWeights& o) const { return kind_ == o.kind_; }
  constexpr bool operator!=(const MasterWeights& o) const { return kind_ != o.kind_; }
  // Whether FP16/BF16 weights keep state besides themselves.
  constexpr bool keeps_state() const { return info().kept != MasterKept::kNothing; }
  // Whether the mode exists for parameters of this dtype (FP32 parameters: every mode, as
  // nothing is kept for them).
  bool fits(at::ScalarType param_dtype) const;
  // Python's spelling: True, False, "split", ...
  const char* name() const;
  // Every mode with its spelling and what it keeps, for messages; with `taken`, those it holds
  // for.
  static std::string choices(bool (*taken)(Kind) = nullptr);
  // From the number set_group_option and archives carry (the mode's code); throws
  // c10::ValueError.
  static MasterWeights from_code(double code);
  // From one of a mode's names (MasterModeInfo::names: "split", "fp32", "off", ...); throws
  // c10::ValueError.
  static MasterWeights from_name(const std::string& name);

 private:
  Kind kind_;
};

// The engine settings every options struct carries (read per group).
struct EngineGroupOptions {
  MasterWeights master_weights = true;
  at::ScalarType state_dtype = at::kFloat;
  int64_t rounding_seed = 0;
  std::optional<double> max_grad_norm;
  bool skip_nonfinite = true;
  at::Tensor lr_tensor;  // undefined: use the numeric lr
  bool adopt_param_edits = true;
  bool write_back_grads = true;
};

// What an option's number (set_group_option, group_option) stands for: how archives keep it
// and Python spells it.
enum class OptionForm : uint8_t {
  kNumber,         // a float (a double in archives)
  kFlag,           // True/False as 1/0 (a bool in archives)
  kInteger,        // a whole number (an int64 in archives)
  kMasterWeights,  // a MasterWeights mode's code (an int64 in archives)
  kDtype,          // an at::ScalarType's code (an int64 in archives)
  kNumberOrNone,   // a float or none (absent from archives; 0 to group_option)
};

// An option of a param group and its value in some options (none: a kNumberOrNone holding
// none).
struct OptionValue {
  const char* name;
  OptionForm form;
  std::optional<double> value;
};

}  // namespace fusedamp::optim

#define FUSEDAMP_ENGINE_OPTION_FIELDS                            \
  TORCH_ARG(::fusedamp::optim::MasterWeights, master_weights) = true; \
  TORCH_ARG(at::ScalarType, state_dtype) = at::kFloat;           \
  TORCH_ARG(int64_t, rounding_seed) = 0;                         \
  TORCH_ARG(std::optional<double>, max_grad_norm) = std::nullopt; \
  TORCH_ARG(bool, skip_nonfinite) = true;                        \
  TORCH_ARG(bool, adopt_param_edits) = true;                     \
  TORCH_ARG(bool, write_back_grads) = true;                      \
  TORCH_ARG(at::Tensor, lr_tensor)

// The learning rate, every options struct's first constructor argument as in torch::optim
// (SGDOptions(lr)): the constructor and the field, with the algorithm's default once.
#define FUSEDAMP_LR_OPTION(Options, default_lr)                                      \
  Options(double lr = default_lr) : lr_(lr) {} /* NOLINT(google-explicit-constructor) */ \
  TORCH_ARG(double, lr) = default_lr

// The torch::optim::OptimizerOptions overrides every fusedamp options struct has (the struct
// names its learning rate lr_; serialize() is defined next to the algorithm).
#define FUSEDAMP_OPTIONS_OVERRIDES                                                 \
 public:                                                                          \
  void serialize(torch::serialize::InputArchive& archive) override;              \
  void serialize(torch::serialize::OutputArchive& archive) const override;       \
  double get_lr() const override {                                                \
    return lr_;                                                                   \
  }                                                                               \
  void set_lr(const double lr) override {                                         \
    lr_ = lr;                                                                     \
  }
