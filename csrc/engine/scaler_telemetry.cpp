// fusedamp::detail::ScalerTelemetry (see scaler_telemetry.h).
#include "scaler_telemetry.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fusedamp/math/telemetry_math.h>
#include <fusedamp/ops.h>

#include "small_writes.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace fusedamp::detail {
namespace {

constexpr double kNone = std::numeric_limits<double>::infinity();  // no non-finite gradient
constexpr int64_t kSumSq = math::kTelemetrySlots;  // current_'s slot after the op's four
static_assert(math::kColumnSumSq - math::kColumnMeasured == kSumSq,
              "a ring row holds current_ from kColumnMeasured on");

// The ceiling a gradient of this dtype overflows above (the scaled gradients' limit).
double largest_finite(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf:
      return static_cast<double>(std::numeric_limits<c10::Half>::max());
    case at::kBFloat16:
      return static_cast<double>(std::numeric_limits<c10::BFloat16>::max());
    case at::kFloat:
      return static_cast<double>(std::numeric_limits<float>::max());
    default:
      return std::numeric_limits<double>::max();
  }
}

}  // namespace

ScalerTelemetry::ScalerTelemetry(int64_t capacity) : capacity_(capacity) {
  TORCH_CHECK(capacity >= 1, "fusedamp::GradScaler: telemetry_capacity must be >= 1, got ",
              capacity);
  ring_layouts_.resize(static_cast<size_t>(capacity));
  ring_elements_.resize(static_cast<size_t>(capacity));
  ring_dtype_max_.resize(static_cast<size_t>(capacity));
}

void ScalerTelemetry::begin_iteration(const c10::Device& device) {
  if (!ring_.defined() || ring_.device() != device) {
    const auto f64 = at::TensorOptions().dtype(at::kDouble).device(device);
    fresh_ = at::tensor({0.0, 0.0, 0.0, kNone, 0.0}, at::dtype(at::kDouble)).to(device);
    current_ = at::empty({kSumSq + 1}, f64);
    current_slots_ = current_.narrow(0, 0, math::kTelemetrySlots);
    current_first_ = current_slots_.narrow(0, math::kFirstNonfinite, 1);
    current_sum_sq_ = current_.narrow(0, kSumSq, 1);
    pass_sum_sq_ = at::empty({1}, at::TensorOptions().dtype(at::kFloat).device(device));
    // The ring's rows and then its position (int64, viewed in the last 8 bytes), so that read()
    // brings both back in one copy.
    const int64_t cells = capacity_ * math::kTelemetryColumns;
    ring_and_position_ = at::zeros({cells + 1}, f64);
    ring_ = ring_and_position_.narrow(0, 0, cells).view({capacity_, math::kTelemetryColumns});
    position_ = ring_and_position_.narrow(0, cells, 1).view(at::kLong);
    recorded_ = 0;
  }
  copy_small(current_, fresh_);
  layouts_.clear();
  elements_ = 0.0;
  walked_ = 0;
  open_ = true;
}

void ScalerTelemetry::grad_stats(at::TensorList params, at::TensorList grads,
                                 const at::Tensor& found_inf, const at::Tensor& sum_sq) {
  if (!open_ || grads.empty()) {
    ops::grad_stats_({grads, found_inf, sum_sq});
    return;
  }
  record_pass(params, grads, found_inf, sum_sq, [&](const at::Tensor& telemetry) {
    ops::grad_stats_({grads, found_inf, sum_sq, std::nullopt, telemetry});
  });
}

void ScalerTelemetry::grad_stats_by(
    at::TensorList params, at::TensorList grads, const at::Tensor& found_inf,
    const at::Tensor& sum_sq, c10::function_ref<void(const std::optional<at::Tensor>&)> pass) {
  if (!open_ || grads.empty()) {
    pass(std::nullopt);
    return;
  }
  record_pass(params, grads, found_inf, sum_sq,
              [&](const at::Tensor& telemetry) { pass(telemetry); });
}

void ScalerTelemetry::unscale_and_check(at::TensorList params, at::TensorList grads,
                                        const at::Tensor& found_inf,
                                        const at::Tensor& inv_scale) {
  if (!open_ || grads.empty()) {
    ops::unscale_and_check_({grads, found_inf, inv_scale});
    return;
  }
  const at::Tensor sum_sq = at::zeros({1}, found_inf.options());
  record_pass(params, grads, found_inf, sum_sq, [&](const at::Tensor& telemetry) {
    ops::unscale_and_check_({grads, found_inf, inv_scale, sum_sq, telemetry});
  });
}

