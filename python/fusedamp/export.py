"""The FP32 model behind a master-weight run: what Apex's ``amp.master_params`` and DeepSpeed's
``zero_to_fp32`` give their users.

The FP32 master weights carry the bits below the FP16/BF16 model weights, and the model's
weights are the truth: where a weight no longer equals the rounding of its FP32 master copy
(the user edited the model after the last step: loaded a snapshot, clamped, pruned), the
weight wins. The other modes keep no copy of the weight, only the bits below it (the "split"
remainder, the Kahan compensation): their FP32 value is rebuilt from the model's current
weight, so it always starts from the truth and needs no such test (which, made by rounding
to nearest even, would also wrongly reject the "split" weights that round a tie away from
zero).
"""
from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from .zero import broadcast_partitions

__all__ = ["master_weights", "fp32_state_dict"]


def _masters_by_param(optimizer):
    """{id(param): (FP32 master, whether it is a separate copy)} of the parameters that have
    one. A separate copy (the state's master_param) may be stale against an edited weight; one
    rebuilt from the weight (split, Kahan) is not."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out = {}
    engine = getattr(optimizer, "_engine", None)
    for p in params:
        # The engine rebuilds it from whatever the mode keeps (split pair, Kahan compensation).
        if engine is not None:
            master = engine.master_weight(p)
            separate = master is not None and "master_param" in engine.param_state(p)
        else:
            master = optimizer.state[p].get("master_param")
            separate = True
        if master is not None:
            out[id(p)] = (master, separate)
    return out


def _fp32_value(p, masters):
    """The FP32 value of parameter `p`: its master where it has one (and, for a separate FP32
    copy, the model weight is still its rounding), else the parameter itself in FP32."""
    value = p.detach().float()
    if id(p) in masters:
        master, separate = masters[id(p)]
        master = master.to(p.device).reshape(p.shape)
        value = (torch.where(master.to(p.dtype) == p.detach(), master, value) if separate
                 else master)
    return value.clone()


def _zero_fp32_values(optimizer):
    """{id(param): FP32 value} under a ZeroRedundancyOptimizer (torch's or fusedamp's), a
    collective: each rank holds the masters of its partition only, and sends their values to
    the others."""
    masters = _masters_by_param(optimizer.optim)
    return {id(p): v for p, v, _ in broadcast_partitions(
        optimizer, lambda p: _fp32_value(p, masters), lambda p: torch.float32)}


@torch.no_grad()
def master_weights(model: torch.nn.Module, optimizer) -> dict:
    """{parameter name: FP32 tensor}: each parameter's master weight where it has one (and,
    for a separate FP32 copy, the model weight is still its rounding), else the parameter
    itself in FP32. Under a ZeroRedundancyOptimizer (torch's or fusedamp's) a collective: call
    it on every rank."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        values = _zero_fp32_values(optimizer)
        return {name: values[id(p)] if id(p) in values else p.detach().float().clone()
                for name, p in model.named_parameters()}
    masters = _masters_by_param(optimizer)
    return {name: _fp32_value(p, masters) for name, p in model.named_parameters()}


def fp32_state_dict(model: torch.nn.Module, optimizer) -> dict:
    """model.state_dict() in FP32 with the master weights as its parameters (floating buffers
    cast to FP32): the checkpoint of the FP32 model, for export or FP32 evaluation."""
    weights = master_weights(model, optimizer)
    out = {}
    for key, value in model.state_dict().items():
        if key in weights:
            out[key] = weights[key]
        elif torch.is_tensor(value) and value.is_floating_point():
            out[key] = value.float()
        else:
            out[key] = value
    return out
