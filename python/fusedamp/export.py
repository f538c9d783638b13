"""The FP32 model behind a master-weight run: what Apex's ``amp.master_params`` and DeepSpeed's
``zero_to_fp32`` give their users.

The FP32 master weights carry the bits below the FP16/BF16 model weights, and the model's
weights are the truth: where a weight no longer equals the rounding of its master (the user
edited the model after the last step: loaded a snapshot, clamped, pruned), the weight wins.
"""
from __future__ import annotations

import torch

from ._library import _C
from .distributed import ShardedOptimizer
from .optim import pack_param_groups

__all__ = ["master_weights", "fp32_state_dict"]


def _masters_by_param(optimizer):
    """{id(param): FP32 master} of the parameters that have one (a collective for a
    ShardedOptimizer: call it on every rank)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if isinstance(optimizer, ShardedOptimizer):
        # The engine rebuilds the FP32 master from whatever store the gathered state holds.
        state = optimizer.consolidated_state_dict(to=None)["state"]
        index, _ = pack_param_groups(optimizer.param_groups)
        out = {}
        for p in params:
            i = index[id(p)]
            if state.get(i):
                _, fp32 = _C.convert_param_state(p.detach(), state[i], True, torch.float32, i)
                if "master_param" in fp32:
                    out[id(p)] = fp32["master_param"]
        return out
    out = {}
    engine = getattr(optimizer, "_engine", None)
    for p in params:
        # The engine rebuilds it from whatever the mode keeps (split pair, Kahan compensation).
        master = (engine.master_weight(p) if engine is not None
                  else optimizer.state[p].get("master_param"))
        if master is not None:
            out[id(p)] = master
    return out


@torch.no_grad()
def master_weights(model: torch.nn.Module, optimizer) -> dict:
    """{parameter name: FP32 tensor}: each parameter's master weight where it has one and the
    model weight is still its rounding, else the parameter itself in FP32."""
    masters = _masters_by_param(optimizer)
    out = {}
    for name, p in model.named_parameters():
        value = p.detach().float()
        master = masters.get(id(p))
        if master is not None:
            master = master.to(p.device).reshape(p.shape)
            value = torch.where(master.to(p.dtype) == p.detach(), master, value)
        out[name] = value.clone()
    return out


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