ScalerTelemetry::ParamList ScalerTelemetry::list_of(at::TensorList params) const {
  const size_t pass = layouts_.size();
  if (pass < last_layouts_.size()) {
    const ParamList& last = last_layouts_[pass].params;
    const bool same =
        last->size() == params.size() &&
        std::equal(params.begin(), params.end(), last->begin(),
                   [](const at::Tensor& p, const WeakParam& w) {
                     return p.unsafeGetTensorImpl() == w._unsafe_get_target();
                   });
    if (same) {
      return last;
    }
  }
  auto list = std::make_shared<std::vector<WeakParam>>();
  list->reserve(params.size());
  for (const auto& p : params) {
    list->emplace_back(p.getIntrusivePtr());
  }
  return list;
}

template <typename RunPass>
void ScalerTelemetry::record_pass(at::TensorList params, at::TensorList grads,
                                  const at::Tensor& found_inf, const at::Tensor& sum_sq,
                                  const RunPass& run_pass) {
  if (found_inf.device() != current_.device()) {
    // A pass on another device than the scaler's: its own slots, combined as the op would.
    const at::Tensor telemetry =
        fresh_.narrow(0, 0, math::kTelemetrySlots).to(found_inf.device());
    run_pass(telemetry);
    add_slots(telemetry);
    add_layout(layout_of(params, grads), sum_sq);
    return;
  }
  // The op gives the first non-finite grad's position in *its* list; the record keeps positions
  // among all gradients the iteration walked. Shifting the running minimum down by the number
  // walked before and back up afterwards makes the op's min() do that without another tensor:
  // an earlier pass's position turns negative and stays the minimum; inf stays inf.
  if (walked_ > 0) {
    current_first_.sub_(static_cast<double>(walked_));
  }
  run_pass(current_slots_);
  if (walked_ > 0) {
    current_first_.add_(static_cast<double>(walked_));
  }
  add_layout(layout_of(params, grads), sum_sq);
}

void ScalerTelemetry::add_pass(at::TensorList params, at::TensorList grads,
                               const at::Tensor& slots, const at::Tensor& sum_sq,
                               double elements) {
  TORCH_CHECK(slots.numel() == math::kTelemetrySlots && slots.scalar_type() == at::kDouble,
              "fusedamp::GradScaler: a pass's telemetry slots are FP64[", math::kTelemetrySlots,
              "], got ", slots.scalar_type(), "[", slots.numel(), "]");
  TORCH_CHECK(params.size() == grads.size(), "fusedamp::GradScaler: a pass's ", params.size(),
              " parameters and ", grads.size(), " gradients differ in number");
  if (!open_) {
    return;
  }
  add_slots(slots);
  PassLayout layout = layout_of(params, grads);
  layout.elements = elements;  // the caller's count: every process's shards
  add_layout(std::move(layout), sum_sq);
}

void ScalerTelemetry::add_slots(const at::Tensor& slots) {
  const auto local = slots.to(current_.device(), /*non_blocking=*/true);
  auto amax = current_.narrow(0, math::kAmax, 1);
  amax.copy_(at::maximum(amax, local.narrow(0, math::kAmax, 1)));
  current_.narrow(0, math::kSubnormal, 2).add_(local.narrow(0, math::kSubnormal, 2));
  // The pass's position counts in its own list: shifted past the gradients walked before.
  at::Tensor first = local.narrow(0, math::kFirstNonfinite, 1);
  if (walked_ > 0) {
    first = first + static_cast<double>(walked_);
  }
  current_first_.copy_(at::minimum(current_first_, first));
}

ScalerTelemetry::PassLayout ScalerTelemetry::layout_of(at::TensorList params,
                                                        at::TensorList grads) const {
  PassLayout layout{list_of(params), walked_, 0.0, std::numeric_limits<double>::infinity()};
  const size_t pass = layouts_.size();
  if (pass < last_layouts_.size() && layout.params == last_layouts_[pass].params) {
    // The same parameters as this pass of the last record: the same element count (a grad has
    // its parameter's shape) and dtypes, without reading every gradient's metadata again.
    layout.elements = last_layouts_[pass].elements;
    layout.dtype_max = last_layouts_[pass].dtype_max;
    return layout;
  }
  for (const auto& g : grads) {
    layout.elements += static_cast<double>(g.numel());
    layout.dtype_max = std::min(layout.dtype_max, largest_finite(g.scalar_type()));
  }
  return layout;
}

