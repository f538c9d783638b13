#pragma once
// Phase 1 of a step: which fused op call takes which tensors. A bucket is the parameters of one
// param group on one device with one (param dtype, grad dtype) pair, with their state lists in
// the same order. The plan is rebuilt only when what it depends on changes — the set of
// parameters with gradients, their dtypes and devices, or the state a group needs — so a
// steady training loop only collects this step's gradient handles.
#include <c10/core/DispatchKeySet.h>
#include <fusedamp/optim/optimizer.h>

#include <vector>

#include "../step_addresses.h"

namespace fusedamp::optim::detail {

class DeviceStats;
class ParamStateStore;

struct Bucket {
  size_t group = 0;
  size_t device_slot = 0;  // in DeviceStats
  size_t stats_position = 0;  // of params[0] in its device's DeviceStats lists
  c10::Device device = c10::Device(c10::kCPU);
  at::ScalarType param_dtype = at::kFloat;
  at::ScalarType grad_dtype = at::kFloat;
  std::vector<at::Tensor> params, steps;
  // This step's gradients: a view of the bucket's stretch of its device's list in DeviceStats
  // (one handle per gradient, not two); set by collect_grads, emptied by release_grads.
  at::TensorList grads;
  std::vector<size_t> seen_index;  // of each param's gradient in update()'s walk
  // One entry per parameter where the group needs the slot (empty list otherwise).
  // master_params holds what the group's master_weights keeps: FP32 masters, int16
  // remainders or Kahan compensations.
  std::vector<at::Tensor> master_params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
      momentum_buffers;
  // master_weights "stochastic": each parameter's rounding seed (from the group's seed and
  // the parameter's index in the optimizer); empty otherwise.
  std::vector<int64_t> rounding_seeds;
  // The step op's element rows for these lists, kept from one step to the next (lent to the
  // op for each call: step_addresses.h, StepRowsLoan): after the first step only params and
  // grads are checked again. The state tensors are the engine's own; one given other memory
  // by a user (`set_`, `.data =`) is not seen until the bucket is rebuilt (set_param_state
  // and load_state_dict rebuild it); in-place edits are seen at once. A cache, so mutable in
  // a const bucket; only backends that walk host memory (the CPU) use it.
  mutable StepAddresses step_rows;
  // This step's: the union of the dispatch keys of the CPU params and grads of the whole plan,
  // read by update()'s walk (which reads each param and grad anyway) for a CPU bucket, so that
  // step_dispatch.h needs no walk of its own. Empty for other devices.
  c10::DispatchKeySet cpu_param_grad_keys;
};

class BucketPlan {
 public:
  // What the plan needs to know of one param group.
  struct Group {
    const std::vector<at::Tensor>* params;
    MasterWeights master_weights;  // how the group's FP16/BF16 weights are kept
    at::ScalarType state_dtype;    // of the moments / momentum buffers
    int64_t rounding_seed;         // master_weights "stochastic"
    StateSlots slots;              // the state its step needs besides the weight store
  };

  // Checks every gradient (`who` names the optimizer in messages), rebuilds the buckets if the
  // key changed (creating missing state in `states`), and collects this step's gradients into
  // the buckets and `devices`. Nothing is modified when a check fails.
  void update(const char* who, const std::vector<Group>& groups, ParamStateStore& states,
              DeviceStats& devices);
  const std::vector<Bucket>& buckets() const { return buckets_; }
  int64_t builds() const { return builds_; }
  // Forces a rebuild at the next update() (state was replaced from outside).
  void invalidate() { valid_ = false; }
  // Drops the handles to this step's gradients, here and in `devices`, once the step is done:
  // held until the next step, they would keep a whole set of gradients alive after the user's
  // zero_grad(set_to_none=True) (torch's default), through the next forward and backward.
  void release_grads(DeviceStats& devices);

 private:
  // What the buckets depend on: per group, its state needs; per parameter with a gradient,
  // its identity, dtypes and device.
  struct GroupKey {
    MasterWeights master_weights;
    at::ScalarType state_dtype;
    int64_t rounding_seed;
    StateSlots slots;
    bool operator==(const GroupKey& o) const {
      return master_weights == o.master_weights && state_dtype == o.state_dtype &&
             rounding_seed == o.rounding_seed && slots == o.slots;
    }
  };
  struct ParamKey {
    const c10::TensorImpl* param;
    at::ScalarType param_dtype;
    at::ScalarType grad_dtype;
    c10::Device device;
    bool operator==(const ParamKey& o) const {
      return param == o.param && param_dtype == o.param_dtype && grad_dtype == o.grad_dtype &&
             device == o.device;
    }
  };

  void rebuild(const std::vector<Group>& groups, ParamStateStore& states, DeviceStats& devices);
  void collect_grads(DeviceStats& devices);

  std::vector<Bucket> buckets_;
  std::vector<GroupKey> group_keys_;
  std::vector<ParamKey> param_keys_;
  // This step's gradients, as update() walked the groups (each a parameter's .grad member,
  // read once per step and unchanged until collect_grads() takes them).
  std::vector<const at::Tensor*> grads_seen_;
  c10::DispatchKeySet cpu_param_grad_keys_;  // of the params and grads update() walked
  bool valid_ = false;
  int64_t builds_ = 0;
};

}  // namespace fusedamp::optim::detail
