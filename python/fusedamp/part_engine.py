"""The C++ engine over one rank's part of the parameters, with the one collective a global
decision needs put between the engine's phases:

  1. gather_grads        the gradients of this rank's part (for FSDP2: the local shards)
  2. compute_grad_stats  FP32[2] = [found_inf, sum of squares] of this rank's part, summed
                         over the process group in ONE all-reduce (no host sync), so every
                         rank skips alike and clips by the global norm
  3. apply_update        the fused update of this rank's part

Two kinds of part: ``PartitionEngine``, a rank's partition of whole parameters (ZeRO stage
1, fusedamp.distributed.ZeroRedundancyOptimizer), and shard_engine.ShardEngine, the local
shards of DTensor (FSDP2) parameters.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ._library import _C

__all__ = ["PartEngine", "PartitionEngine", "reduce_over", "reduced_phases", "needs_stats",
           "step_scope"]


def reduce_over(shards, group):
    """The collectives of a sharded gradient pass (_C.ShardedGradStats): its sums summed and
    its maxima maximised over `group`, on the device (no host sync); None: nothing to reduce."""
    if group is None:
        return
    dist.all_reduce(shards.sums(), group=group)
    maxima = shards.maxima()
    if maxima is not None:
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)


@torch.no_grad()
def reduced_phases(engine, group, grad_scale, found_inf, *, scaled, stats, device, elements=0,
                   record_for=None):
    """The C++ engine's step over this rank's part of the parameters, with the statistics
    pass reduced over `group` between its phases (no host sync): every rank skips alike and
    clips by the global norm. `elements` (every rank's gradient elements) and `record_for`
    (a scaler engine) feed the scaler's telemetry; `device`: where a rank without gradients
    makes its part of the collectives."""
    has_grads = engine.gather_grads()
    if stats:
        pass_stats = _C.ShardedGradStats(record_for)
        if has_grads:
            engine.compute_grad_stats(found_inf, pass_stats)
        else:  # nothing to step here; the collectives are everyone's
            pass_stats.seed(found_inf if found_inf is not None
                            else torch.zeros(1, device=device))
        reduce_over(pass_stats, group)
        pass_stats.finish(elements)
    if has_grads:
        engine.apply_update(grad_scale, found_inf, scaled=scaled)


def needs_stats(group) -> bool:
    return group.get("skip_nonfinite", True) or group.get("max_grad_norm") is not None


def step_scope(record_as):
    """The profiler scope the C++ engine opens for a step named `record_as` (None: none)."""
    if record_as is None:
        return contextlib.nullcontext()
    return torch.autograd.profiler.record_function(record_as)


class PartEngine:
    """What the engines over one rank's part of the parameters share: the C++ engine's
    interface relayed (``self._engine``), and its step run by the subclass's ``_phases``,
    which reduces the statistics over the ranks."""

    def __getattr__(self, name):  # results, options, state: the engine's own
        return getattr(self.__dict__["_engine"], name)

    def sync_options(self, param_groups):
        self._param_groups = param_groups
        self._engine.sync_options(param_groups)

    def sync_changed_options(self, param_groups, synced):
        self._param_groups = param_groups
        self._engine.sync_changed_options(param_groups, synced)

    def step(self, record_as=None):
        stats = any(map(needs_stats, self._param_groups or ()))
        with step_scope(record_as):
            self._phases(None, None, scaled=False, stats=stats)


class PartitionEngine(PartEngine):
    """The C++ engine over this rank's partition of the parameters (ZeRO stage 1: every rank
    holds every gradient, each steps its own parameters), with the statistics pass's
    [found_inf, sum_sq] summed over the process group between the phases, so that a step is
    skipped on every rank or none and clipped by the norm of all gradients, as in one process.
    The loss scaler checks and records every gradient itself (each rank holds them all), so
    the partition's pass feeds no telemetry."""

    def __init__(self, engine, group):
        self._engine = engine
        self._group = group
        self._param_groups = None

    def step_amp(self, grad_scale, found_inf, telemetry_of=None, record_as=None):
        with step_scope(record_as):
            self._phases(grad_scale, found_inf, scaled=True, stats=True)

    def _phases(self, grad_scale, found_inf, scaled, stats):
        reduced_phases(self._engine, self._group, grad_scale, found_inf, scaled=scaled,
                       stats=stats, device=self._collective_device())

    def _collective_device(self):
        """Where a rank with no parameter to step (ZeRO gives a rank none when the ranks
        outnumber the parameters) makes its part of the collectives: the backend's device."""
        if dist.get_backend(self._group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
