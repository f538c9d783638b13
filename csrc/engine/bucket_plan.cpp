// fusedamp::optim::detail::BucketPlan (see bucket_plan.h).
#include "bucket_plan.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fusedamp/math/stochastic_rounding_math.h>

#include <string>

#include "../ops/checks.h"
#include "../ops/tensor_facts.h"
#include "device_stats.h"
#include "grad_lookahead.h"
#include "master_weights.h"
#include "param_state_store.h"
#include "step_call.h"

namespace fusedamp::optim::detail {
namespace {

// How far ahead of the walk a row's state tensors are asked for (their storages at half the
// distance): each parameter's walk reads its own and its gradient's metadata meanwhile.
constexpr size_t kRowStateAhead = 32;

bool is_float_kind(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// A gradient the fused ops can take beside its parameter; the message names the parameter.
void check_grad(const char* who, const at::Tensor& p, const at::Tensor& g, size_t group,
                size_t index) {
  const auto where = [&] {
    return " (param group " + std::to_string(group) + ", parameter " + std::to_string(index) +
           ")";
  };
  TORCH_CHECK(p.layout() == at::kStrided && p.is_non_overlapping_and_dense(),
              "fusedamp::optim::", who, ": parameters must be dense tensors without gaps or "
              "overlap (e.g. contiguous)", where());
  TORCH_CHECK(is_float_kind(p.scalar_type()), "fusedamp::optim::", who, ": parameter dtype ",
              p.scalar_type(), " is not supported (float32, float16, bfloat16)", where());
  TORCH_CHECK(g.layout() == at::kStrided, "fusedamp::optim::", who,
              ": sparse gradients are not supported", where());
  TORCH_CHECK(g.device() == p.device(), "fusedamp::optim::", who, ": gradient is on ",
              g.device(), " but the parameter is on ", p.device(), where());
  TORCH_CHECK(checks::same_ints(g.sizes(), p.sizes()), "fusedamp::optim::", who,
              ": gradient shape ", g.sizes(), " differs from the parameter's ", p.sizes(),
              where());
  TORCH_CHECK(g.scalar_type() == p.scalar_type() || g.scalar_type() == at::kFloat,
              "fusedamp::optim::", who, ": gradient dtype ", g.scalar_type(),
              " must be the parameter's (", p.scalar_type(), ") or float32", where());
}

// A gradient set by hand may have other strides than its parameter: a transposed tensor of the
// parameter's shape, or an expanded one whose elements share memory. torch.optim steps it; the
// fused kernels walk a parameter, its gradient and its state as one range of the same layout.
// So the gradient is replaced by a copy in the parameter's layout, as autograd's AccumulateGrad
// replaces a gradient that breaks its layout contract, and the copy stays the .grad: a scaled
// step leaves the unscaled gradient in it, as torch leaves it in .grad (an expanded gradient
// could not hold it in place). Reached only where a gradient failed the walk's clean read.
void follow_param_layout(const at::Tensor& p, const at::Tensor& g) {
  if (p.numel() > 1 && !checks::same_ints(g.strides(), p.strides())) {
    p.mutable_grad() = at::empty_strided(p.sizes(), p.strides(), g.options()).copy_(g);
  }
}

}  // namespace

void BucketPlan::update(const char* who, const std::vector<Group>& groups,
                        ParamStateStore& states, DeviceStats& devices,
                        std::optional<RowLists> row_lists) {
  std::vector<GroupKey> group_keys;
  std::vector<ParamKey>& param_keys = walked_param_keys_;
  group_keys.reserve(groups.size());
  param_keys.clear();
  param_keys.reserve(param_keys_.size());
  grads_seen_.clear();
  // While this step's parameters are the previous plan's, in its order, each gradient goes to
  // its place in this walk (place_grad), while its metadata is in cache, instead of in a
  // walk of its own after it (collect_grads).
  bool on_plan = valid_;
  try {
    for (auto& b : buckets_) {
      b.rows_checked = false;
      b.checking_rows = on_plan && row_lists.has_value() && b.device.is_cpu();
      if (b.checking_rows) {
        b.row_lists = (*row_lists)(b);
        checks::begin_rows(b.row_lists, checks::step_facts(b.row_lists, b.grad_dtype), b.rows);
      }
    }
    walk(who, groups, group_keys, param_keys, on_plan, devices);
    on_plan = on_plan && param_keys.size() == param_keys_.size() && group_keys == group_keys_;
    if (on_plan) {
      finish_collect(devices);
      return;
    }
    group_keys_ = std::move(group_keys);
    param_keys_.swap(param_keys);
    valid_ = false;
    rebuild(groups, states, devices);
    valid_ = true;
    collect_grads(devices);
  } catch (...) {
    // The handles placed so far are dropped: a failed call keeps no gradient alive.
    release_grads(devices);
    throw;
  }
}

void BucketPlan::walk(const char* who, const std::vector<Group>& groups,
                      std::vector<GroupKey>& group_keys, std::vector<ParamKey>& param_keys,
                      bool& on_plan, DeviceStats& devices) {
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const auto& group = groups[gi];
    group_keys.push_back(
        {group.master_weights, group.state_dtype, group.rounding_seed, group.slots});
    const auto& params = *group.params;
    // Whether the group's weight mode takes each parameter dtype, asked once per group (an
    // out-of-line call) for the walk on the plan.
    const DtypeFits dtype_fits{group.master_weights.fits(at::kHalf),
                               group.master_weights.fits(at::kBFloat16)};
    GradLookahead grads(params, /*with_storages=*/on_plan);
    for (size_t j = 0; j < params.size(); ++j) {
      const auto& p = params[j];
      const auto& g = grads.grad_at(j);
      if (!g.defined()) {
        continue;
      }
      const size_t seen = param_keys.size();
      if (on_plan) {
        prefetch_row_state(seen + kRowStateAhead, /*with_storages=*/false);
        prefetch_row_state(seen + kRowStateAhead / 2, /*with_storages=*/true);
      }
      // Where the row of this parameter is checked in this walk, one read of its tensors
      // serves both the walk's checks and the row's (checks::clean_step_row).
      bool row_taken = false;
      const bool clean =
          on_plan && seen < param_keys_.size() &&
          reads_clean(seen, p, g, dtype_fits, row_taken);
      if (clean) {
        param_keys.push_back(param_keys_[seen]);
      } else {
        check_grad(who, p, g, gi, j);
        TORCH_CHECK_VALUE(group.master_weights.fits(p.scalar_type()), "fusedamp::optim::", who,
                          ": master_weights=", group.master_weights.name(), " keeps ",
                          master_mode_dtypes(group.master_weights.info()),
                          " weights, but parameter ", j, " of param group ", gi, " is ",
                          p.scalar_type(), "; use master_weights=",
                          modes_serving(p.scalar_type()));
        follow_param_layout(p, g);  // g is p's .grad member: it names the copy from here on
        param_keys.push_back({p.unsafeGetTensorImpl(), p.scalar_type(), g.scalar_type(),
                              p.device()});
      }
      grads_seen_.push_back(&g);
      on_plan = on_plan && seen < param_keys_.size() && param_keys.back() == param_keys_[seen];
      if (on_plan) {
        place_grad(seen, g, devices, row_taken);
      }
    }
  }
}

bool BucketPlan::reads_clean(size_t seen, const at::Tensor& p, const at::Tensor& g,
                             DtypeFits dtype_fits, bool& row_taken) {
  const ParamKey& key = param_keys_[seen];
  if (p.unsafeGetTensorImpl() != key.param) {
    return false;
  }
  Bucket& b = buckets_[bucket_of_seen_[seen]];
  if (b.checking_rows) {
    // The row is checked against the bucket's facts: they must be the key's for its read to
    // answer for the walk's checks too.
    const StepFacts& f = b.rows.facts;
    row_taken = f.param_dtype == key.param_dtype && f.grad_dtype == key.grad_dtype &&
                f.device == key.device && dtype_fits(key.param_dtype) &&
                checks::clean_step_row(b.row_lists, position_of_seen_[seen], g, b.rows);
    if (row_taken) {
      return true;
    }
  }
  checks::TensorFacts param, grad;
  checks::read_facts(p, key.device, /*with_span=*/true, param);
  checks::read_facts(g, key.device, /*with_span=*/true, grad);
  return checks::clean_param_and_grad(param, grad) && param.dtype == key.param_dtype &&
         grad.dtype == key.grad_dtype && dtype_fits(param.dtype);
}

void BucketPlan::place_grad(size_t seen, const at::Tensor& g, DeviceStats& devices,
                            bool row_taken) {
  Bucket& b = buckets_[bucket_of_seen_[seen]];
  const size_t k = position_of_seen_[seen];
  devices.set_grad(b.device_slot, b.stats_position + k, g);
  if (b.checking_rows && !row_taken) {
    checks::step_row(b.row_lists, k, g, b.rows);
  }
}

void BucketPlan::prefetch_row_state(size_t seen, bool with_storages) const {
  if (seen < bucket_of_seen_.size()) {
    const Bucket& b = buckets_[bucket_of_seen_[seen]];
    if (b.checking_rows) {
      checks::prefetch_row(b.row_lists, position_of_seen_[seen], with_storages);
    }
  }
}

void BucketPlan::rebuild(const std::vector<Group>& groups, ParamStateStore& states,
                         DeviceStats& devices) {
  ++builds_;
  buckets_.clear();
  bucket_of_seen_.assign(param_keys_.size(), 0);
  position_of_seen_.assign(param_keys_.size(), 0);
  int64_t param_index = -1;  // in the optimizer's order (all groups, with or without grads)
  size_t seen = 0;           // parameters with a gradient so far (update()'s order)
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const auto& group = groups[gi];
    const size_t first = buckets_.size();
    for (const auto& p : *group.params) {
      ++param_index;
      const auto& g = grad_of(p);
      if (!g.defined()) {
        continue;
      }
      const size_t seen_index = seen++;
      // FP32 parameters are their own masters, whatever the group's mode.
      const MasterWeights mode =
          p.scalar_type() == at::kFloat ? MasterWeights(false) : group.master_weights;
      const ParamState& s = states.ensure(p, mode, group.state_dtype, group.slots);
      Bucket* b = nullptr;
      for (size_t k = first; k < buckets_.size(); ++k) {
        auto& c = buckets_[k];
        if (c.device == p.device() && c.param_dtype == p.scalar_type() &&
            c.grad_dtype == g.scalar_type()) {
          b = &c;
          break;
        }
      }
      if (b == nullptr) {
        b = &buckets_.emplace_back();
        b->group = gi;
        b->device = p.device();
        b->device_slot = devices.slot_of(p.device());
        b->param_dtype = p.scalar_type();
        b->grad_dtype = g.scalar_type();
      }
      b->params.push_back(p);
      b->seen_index.push_back(seen_index);
      bucket_of_seen_[seen_index] = static_cast<uint32_t>(b - buckets_.data());
      position_of_seen_[seen_index] = static_cast<uint32_t>(b->params.size() - 1);
      b->steps.push_back(s.step);
      for (const auto& info : kStateSlots) {
        const bool kept = is_weight_store_slot(info.slot) ? (s.*info.member).defined()
                                                          : group.slots.has(info.slot);
        if (kept) {
          b->state(info.slot).push_back(s.*info.member);
        }
      }
      if (mode.info().seeded) {
        b->rounding_seeds.push_back(math::param_rounding_seed(group.rounding_seed, param_index));
      }
    }
  }
  devices.clear_params();
  for (auto& b : buckets_) {
    b.stats_position = devices.add_params(b.device_slot, b.params);
  }
}