void ScalerTelemetry::add_layout(PassLayout layout, const at::Tensor& sum_sq) {
  // The passes' sums are [1] (no reshape op on every step); a 0-dim one broadcasts as well.
  const at::Tensor sum_sq_one = sum_sq.dim() <= 1 ? sum_sq : sum_sq.reshape({1});
  const at::Tensor sum_sq_here =
      sum_sq_one.device() == current_.device()
          ? sum_sq_one
          : sum_sq_one.to(current_.device(), /*non_blocking=*/true);
  if (layouts_.empty()) {
    copy_small(pass_sum_sq_, sum_sq_here);  // the iteration's first pass: the record op adds it
  } else {
    current_sum_sq_.add_(sum_sq_here);  // FP32 into FP64, in place
  }
  walked_ += static_cast<int64_t>(layout.params->size());
  elements_ += layout.elements;
  layouts_.push_back(std::move(layout));
}

double ScalerTelemetry::dtype_max() const {
  double m = std::numeric_limits<double>::infinity();
  for (const auto& pass : layouts_) {
    m = std::min(m, pass.dtype_max);
  }
  return m;
}

at::Tensor ScalerTelemetry::amax() const {
  return current_.narrow(0, math::kAmax, 1);
}

void ScalerTelemetry::record(const at::Tensor& scale, const at::Tensor& found_inf) {
  if (!open_) {
    return;
  }
  // The device chooses the row (position_); the host keeps what only it knows (element counts,
  // the parameters walked) under the same index, which is the device's as long as every record
  // was enqueued here. Rows a replayed CUDA graph adds have no host record of their own: read()
  // gives them the captured one, the last.
  const int64_t slot = recorded_ % capacity_;
  ops::record_telemetry_({ring_, position_, scale, found_inf, current_,
                          !layouts_.empty() ? std::optional<at::Tensor>(pass_sum_sq_)
                                            : std::nullopt});
  ring_elements_[static_cast<size_t>(slot)] = elements_;
  ring_dtype_max_[static_cast<size_t>(slot)] =
      layouts_.empty() ? std::numeric_limits<double>::quiet_NaN() : dtype_max();
  last_layouts_ = std::move(layouts_);
  layouts_.clear();
  ring_layouts_[static_cast<size_t>(slot)] = last_layouts_;
  ++recorded_;
  open_ = false;
}

TelemetryLog ScalerTelemetry::read() const {
  TelemetryLog log;
  if (recorded_ == 0) {
    return log;
  }
  // The one synchronisation: the ring and the records taken on the device (replays of a
  // captured step included).
  const at::Tensor host = ring_and_position_.to(at::kCPU);
  const double* rows = host.const_data_ptr<double>();
  int64_t taken = 0;
  std::memcpy(&taken, rows + capacity_ * math::kTelemetryColumns, sizeof(taken));
  const int64_t n = std::min(taken, capacity_);
  const int64_t start = taken - n;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t iteration = start + k;
    const int64_t slot = math::telemetry_row(iteration, capacity_);
    const auto meta =
        static_cast<size_t>(iteration < recorded_ ? slot : (recorded_ - 1) % capacity_);
    const double* r = rows + slot * math::kTelemetryColumns;
    const double* measured = r + math::kColumnMeasured;  // current_ as it was recorded
    const double elements = ring_elements_[meta];
    const double none = std::numeric_limits<double>::quiet_NaN();  // nothing was measured
    log.step.push_back(iteration);
    log.scale.push_back(r[math::kColumnScale]);
    log.found_inf.push_back(r[math::kColumnFoundInf] != 0.0);
    log.grad_norm.push_back(elements > 0 ? std::sqrt(measured[kSumSq]) / r[math::kColumnScale]
                                         : none);
    log.amax.push_back(elements > 0 ? measured[math::kAmax] : none);
    log.underflow_fraction.push_back(
        elements > 0 ? (measured[math::kSubnormal] + measured[math::kZero]) / elements : none);
    log.subnormal_fraction.push_back(elements > 0 ? measured[math::kSubnormal] / elements : none);
    log.dtype_max.push_back(ring_dtype_max_[meta]);
    at::Tensor param;
    const double first = measured[math::kFirstNonfinite];
    if (std::isfinite(first)) {
      const auto position = static_cast<int64_t>(first);
      for (const auto& pass : ring_layouts_[meta]) {
        if (position >= pass.base &&
            position < pass.base + static_cast<int64_t>(pass.params->size())) {
          // Undefined if the parameter no longer exists.
          param = at::Tensor((*pass.params)[static_cast<size_t>(position - pass.base)].lock());
        }
      }
    }
    log.first_nonfinite.push_back(param);
  }
  return log;
}

}  // namespace fusedamp::detail
