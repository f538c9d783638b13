// fusedamp::ops::* — each operator called through the dispatcher (include/fusedamp/ops.h), and
// the schema's defaults its declaration starts from.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <fusedamp/ops.h>

#include "handles.h"

namespace fusedamp::ops {

namespace detail {

std::optional<double> schema_default_number(const char* op, const char* arg) {
  const auto& schema = c10::Dispatcher::singleton().findSchemaOrThrow(op, "").schema();
  const auto index = schema.argumentIndexWithName(arg);
  TORCH_INTERNAL_ASSERT(index.has_value(), op, " has no argument ", arg);
  const auto& value = schema.arguments()[*index].default_value();
  if (!value.has_value() || value->isNone()) {
    return std::nullopt;
  }
  if (value->isBool()) {
    return value->toBool() ? 1.0 : 0.0;
  }
  if (value->isInt()) {
    return static_cast<double>(value->toInt());
  }
  return value->toDouble();
}

}  // namespace detail

void unscale_and_check_(const UnscaleAndCheck& args) { call(args); }
void grad_stats_(const GradStats& args) { call(args); }
void update_scale_(const UpdateScale& args) { call(args); }
void record_telemetry_(const RecordTelemetry& args) { call(args); }
void account_step_(const AccountStep& args) { call(args); }
#define FUSEDAMP_DEFINE_STEP_CALL(Algorithm, Op, op, kernels) \
  void op(const Op& args) { call(args); }
FUSEDAMP_STEP_ALGORITHMS(FUSEDAMP_DEFINE_STEP_CALL)
#undef FUSEDAMP_DEFINE_STEP_CALL
#define FUSEDAMP_DEFINE_SPARSE_ROW_CALL(Op, op, Algorithm) \
  void op(const Op& args) { call(args); }
FUSEDAMP_SPARSE_ROW_OPS(FUSEDAMP_DEFINE_SPARSE_ROW_CALL)
#undef FUSEDAMP_DEFINE_SPARSE_ROW_CALL

RowsAndSums sparse_rows_sum_(const SparseRowsSum& args) { return call(args); }

}  // namespace fusedamp::ops

namespace fusedamp::detail {
int link_anchor() { return 1; }
}  // namespace fusedamp::detail
