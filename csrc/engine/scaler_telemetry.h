#pragma once
// fusedamp::GradScaler's telemetry: this iteration's record, filled by the gradient passes of
// the iteration (the scaler's own and its optimizers'), closed by update() into a ring buffer
// on the device. Nothing here syncs with the host except read().
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <fusedamp/telemetry.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace fusedamp::detail {

class ScalerTelemetry final : public GradTelemetrySink {
 public:
  explicit ScalerTelemetry(int64_t capacity);

  // Starts this iteration's record on `device` (the scaler's); forgets an unclosed one.
  void begin_iteration(const c10::Device& device);
  void grad_stats(at::TensorList params, at::TensorList grads, const at::Tensor& found_inf,
                  const at::Tensor& sum_sq) override;
  void grad_stats_by(at::TensorList params, at::TensorList grads, const at::Tensor& found_inf,
                     const at::Tensor& sum_sq,
                     c10::function_ref<void(const std::optional<at::Tensor>&)> pass) override;
  void unscale_and_check(at::TensorList params, at::TensorList grads,
                         const at::Tensor& found_inf, const at::Tensor& inv_scale) override;
  void add_pass(at::TensorList params, at::TensorList grads, const at::Tensor& slots,
                const at::Tensor& sum_sq, double elements) override;
  // This iteration's largest finite |scaled gradient| so far: FP64[1] on the scaler's device
  // (0 before any pass: "no measurement").
  at::Tensor amax() const;
  // Closes the record: `scale` is what the gradients carried (read before it is updated).
  void record(const at::Tensor& scale, const at::Tensor& found_inf);
  // Whether a gradient pass measured this iteration (amax() means something).
  bool measured() const { return elements_ > 0; }
  // The largest finite value of the narrowest gradient dtype this iteration's passes walked
  // (what the scaled gradients overflow above); infinity before any pass.
  double dtype_max() const;
  // Drops the open record (update(new_scale): the iteration's outcome is not judged).
  void discard() { open_ = false; }
  TelemetryLog read() const;

 private:
  // The parameters a pass walked, in the order of its gradient list, held weakly (the record
  // must not keep a model alive). One list serves every recorded iteration whose pass at the
  // same position walked the same parameters: a step's lists rarely change.
  using WeakParam = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  using ParamList = std::shared_ptr<const std::vector<WeakParam>>;
  struct PassLayout {
    ParamList params;
    int64_t base;  // position of params->front() among the iteration's walked gradients
    double elements;  // gradient elements the pass walked
    double dtype_max;  // largest finite value of the narrowest gradient dtype it walked
  };
  // The last iteration's list for this iteration's next pass if it holds the same parameters,
  // else a new one.
  ParamList list_of(at::TensorList params) const;
  // run_pass(telemetry) runs the op with this pass's telemetry tensor; the rest is the record's.
  template <typename RunPass>
  void record_pass(at::TensorList params, at::TensorList grads, const at::Tensor& found_inf,
                   const at::Tensor& sum_sq, const RunPass& run_pass);
  // The pieces of a pass's record: its slots combined into this iteration's (max, sum, min),
  // and its layout (the last record's for the same parameters) with its sum of squares.
  void add_slots(const at::Tensor& slots);
  PassLayout layout_of(at::TensorList params, at::TensorList grads) const;
  void add_layout(PassLayout layout, const at::Tensor& sum_sq);

  int64_t capacity_;
  at::Tensor fresh_;    // what a record starts as (see current_)
  at::Tensor current_;  // FP64[5], this iteration's: amax, subnormal count, zero count, first
                        // non-finite, sum_sq (math::kColumnMeasured on of a ring row)
  // FP32[1]: the iteration's first pass's sum of squares (there is one when layouts_ holds a
  // pass), added to current_'s by the record op (later passes add theirs themselves): one
  // same-dtype copy per step instead of a cast and an add.
  at::Tensor pass_sum_sq_;
  at::Tensor ring_;     // FP64[capacity, 7]: a row per update() (math::TelemetryColumn)
  at::Tensor position_;  // int64[1] on the device: the records taken (the next row, mod capacity)
  at::Tensor ring_and_position_;  // the memory of both (FP64[capacity * 7 + 1])
  // Views of current_ made with it (each narrow() is an ATen call: a fixed cost per pass):
  // the op's telemetry slots, their first-non-finite slot, and the sum of squares.
  at::Tensor current_slots_, current_first_, current_sum_sq_;
  std::vector<double> ring_elements_;  // per ring row: the gradient elements walked
  std::vector<double> ring_dtype_max_;  // per ring row: the passes' smallest dtype_max
  std::vector<PassLayout> layouts_;                 // this iteration's passes
  std::vector<std::vector<PassLayout>> ring_layouts_;  // per ring row
  std::vector<PassLayout> last_layouts_;            // the last recorded iteration's
  double elements_ = 0.0;  // gradient elements walked this iteration
  int64_t walked_ = 0;     // gradients walked this iteration
  int64_t recorded_ = 0;   // iterations recorded on the host (a graph replay adds none)
  bool open_ = false;
};

}  // namespace fusedamp::detail
