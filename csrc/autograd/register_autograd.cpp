// The Autograd and ADInplaceOrView kernels of fusedamp's operators: what torch's own in-place
// ops have, written out unboxed (without them every call took torch's boxed autograd fallback,
// which boxes each tensor list into IValues: most of an op's host time with many tensors).
//
//   Autograd          the ops update optimizer state in place and are not differentiable: a
//                     written tensor that requires grad is refused while grad mode is on (as
//                     torch refuses an in-place op on a leaf that requires grad); then below.
//   ADInplaceOrView   below, then every written tensor's version counter is bumped, as for any
//                     in-place op, so autograd notices a parameter changed after it was saved
//                     for backward (e.g. a step between forward and backward).
//
// One pair of kernels serves every operator: the written arguments are those its schema marks
// (a!), read from the schema once.
#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <fusedamp/ops.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "../ops/handles.h"

namespace fusedamp::autograd {
namespace {

using at::Tensor;

// Per argument of Op, in schema order: whether the schema marks it written.
template <typename Op>
const std::vector<bool>& written_in_schema() {
  static const std::vector<bool> written = [] {
    std::vector<bool> w;
    for (const auto& arg : ops::handle<Op>().schema().arguments()) {
      w.push_back(arg.alias_info() != nullptr && arg.alias_info()->isWrite());
    }
    return w;
  }();
  return written;
}

// Whether this call writes argument `index` (named `name`): as the schema says, but a step
// writes its grads only with write_back_grads (otherwise they are read, and neither refused in
// grad mode nor given a new version).
template <typename Op>
bool writes(const Op& op, size_t index, const char* name) {
  if (!written_in_schema<Op>()[index]) {
    return false;
  }
  if constexpr (ops::IsStepOp<Op>::value) {
    if (std::strcmp(name, "grads") == 0) {
      return op.shared.write_back_grads;
    }
  }
  return true;
}

// Each defined tensor of an argument: a list, a tensor, an optional one of either, or nothing.
template <typename F>
void each_tensor(const Tensor& t, const F& f) {
  if (t.defined()) {
    f(t);
  }
}
template <typename F>
void each_tensor(at::TensorList list, const F& f) {
  for (const auto& t : list) {
    each_tensor(t, f);
  }
}
template <typename T, typename F>
void each_tensor(const std::optional<T>& value, const F& f) {
  if (value.has_value()) {
    each_tensor(*value, f);
  }
}
template <typename T, typename F>
void each_tensor(const T&, const F&) {}  // numbers, flags, int lists

template <typename Op, typename F>
void each_written_tensor(const Op& op, const F& f) {
  op.for_each_field([&](const auto& value, size_t index, const char* name) {
    if (writes(op, index, name)) {
      each_tensor(value, f);
    }
  });
}

template <typename Op, typename Signature = typename Op::Signature>
struct Kernels;
template <typename Op, typename... Args>
struct Kernels<Op, void(Args...)> {
  static void autograd(c10::DispatchKeySet ks, Args... args) {
    if (c10::GradMode::is_enabled()) {
      each_written_tensor(Op{args...}, [](const Tensor& t) {
        TORCH_CHECK(!t.requires_grad(), Op::kName,
                    ": updates tensors in place and is not differentiable, but a tensor it "
                    "modifies requires grad; call it under torch.no_grad() (as an optimizer "
                    "step runs)");
      });
    }
    ops::handle<Op>().redispatch(ks & c10::after_autograd_keyset, args...);
  }

  static void view(c10::DispatchKeySet ks, Args... args) {
    ops::handle<Op>().redispatch(ks & c10::after_ADInplaceOrView_keyset, args...);
    each_written_tensor(Op{args...},
                        [](const Tensor& t) { torch::autograd::impl::bump_version(t); });
  }
};

template <typename... Ops>
void implement_autograd(torch::Library& m, ops::OpList<Ops...>) {
  (m.impl(Ops::kShortName, &Kernels<Ops>::autograd), ...);
}

template <typename... Ops>
void implement_view(torch::Library& m, ops::OpList<Ops...>) {
  (m.impl(Ops::kShortName, &Kernels<Ops>::view), ...);
}

}  // namespace
}  // namespace fusedamp::autograd

TORCH_LIBRARY_IMPL(fusedamp, Autograd, m) {
  fusedamp::autograd::implement_autograd(m, fusedamp::ops::AllOps{});
}

TORCH_LIBRARY_IMPL(fusedamp, ADInplaceOrView, m) {
  fusedamp::autograd::implement_view(m, fusedamp::ops::AllOps{});
}
