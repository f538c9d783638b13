#pragma once
// fusedamp — mixed-precision training engine for LibTorch. The umbrella header.
#include <fusedamp/convert.h>
#include <fusedamp/grad_scaler.h>
#include <fusedamp/ops.h>
#include <fusedamp/optim/adam.h>
#include <fusedamp/optim/lion.h>
#include <fusedamp/optim/optimizer.h>
#include <fusedamp/optim/sgd.h>
#include <fusedamp/optim/sparse_step.h>
#include <fusedamp/optim/state_conversion.h>
#include <fusedamp/sharded_grad_stats.h>
#include <fusedamp/telemetry.h>

namespace fusedamp::detail {
// Defined in libfusedamp. Referencing it from every translation unit that includes this
// header keeps the library (and with it the operator registrations, which no code calls by
// symbol) in an executable even when the linker drops unreferenced shared libraries.
int link_anchor();
inline const int kLinkAnchor = link_anchor();
}  // namespace fusedamp::detail
