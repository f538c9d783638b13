// Exits non-zero unless the installed fusedamp works from a separate executable: the operators
// are registered (the library was not dropped by the linker), and one scaled FP16 AdamW step
// with master weights runs through the C++ API, recorded by the scaler's telemetry.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <fusedamp/fusedamp.h>

#include <cstdio>

int main() {
  int failures = 0;
  auto expect = [&](bool ok, const char* what) {
    std::printf("%s %s\n", ok ? "ok  " : "FAIL", what);
    failures += ok ? 0 : 1;
  };
  for (const char* op : {"fusedamp::unscale_and_check_", "fusedamp::grad_stats_",
                         "fusedamp::update_scale_", "fusedamp::adam_step_",
                         "fusedamp::sgd_step_"}) {
    expect(c10::Dispatcher::singleton().findSchema({op, ""}).has_value(), op);
  }
  try {
    auto w = at::full({4}, 1.0, at::kHalf).set_requires_grad(true);
    fusedamp::optim::AdamW opt({w}, fusedamp::optim::AdamWOptions(0.1).weight_decay(0.0));
    fusedamp::GradScaler scaler(fusedamp::GradScalerOptions().init_scale(128));
    auto loss = (w.to(at::kFloat) * 2).sum();
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
    expect(opt.last_step_applied().item<float>() == 1.f, "the step was applied");
    // Adam's first step moves every weight by lr against the gradient's sign.
    expect(at::allclose(w.to(at::kFloat), at::full({4}, 0.9f), 0, 1e-3), "weights 1 -> 0.9");
    expect(opt.param_state(w).count("master_param") == 1, "FP32 master weights kept");
    expect(scaler.get_scale() == 128.0, "scale unchanged after a clean step");
    // The gradient (2 per weight, scaled by 128) as the scaler's telemetry recorded it.
    const fusedamp::TelemetryLog log = scaler.telemetry();
    expect(log.step.size() == 1 && log.amax[0] == 256.0 && !log.found_inf[0],
           "telemetry recorded the iteration");
  } catch (const c10::Error& e) {
    std::printf("FAIL %s\n", e.what_without_backtrace());
    ++failures;
  }
  std::printf("%s\n", failures == 0 ? "consumer: all good" : "consumer: FAILED");
  return failures == 0 ? 0 : 1;
}
