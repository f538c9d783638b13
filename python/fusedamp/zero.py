"""fusedamp's optimizers under torch's ZeRO stage 1.

``fusedamp.distributed.ZeroRedundancyOptimizer`` is torch's
``torch.distributed.optim.ZeroRedundancyOptimizer`` (partitioning, ``consolidate_state_dict``,
checkpoints: all torch's) for a fusedamp optimizer class, with what a local optimizer that sees
only its partition cannot do alone:

- its statistics pass is summed over the process group between the engine's phases
  (part_engine.PartitionEngine): a non-finite gradient skips the step on every rank, not only
  on the rank whose partition holds it, and ``max_grad_norm`` clips by the norm of all
  gradients;
- it takes torch's AMP protocol: ``fusedamp.GradScaler`` (or torch's) checks every gradient
  (after DDP each rank holds them all, so the check and the telemetry are global and the same
  on every rank) and hands ``grad_scale``/``found_inf`` to the local fused step, which unscales
  and skips on the device: no host sync.

It also takes parameters of several dtypes (FP32 norm layers beside FP16/BF16 weights), which
torch's class refuses, and broadcasts the updated parameters once per rank and dtype rather
than once per parameter.

torch's class with a fusedamp optimizer steps correctly without clipping and without
non-finite gradients, but clips by each partition's norm and skips per partition.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as _TorchZeRO

from .optim import AdamW, FusedOptimizer, amp_handover

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer(_TorchZeRO):
    """``ZeroRedundancyOptimizer(params, optimizer_class=fusedamp.optim.AdamW,
    process_group=None, parameters_as_bucket_view=False, **defaults)``: torch's, with the
    local optimizer's statistics reduced over ``process_group`` (see the module's doc).
    ``optimizer_class`` is one of fusedamp.optim's; ``overlap_with_ddp`` is not supported.
    Parameters of several dtypes (a model from ``fusedamp.convert_module``/``initialize``) are
    taken, except with ``parameters_as_bucket_view=True`` (torch's flat buckets: one dtype)."""

    _step_supports_amp_scaling = True

    def __init__(self, params, optimizer_class=None, process_group=None,
                 parameters_as_bucket_view=False, overlap_with_ddp=False, **defaults):
        if optimizer_class is None:
            optimizer_class = AdamW
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class,
                                                                 FusedOptimizer)):
            raise TypeError("fusedamp.distributed.ZeroRedundancyOptimizer: optimizer_class "
                            "must be one of fusedamp.optim's (AdamW, Adam, SGD), got "
                            f"{optimizer_class!r}; for torch's optimizers use "
                            "torch.distributed.optim.ZeroRedundancyOptimizer")
        if overlap_with_ddp:
            raise NotImplementedError("fusedamp.distributed.ZeroRedundancyOptimizer: "
                                      "overlap_with_ddp=True steps torch's functional "
                                      "optimizers inside DDP's communication hook; fusedamp's "
                                      "step runs after backward")
        self._one_dtype_needed = parameters_as_bucket_view  # read by the check below
        super().__init__(params, optimizer_class, process_group, parameters_as_bucket_view,
                         overlap_with_ddp, **defaults)

    def _verify_same_dense_param_type(self):
        # torch's flat bucket views need one dtype; parameter by parameter (the default), the
        # FP16/BF16 weights beside FP32 norm layers of a fusedamp-converted model are
        # broadcast as they are.
        if self._one_dtype_needed:
            super()._verify_same_dense_param_type()

    def _init_local_optimizer(self):
        super()._init_local_optimizer()
        # Built before this rank's partition was known to be one: its engine again, as a
        # partition's (no state exists yet).
        self.optim._partition_of = self.process_group
        self.optim._build_engine()

    def _sync_params(self):
        """Each rank's updated parameters broadcast from it to the others, one broadcast per
        rank and dtype (torch's per-parameter broadcasts cost a collective call each; its
        bucket views need one dtype)."""
        if self.parameters_as_bucket_view:
            super()._sync_params()
            return
        received = [(p, v) for p, v, own in broadcast_partitions(self, torch.Tensor.detach,
                                                                 lambda p: p.dtype) if not own]
        if received:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in received], [v for _, v in received])

    def step(self, closure=None, **kwargs):
        """torch's step (the local fused step, then the parameters broadcast from their
        owners), with a loss scaler's ``grad_scale``/``found_inf`` handed to the local
        optimizer."""
        grad_scale, found_inf = amp_handover(self)
        local = self.optim
        if grad_scale is not None:
            local.grad_scale = grad_scale
        if found_inf is not None:
            local.found_inf = found_inf
        try:
            return super().step(closure, **kwargs)
        finally:
            local.__dict__.pop("grad_scale", None)
            local.__dict__.pop("found_inf", None)

    # ---- what the local fused step tells (the same on every rank) -------------------------
    @property
    def last_step_applied(self):
        """1.0 if the last step was applied, 0.0 if skipped (device tensor)."""
        return self.optim.last_step_applied

    @property
    def skipped_steps(self):
        """Steps skipped since construction (device tensor)."""
        return self.optim.skipped_steps



def broadcast_partitions(zero, value_of, dtype_of):
    """Every rank's partition of a ZeroRedundancyOptimizer's parameters, the owner's values
    (``value_of(p)``, of dtype ``dtype_of(p)``) sent to every rank: one flat broadcast per rank
    and dtype, issued together, then awaited. Returns (parameter, value, owned here) for every
    parameter; a collective."""
    pending = []
    for rank, groups in enumerate(zero._partition_parameters()):
        source = dist.distributed_c10d.get_global_rank(zero.process_group, rank)
        by_dtype = {}
        for group in groups:
            for p in group["params"]:
                by_dtype.setdefault(dtype_of(p), []).append(p)
        for dtype, params in by_dtype.items():
            own = rank == zero.rank
            if own:
                flat = torch.cat([value_of(p).reshape(-1) for p in params])
            else:
                flat = torch.empty(sum(p.numel() for p in params), dtype=dtype,
                                   device=params[0].device)
            work = dist.broadcast(flat, src=source, group=zero.process_group, async_op=True)
            pending.append((work, flat, params, own))
    out = []
    for work, flat, params, own in pending:
        work.wait()
        pieces = flat.split([p.numel() for p in params])
        out += [(p, v.view_as(p), own) for p, v in zip(params, pieces)]
    return out
