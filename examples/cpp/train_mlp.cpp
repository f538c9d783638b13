// Trains a small MLP on a synthetic classification task (Gaussian clusters it generates) in
// FP16 and in BF16 with FP32 master weights, with fusedamp's fused AdamW and GradScaler.
// FP16 uses dynamic loss scaling (started deliberately high, so the first steps overflow and
// are skipped while the scale backs off); BF16 needs no scaling, but a non-finite gradient
// would still skip the step. Prints loss, accuracy, scale and skipped steps per epoch.
#include <fusedamp/fusedamp.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdio>
#include <string>

namespace {

constexpr int64_t kFeatures = 32, kClasses = 8, kSamples = 8192, kBatch = 256, kEpochs = 6;

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(kFeatures, 256))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({256})))),
        fc2(register_module("fc2", torch::nn::Linear(256, 256))),
        out(register_module("out", torch::nn::Linear(256, kClasses))) {}

  // x in the model dtype. The LayerNorm stays FP32 (convert_module keeps it), so it gets FP32
  // input; the logits are returned in FP32 for the loss.
  at::Tensor forward(const at::Tensor& x) {
    const auto dtype = x.scalar_type();
    auto h = fc1(x).relu();
    h = norm(h.to(at::kFloat)).to(dtype);
    h = fc2(h).relu();
    return out(h).to(at::kFloat);
  }

  torch::nn::Linear fc1, fc2, out;
  torch::nn::LayerNorm norm;
};
TORCH_MODULE(Mlp);

// Cluster centres per class; samples are centre + noise.
std::pair<at::Tensor, at::Tensor> make_data(const c10::Device& device) {
  at::manual_seed(0);
  const auto centres = at::randn({kClasses, kFeatures}) * 0.6;
  const auto labels = at::randint(kClasses, {kSamples}, at::kLong);
  const auto x = centres.index_select(0, labels) + at::randn({kSamples, kFeatures}) * 2.0;
  return {x.to(device), labels.to(device)};
}

void train(at::ScalarType dtype, const c10::Device& device) {
  std::printf("\n== %s with FP32 master weights on %s ==\n", c10::toString(dtype),
              device.str().c_str());
  const auto [x, y] = make_data(device);
  at::manual_seed(1);
  Mlp model;
  model->to(device);
  fusedamp::convert_module(*model, dtype);  // the LayerNorm stays FP32

  fusedamp::optim::AdamW opt(model->parameters(),
                             fusedamp::optim::AdamWOptions(2e-3).weight_decay(1e-2).max_grad_norm(
                                 5.0));
  const bool fp16 = dtype == at::kHalf;
  fusedamp::GradScaler scaler(fusedamp::GradScalerOptions()
                                  .enabled(fp16)  // BF16 needs no loss scaling
                                  .init_scale(std::ldexp(1.0, 24))
                                  .growth_interval(100));

  std::printf("%5s %10s %8s %12s %8s\n", "epoch", "loss", "acc", "scale", "skipped");
  for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
    const auto perm = at::randperm(kSamples, at::TensorOptions().dtype(at::kLong).device(device));
    auto loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
    auto correct = at::zeros({}, at::TensorOptions().dtype(at::kLong).device(device));
    for (int64_t b = 0; b < kSamples; b += kBatch) {
      const auto idx = perm.slice(0, b, b + kBatch);
      const auto xb = x.index_select(0, idx).to(dtype);
      const auto yb = y.index_select(0, idx);
      opt.zero_grad();
      at::Tensor logits, loss;
      {
        // What torch's autocast keeps in FP32 (the loss, on CUDA also softmax and norms) runs
        // in FP32; the FP16/BF16 layers stay as they are.
        fusedamp::AutocastGuard autocast(device.type(), dtype);
        logits = model->forward(xb);
        loss = torch::nn::functional::cross_entropy(logits, yb);
      }
      scaler.scale(loss).backward();
      scaler.step(opt);  // no host sync
      scaler.update();
      loss_sum += loss.detach();
      correct += logits.argmax(1).eq(yb).sum();
    }
    // Reading values syncs once per epoch: the caller's choice.
    std::printf("%5lld %10.4f %8.3f %12.0f %8lld\n", static_cast<long long>(epoch),
                loss_sum.item<float>() / (kSamples / kBatch),
                correct.item<int64_t>() / static_cast<double>(kSamples), scaler.get_scale(),
                static_cast<long long>(opt.skipped_steps().item<int64_t>()));
  }
  if (fp16) {
    // What the scaler recorded of every iteration (one sync): why the first steps were skipped.
    const fusedamp::TelemetryLog log = scaler.telemetry();
    int64_t overflows = 0;
    std::string first_overflow = "-";
    for (size_t i = 0; i < log.step.size(); ++i) {
      if (!log.found_inf[i]) {
        continue;
      }
      if (overflows++ == 0 && log.first_nonfinite[i].defined()) {
        for (const auto& named : model->named_parameters()) {
          if (named.value().is_same(log.first_nonfinite[i])) {
            first_overflow = named.key();
          }
        }
      }
    }
    std::printf("telemetry: %zu iterations, %lld overflowed (the first in %s); last: amax %.1f, "
                "%.3f%% of the gradients zero or subnormal\n",
                log.step.size(), static_cast<long long>(overflows), first_overflow.c_str(),
                log.amax.back(), 100.0 * log.underflow_fraction.back());
  }
}

}  // namespace

int main() {
  const c10::Device device = torch::cuda::is_available() ? c10::Device(c10::kCUDA, 0)
                                                         : c10::Device(c10::kCPU);
  train(at::kHalf, device);
  train(at::kBFloat16, device);
  return 0;
}