void BucketPlan::collect_grads(DeviceStats& devices) {
  for (auto& b : buckets_) {
    for (size_t k = 0; k < b.params.size(); ++k) {
      const at::Tensor& g = *grads_seen_[b.seen_index[k]];  // update() just read them
      devices.set_grad(b.device_slot, b.stats_position + k, g);
    }
  }
  finish_collect(devices);
}

void BucketPlan::finish_collect(DeviceStats& devices) {
  for (auto& b : buckets_) {
    b.grads = devices.grads(b.device_slot, b.stats_position, b.params.size());
    b.row_lists.grads = b.grads;
    // On the plan, every position was placed: every row was checked.
    b.rows_checked = b.checking_rows;
    b.checking_rows = false;
  }
  take_checked_grads(devices);
}

void BucketPlan::take_checked_grads(DeviceStats& devices) const {
  std::vector<char> all_checked;  // per device slot
  for (const auto& b : buckets_) {
    if (all_checked.size() <= b.device_slot) {
      all_checked.resize(b.device_slot + 1, 1);
    }
    all_checked[b.device_slot] &= static_cast<char>(
        b.rows_checked && !b.rows.needs_mutable_access && plain_cpu_call(b.rows.keys));
  }
  for (size_t slot = 0; slot < all_checked.size(); ++slot) {
    // Those of an earlier step are gone in any case (one that failed after this walk keeps
    // them until here).
    auto& spans = devices.checked_grads(slot);
    spans.clear();
    if (!all_checked[slot]) {
      continue;
    }
    // The slot's gradients are its buckets' in the plan's order (rebuild: add_params).
    for (const auto& b : buckets_) {
      if (b.device_slot == slot) {
        for (const auto& row : b.rows.rows) {
          spans.push_back({row.grad, row.numel, b.grad_dtype});
        }
      }
    }
  }
}

void BucketPlan::release_grads(DeviceStats& devices) {
  for (auto& b : buckets_) {
    b.grads = at::TensorList();
    // Rows are checked for one step: the next one checks them again.
    b.rows_checked = false;
    b.checking_rows = false;
  }
  devices.release_grads();
}

}  // namespace fusedamp::optim::detail
