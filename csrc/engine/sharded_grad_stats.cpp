// fusedamp::ShardedGradStats (see fusedamp/sharded_grad_stats.h).
#include <fusedamp/sharded_grad_stats.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fusedamp/math/telemetry_math.h>
#include <fusedamp/ops.h>

#include <limits>

namespace fusedamp {
namespace {

constexpr const char* kWho = "fusedamp::ShardedGradStats";
// sums_: found_inf, sum of squares, then (with a record) the subnormal and zero counts.
constexpr int64_t kSumCount = 2;
// maxima_: amax, then minus the first non-finite position (a max of negated positions is the
// min of the positions: one collective for both).
constexpr int64_t kMaxAmax = 0;
constexpr int64_t kMaxMinusFirst = 1;

}  // namespace

ShardedGradStats::ShardedGradStats(GradTelemetrySink* record) : record_(record) {}

void ShardedGradStats::begin_pass(at::TensorList params, at::TensorList grads,
                                  const at::Tensor& found_inf) {
  TORCH_CHECK(!passed_, kWho, ": holds one pass (the gradients of one device)");
  params_ = params.vec();
  grads_ = grads.vec();
  found_inf_ = found_inf;
  passed_ = true;
  if (record_ != nullptr) {  // the pass's own telemetry: nothing measured, no non-finite yet
    slots_ = at::empty({math::kTelemetrySlots}, found_inf.options().dtype(at::kDouble));
    slots_.fill_(0.0);
    slots_.narrow(0, math::kFirstNonfinite, 1).fill_(std::numeric_limits<double>::infinity());
  }
}

void ShardedGradStats::grad_stats(at::TensorList params, at::TensorList grads,
                                  const at::Tensor& found_inf, const at::Tensor& sum_sq) {
  begin_pass(params, grads, found_inf);
  sum_sq_ = sum_sq;
  ops::grad_stats_({grads, found_inf, sum_sq, std::nullopt,
                    slots_.defined() ? std::optional<at::Tensor>(slots_) : std::nullopt});
}

void ShardedGradStats::unscale_and_check(at::TensorList params, at::TensorList grads,
                                         const at::Tensor& found_inf,
                                         const at::Tensor& inv_scale) {
  begin_pass(params, grads, found_inf);
  if (record_ == nullptr) {
    ops::unscale_and_check_({grads, found_inf, inv_scale});
    return;
  }
  sum_sq_ = at::zeros({1}, found_inf.options().dtype(at::kFloat));
  ops::unscale_and_check_({grads, found_inf, inv_scale, sum_sq_, slots_});
}

void ShardedGradStats::seed(const at::Tensor& found_inf) {
  TORCH_CHECK(!passed_, kWho, ": holds one pass (the gradients of one device)");
  found_inf_ = found_inf;
  passed_ = true;
}

void ShardedGradStats::add_pass(at::TensorList, at::TensorList, const at::Tensor&,
                                const at::Tensor&, double) {
  TORCH_CHECK(false, kWho, ": a sharded pass is itself reduced and added to a loss scaler's "
              "record; it cannot hold another pass's statistics");
}

void ShardedGradStats::pack() {
  TORCH_CHECK(passed_, kWho, ": no pass yet (run the statistics pass or seed() first)");
  if (packed_) {
    return;
  }
  // Read here rather than in the pass: a caller may have added to the flag after the op (the
  // scaler's check of gradients the fused op does not take).
  const auto f64 = found_inf_.options().dtype(at::kDouble);
  sums_ = at::zeros({kSumCount + (record_ != nullptr ? 2 : 0)}, f64);
  sums_.narrow(0, 0, 1).copy_(found_inf_.reshape({1}));
  if (sum_sq_.defined()) {
    sums_.narrow(0, 1, 1).copy_(sum_sq_.reshape({1}));
  }
  if (record_ != nullptr) {
    maxima_ = at::empty({2}, f64);
    if (slots_.defined()) {
      sums_.narrow(0, kSumCount, 2).copy_(slots_.narrow(0, math::kSubnormal, 2));
      maxima_.narrow(0, kMaxAmax, 1).copy_(slots_.narrow(0, math::kAmax, 1));
      maxima_.narrow(0, kMaxMinusFirst, 1).copy_(-slots_.narrow(0, math::kFirstNonfinite, 1));
    } else {  // nothing measured here: neutral in the max (amax >= 0, a position <= +inf)
      maxima_.narrow(0, kMaxAmax, 1).fill_(0.0);
      maxima_.narrow(0, kMaxMinusFirst, 1).fill_(-std::numeric_limits<double>::infinity());
    }
  }
  packed_ = true;
}

const at::Tensor& ShardedGradStats::sums() {
  pack();
  return sums_;
}

const at::Tensor& ShardedGradStats::maxima() {
  pack();
  return maxima_;
}

void ShardedGradStats::finish(double elements) {
  pack();
  found_inf_.copy_(sums_.narrow(0, 0, 1).reshape(found_inf_.sizes()));
  at::Tensor sum_sq = sum_sq_;
  if (sum_sq.defined()) {
    sum_sq.copy_(sums_.narrow(0, 1, 1).reshape(sum_sq.sizes()));
  } else {
    sum_sq = sums_.narrow(0, 1, 1).to(at::kFloat);
  }
  if (record_ != nullptr) {
    const at::Tensor slots =
        slots_.defined() ? slots_ : at::empty({math::kTelemetrySlots}, sums_.options());
    slots.narrow(0, math::kSubnormal, 2).copy_(sums_.narrow(0, kSumCount, 2));
    slots.narrow(0, math::kAmax, 1).copy_(maxima_.narrow(0, kMaxAmax, 1));
    slots.narrow(0, math::kFirstNonfinite, 1).copy_(-maxima_.narrow(0, kMaxMinusFirst, 1));
    record_->add_pass(params_, grads_, slots, sum_sq.reshape({1}), elements);
  }
  record_ = nullptr;  // added once
}

}  // namespace fusedamp
