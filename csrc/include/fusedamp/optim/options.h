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
#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>

namespace fusedamp::optim {

// How an optimizer keeps FP16/BF16 weights (FP32 parameters need nothing): converts from bool
// (true = kFp32, false = kOff), so options.master_weights(true) reads as before.
//   kOff         the weight alone, updated in FP32 and rounded to nearest (updates below half
//                an ulp are lost)
//   kFp32        an FP32 master copy (+4 B/param); the weight is its rounding
//   kSplit       BF16 only: an int16 remainder (+2 B/param); weight + remainder is exactly the
//                FP32 master of kFp32 (math/split_math.h; the weight differs from kFp32's only
//                where the master lies exactly halfway between two BF16 values)
//   kSplit8      BF16 only: an int8 remainder (+1 B/param); weight + remainder is a 24-bit
//                master (16 significant bits): the FP32 result of each step rounded to nearest
//                24 bits (math/split_math.h)
//   kKahan       a compensation buffer of the weight's dtype (+2 B/param) carrying what
//                rounding dropped (math/kahan_math.h)
//   kStochastic  BF16 only: no extra state; the weight is rounded stochastically, reproducibly
//                from rounding_seed (math/stochastic_rounding_math.h)
class MasterWeights {
 public:
  enum Kind : uint8_t {
    kOff = 0,
    kFp32 = 1,
    kSplit = 2,
    kKahan = 3,
    kStochastic = 4,
    kSplit8 = 5
  };

  constexpr MasterWeights(bool fp32_master = true) : kind_(fp32_master ? kFp32 : kOff) {}
  constexpr MasterWeights(Kind kind) : kind_(kind) {}

  constexpr Kind kind() const { return kind_; }
  constexpr bool operator==(const MasterWeights& o) const { return kind_ == o.kind_; }
  constexpr bool operator!=(const MasterWeights& o) const { return kind_ != o.kind_; }
  // Whether FP16/BF16 weights keep state besides themselves.
  constexpr bool keeps_state() const {
    return kind_ == kFp32 || kind_ == kSplit || kind_ == kSplit8 || kind_ == kKahan;
  }
  // Whether the mode exists for parameters of this dtype (FP32 parameters: every mode, as
  // nothing is kept for them).
  bool fits(at::ScalarType param_dtype) const;
  // Python's spelling: "True", "False", "split", "split8", "kahan", "stochastic".
  const char* name() const;
  // From the number set_group_option and archives carry (0..5); throws c10::ValueError.
  static MasterWeights from_code(double code);
  // From "split", "split8", "kahan", "stochastic", "fp32" or "float32" (= true) and "off"
  // (= false);
  // throws c10::ValueError.
  static MasterWeights from_name(const std::string& name);

 private:
  Kind kind_;
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
