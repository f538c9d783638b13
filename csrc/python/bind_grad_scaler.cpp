// Bindings of fusedamp::GradScaler: what fusedamp.GradScaler (python/fusedamp/grad_scaler.py)
// relays. Python optimizers are identified by their id() within an iteration.
#include <fusedamp/grad_scaler.h>

#include "bindings.h"

namespace fusedamp::python {

namespace py = pybind11;

void bind_grad_scaler(py::module_& m) {
  // A gradient pass over FSDP2 shards, which fsdp.py reduces across the processes between the
  // engine's phases. It keeps the scaler whose record it adds to alive.
  py::class_<ShardedGradStats>(m, "ShardedGradStats")
      .def(py::init([](GradScaler* record_for) {
             return std::make_unique<ShardedGradStats>(
                 record_for != nullptr ? record_for->telemetry_sink() : nullptr);
           }),
           py::arg("record_for") = nullptr, py::keep_alive<1, 2>())
      .def("seed", &ShardedGradStats::seed)
      .def("sums", &ShardedGradStats::sums)
      .def("maxima",
           [](ShardedGradStats& s) -> py::object {
             const at::Tensor& maxima = s.maxima();
             return maxima.defined() ? py::cast(maxima) : py::none();
           })
      .def("finish", &ShardedGradStats::finish, py::arg("elements"));

  py::class_<GradScaler>(m, "GradScaler")
      .def(py::init([](const std::string& device, double init_scale, double growth_factor,
                       double backoff_factor, int64_t growth_interval, bool enabled,
                       int64_t hysteresis, std::optional<double> min_scale,
                       std::optional<double> max_scale, const std::string& policy,
                       std::optional<double> amax_target, bool telemetry,
                       int64_t telemetry_capacity) {
             TORCH_CHECK(policy == "torch" || policy == "amax",
                         "fusedamp.GradScaler: policy must be 'torch' or 'amax', got '", policy,
                         "'");
             return std::make_unique<GradScaler>(GradScalerOptions()
                                                     .device(c10::Device(device))
                                                     .init_scale(init_scale)
                                                     .growth_factor(growth_factor)
                                                     .backoff_factor(backoff_factor)
                                                     .growth_interval(growth_interval)
                                                     .enabled(enabled)
                                                     .hysteresis(hysteresis)
                                                     .min_scale(min_scale)
                                                     .max_scale(max_scale)
                                                     .policy(policy == "amax" ? ScalePolicy::kAmax
                                                                              : ScalePolicy::kTorch)
                                                     .amax_target(amax_target.value_or(
                                                         kDefaultAmaxTarget))
                                                     .telemetry(telemetry)
                                                     .telemetry_capacity(telemetry_capacity));
           }),
           py::arg("device"), py::arg("init_scale"), py::arg("growth_factor"),
           py::arg("backoff_factor"), py::arg("growth_interval"), py::arg("enabled"),
           py::arg("hysteresis"), py::arg("min_scale"), py::arg("max_scale"),
           py::arg("policy") = "torch", py::arg("amax_target") = py::none(),
           py::arg("telemetry") = true, py::arg("telemetry_capacity") = 4096)
      .def("scale", &GradScaler::scale)
      // The iteration's stages for a Python optimizer, identified by its id().
      .def(
          "unscale_",
          [](GradScaler& s, uintptr_t key, const std::vector<at::Tensor>& params,
             ShardedGradStats* shards) {
            const auto k = reinterpret_cast<GradScaler::OptimizerKey>(key);
            if (shards != nullptr) {
              s.unscale_(k, params, *shards);
            } else {
              s.unscale_(k, params);
            }
          },
          py::arg("key"), py::arg("params"), py::arg("shards") = nullptr)
      .def("begin_amp_step",
           [](GradScaler& s, uintptr_t key, const std::vector<at::Tensor>& params_to_check) {
             const auto h =
                 s.begin_amp_step(reinterpret_cast<GradScaler::OptimizerKey>(key), params_to_check);
             return py::make_tuple(h.grad_scale.defined() ? py::cast(h.grad_scale) : py::none(),
                                   h.found_inf);
           })
      .def("begin_plain_step",
           [](GradScaler& s, uintptr_t key, const std::vector<at::Tensor>& params) {
             return s.begin_plain_step(reinterpret_cast<GradScaler::OptimizerKey>(key), params);
           })
      .def("end_step",
           [](GradScaler& s, uintptr_t key) {
             s.end_step(reinterpret_cast<GradScaler::OptimizerKey>(key));
           })
      .def("in_iteration", &GradScaler::in_iteration)
      // The record as columns; first_nonfinite holds the parameter tensors (None: none).
      .def("telemetry",
           [](const GradScaler& s) {
             const TelemetryLog log = s.telemetry();
             py::list first;
             for (const auto& p : log.first_nonfinite) {
               first.append(p.defined() ? py::cast(p) : py::none());
             }
             py::dict out;
             out["step"] = log.step;
             out["scale"] = log.scale;
             out["found_inf"] = log.found_inf;
             out["grad_norm"] = log.grad_norm;
             out["amax"] = log.amax;
             out["underflow_fraction"] = log.underflow_fraction;
             out["subnormal_fraction"] = log.subnormal_fraction;
             out["dtype_max"] = log.dtype_max;
             out["first_nonfinite"] = first;
             return out;
           })
      .def("options_policy",
           [](const GradScaler& s) {
             return s.options().policy() == ScalePolicy::kAmax ? "amax" : "torch";
           })
      .def("options_amax_target", [](const GradScaler& s) { return s.options().amax_target(); })
      .def("has_telemetry", [](GradScaler& s) { return s.telemetry_sink() != nullptr; })
      .def("update", py::overload_cast<>(&GradScaler::update))
      .def("update_to", py::overload_cast<double>(&GradScaler::update))
      .def("update_to_tensor", py::overload_cast<const at::Tensor&>(&GradScaler::update))
      .def("get_scale", &GradScaler::get_scale)
      .def("scale_tensor", [](const GradScaler& s) { return s.scale_tensor(); })
      // Whether the scale exists yet, without handing a tensor to Python (every step asks).
      .def("has_scale", [](const GradScaler& s) { return s.scale_tensor().defined(); })
      .def("inv_scale_tensor", [](const GradScaler& s) { return s.inv_scale_tensor(); })
      .def("growth_tracker", [](const GradScaler& s) { return s.growth_tracker(); })
      .def("hysteresis_tracker", [](const GradScaler& s) { return s.hysteresis_tracker(); })
      .def("found_inf", [](const GradScaler& s) { return s.found_inf(); })
      .def("is_enabled", &GradScaler::is_enabled)
      .def("set_growth_factor", &GradScaler::set_growth_factor)
      .def("set_backoff_factor", &GradScaler::set_backoff_factor)
      .def("set_growth_interval", &GradScaler::set_growth_interval)
      .def("load_state_dict",
           [](GradScaler& s, double growth_factor, double backoff_factor, int64_t growth_interval,
              double scale, int64_t growth_tracker, int64_t hysteresis_tracker) {
             auto options = s.options();
             options.growth_factor(growth_factor)
                 .backoff_factor(backoff_factor)
                 .growth_interval(growth_interval);
             s.load_state(options, scale, growth_tracker, hysteresis_tracker);
           })
      // Options and counters for state_dict(); the counters sync with the device.
      .def("options_growth_factor", [](const GradScaler& s) { return s.options().growth_factor(); })
      .def("options_backoff_factor",
           [](const GradScaler& s) { return s.options().backoff_factor(); })
      .def("options_growth_interval",
           [](const GradScaler& s) { return s.options().growth_interval(); })
      .def("options_hysteresis", [](const GradScaler& s) { return s.options().hysteresis(); })
      .def("options_min_scale", [](const GradScaler& s) { return s.options().min_scale(); })
      .def("options_max_scale", [](const GradScaler& s) { return s.options().max_scale(); })
      .def("growth_tracker_value",
           [](const GradScaler& s) -> int64_t {
             return s.growth_tracker().defined() ? s.growth_tracker().item<int32_t>() : 0;
           })
      .def("hysteresis_tracker_value", [](const GradScaler& s) -> int64_t {
        return s.hysteresis_tracker().defined() ? s.hysteresis_tracker().item<int32_t>()
                                                : s.options().hysteresis();
      });
}

}  // namespace fusedamp::python
