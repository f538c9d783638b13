#pragma once
// Phase 1 of a step: which fused op call takes which tensors. A bucket is the parameters of one
// param group on one device with one (param dtype, grad dtype) pair, with their state lists in
// the same order. The plan is rebuilt only when what it depends on changes — the set of
// parameters with gradients, their dtypes and devices, or the state a group needs — so a
// steady training loop only collects this step's gradient handles.
#include <c10/util/FunctionRef.h>
#include <fusedamp/optim/options.h>
#include <fusedamp/optim/param_state.h>

#include <array>
#include <vector>

#include "../ops/step_lists.h"
#include "../ops/tensor_facts.h"

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
  // master_weights "stochastic": each parameter's rounding seed (from the group's seed and
  // the parameter's index in the optimizer); empty otherwise.
  std::vector<int64_t> rounding_seeds;

  // The state list of `slot`, one entry per parameter where the group needs the slot (empty
  // otherwise). The weight store's slots share one list: what the group's master_weights
  // keeps (FP32 masters, int16 remainders or Kahan compensations).
  const std::vector<at::Tensor>& state(StateSlot slot) const { return state_[index_of(slot)]; }
  std::vector<at::Tensor>& state(StateSlot slot) { return state_[index_of(slot)]; }

  // This step's rows of the bucket's step op, checked by update()'s walk as the op checks them
  // (checks::step_row), for the engine's call on a CPU bucket (step_call.h), which then need
  // not read every tensor's metadata a second time. Valid while rows_checked: set when the walk
  // checked every row, cleared when the step's gradients are released.
  StepLists row_lists;       // the op's lists over this bucket (grads: this step's, once placed)
  mutable StepRows rows;     // the kernel may retake an address (StepRows::needs_mutable_access)
  bool rows_checked = false;
  bool checking_rows = false;  // during the walk

 private:
  static size_t index_of(StateSlot slot) {
    return static_cast<size_t>(is_weight_store_slot(slot) ? StateSlot::kMasterParam : slot);
  }
  std::array<std::vector<at::Tensor>, kStateSlots.size()> state_;
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

  // The lists of a bucket's step op (its algorithm's), for checking its rows.
  using RowLists = c10::function_ref<StepLists(const Bucket&)>;

  // Checks every gradient (`who` names the optimizer in messages), rebuilds the buckets if the
  // key changed (creating missing state in `states`), and collects this step's gradients into
  // the buckets and `devices`. Nothing is modified when a check fails (but this step's
  // gradient handles, dropped again). With row_lists (a caller that runs the step ops right
  // after, with nothing in between that could change a tensor of theirs), a CPU bucket on
  // the previous step's plan also gets its rows checked (Bucket::rows).
  void update(const char* who, const std::vector<Group>& groups, ParamStateStore& states,
              DeviceStats& devices, std::optional<RowLists> row_lists);
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

  // update()'s walk over every parameter: the checks, this step's keys, and (while on_plan)
  // each gradient placed; on_plan turns false at the first parameter off the plan.
  void walk(const char* who, const std::vector<Group>& groups,
            std::vector<GroupKey>& group_keys, std::vector<ParamKey>& param_keys,
            bool& on_plan, DeviceStats& devices);
  void rebuild(const std::vector<Group>& groups, ParamStateStore& states, DeviceStats& devices);
  void collect_grads(DeviceStats& devices);
  // Whether a group's weight mode takes FP16 and BF16 parameters (FP32 ones: always).
  struct DtypeFits {
    bool half, bfloat16;
    bool operator()(at::ScalarType t) const {
      return t == at::kHalf ? half : t == at::kBFloat16 ? bfloat16 : true;
    }
  };
  // Whether p, the parameter the `seen`-th key names, and its gradient g read as clean with
  // the key's dtypes, in a weight mode that takes them: every check of the walk passes on such
  // a pair, so the walk skips the message-raising ones. Where not, those checks decide. Where
  // the bucket's rows are checked, the read is the row's (checks::clean_step_row), which then
  // is taken (row_taken); otherwise that of p and g (tensor_facts.h clean_param_and_grad).
  bool reads_clean(size_t seen, const at::Tensor& p, const at::Tensor& g, DtypeFits dtype_fits,
                   bool& row_taken);
  // update()'s walk, while the parameters match the previous step's plan: the gradient of the
  // `seen`-th parameter with one goes to its place at once (see update()), and its row is
  // checked where its bucket's rows are (unless reads_clean took it).
  void place_grad(size_t seen, const at::Tensor& g, DeviceStats& devices, bool row_taken);
  // Starts loading the state tensors' metadata of the `seen`-th parameter's row, for a walk
  // that checks rows (with_storages: their storages', once the tensors are in cache).
  void prefetch_row_state(size_t seen, bool with_storages) const;
  // The lists' views of this step's gradients, once `devices` holds them all.
  void finish_collect(DeviceStats& devices);
  // Where every gradient of a device is in rows checked this step (and the CPU kernel is what
  // the op would run), the device's statistics pass gets them as the rows give them
  // (DeviceStats::checked_grads).
  void take_checked_grads(DeviceStats& devices) const;

  std::vector<Bucket> buckets_;
  std::vector<GroupKey> group_keys_;
  std::vector<ParamKey> param_keys_;
  // This step's keys as the walk reads them: kept between steps, so that the walk over
  // thousands of parameters allocates nothing (swapped with param_keys_ when they change).
  std::vector<ParamKey> walked_param_keys_;
  // This step's gradients, as update() walked the groups (each a parameter's .grad member,
  // read once per step and unchanged until collect_grads() takes them).
  std::vector<const at::Tensor*> grads_seen_;
  // Where the plan puts the seen-th parameter with a gradient: its bucket and its position
  // there (set by rebuild()).
  std::vector<uint32_t> bucket_of_seen_, position_of_seen_;
  bool valid_ = false;
  int64_t builds_ = 0;
};

}  // namespace fusedamp::optim::detail
