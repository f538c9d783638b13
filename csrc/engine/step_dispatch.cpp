// fusedamp::optim::detail::direct_step_keys (see step_dispatch.h).
#include "step_dispatch.h"

#include <c10/core/impl/LocalDispatchKeySet.h>

namespace fusedamp::optim::detail {
namespace {

// The keys of a dense CPU tensor (autocast's is on every one; the dispatcher skips it unless
// autocast is on, and the step ops have no autocast kernel either way); anything else (a
// conjugate or negative view, a subclass, a functional or batched tensor, another device) is
// not plain.
const c10::DispatchKeySet kPlainCpu{c10::DispatchKey::CPU, c10::DispatchKey::ADInplaceOrView,
                                    c10::DispatchKey::AutogradCPU, c10::DispatchKey::AutocastCPU};

// (Not `keys - kPlainCpu`: a key set's difference keeps the backend bits.)
bool plain(c10::DispatchKeySet keys) {
  return kPlainCpu.isSupersetOf(keys);
}

}  // namespace

std::optional<c10::DispatchKeySet> direct_step_keys(const Bucket& b) {
  if (!b.device.is_cpu() || !b.step_rows.state_taken || !plain(b.step_rows.state_keys) ||
      !(c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set)
           .empty()) {
    return std::nullopt;
  }
  // The params' and grads' keys, gathered by the plan's walk of this step (all CPU params of
  // the optimizer together: one that is not plain sends every CPU bucket to the dispatcher).
  if (!plain(b.cpu_param_grad_keys)) {
    return std::nullopt;
  }
  return c10::DispatchKeySet(c10::DispatchKey::CPU);
}

}  // namespace fusedamp::optim::detail
