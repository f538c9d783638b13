#pragma once
// The statistics of a gradient pass over this process's shards of parameters sharded across
// processes (FSDP2), held apart until the caller has reduced them across the processes: the
// engine makes no collective itself, the front end does (the Python package's fsdp.py):
//
//   ShardedGradStats pass(scaler.telemetry_sink());   // or nullptr: no telemetry
//   optimizer.compute_grad_stats(found_inf, &pass);    // or scaler.unscale_(key, params, pass)
//   all_reduce(pass.sums(), SUM); all_reduce(pass.maxima(), MAX);  // maxima: with telemetry
//   pass.finish(global_elements);
//
// finish() writes the global found_inf and sum of squares back where the pass wrote them (so
// every process skips alike and clips by the global norm) and adds the pass to the loss
// scaler's record once, with the global amax, underflow counts and first non-finite parameter:
// the record, and the amax policy that reads it, are those of one process over the whole model.
// The first non-finite position is the parameter's index in the pass's list, which is the same
// on every process (each holds a shard of every parameter).
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <fusedamp/telemetry.h>

#include <vector>

namespace fusedamp {

class ShardedGradStats final : public GradTelemetrySink {
 public:
  // record: where the reduced pass goes (a loss scaler's telemetry_sink()), or nullptr.
  explicit ShardedGradStats(GradTelemetrySink* record);

  // The pass, as the sink of an optimizer's statistics pass or of a scaler's unscale_: runs
  // the op into this object's own slots, not the record. One pass per object.
  void grad_stats(at::TensorList params, at::TensorList grads, const at::Tensor& found_inf,
                  const at::Tensor& sum_sq) override;
  void unscale_and_check(at::TensorList params, at::TensorList grads,
                         const at::Tensor& found_inf, const at::Tensor& inv_scale) override;
  // A process with no gradients to pass over still joins the collectives: `found_inf` (its
  // flag, written back by finish()) and nothing measured.
  void seed(const at::Tensor& found_inf);
  bool has_pass() const { return passed_; }
  void add_pass(at::TensorList params, at::TensorList grads, const at::Tensor& slots,
                const at::Tensor& sum_sq, double elements) override;

  // To be summed across processes: FP64 [found_inf, sum of squares] and, with a record, the
  // subnormal and zero counts. Valid after the pass (or seed()); the same tensor until finish().
  const at::Tensor& sums();
  // To be maximised across processes (with a record; undefined without): FP64 [amax, minus
  // the first non-finite position].
  const at::Tensor& maxima();
  // After the reduction: see the top of this file. `elements`: the gradient elements of every
  // process's shards (what the underflow fractions divide by).
  void finish(double elements);

 private:
  // Takes the pass's lists and flag (one pass per object) and, with a record, fresh slots.
  void begin_pass(at::TensorList params, at::TensorList grads, const at::Tensor& found_inf);
  void pack();

  GradTelemetrySink* record_;
  std::vector<at::Tensor> params_, grads_;
  at::Tensor found_inf_, sum_sq_;  // where the pass wrote (sum_sq_ undefined after seed())
  at::Tensor slots_;               // the pass's telemetry (FP64[4]), with a record
  at::Tensor sums_, maxima_;
  bool passed_ = false;
  bool packed_ = false;
};

}  // namespace fusedamp
