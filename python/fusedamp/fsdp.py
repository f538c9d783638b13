"""fusedamp's optimizers and scaler on FSDP2 (``torch.distributed.fsdp.fully_shard``): what
the rest of the package needs to know of DTensor parameters.

FSDP2 makes every parameter it manages a DTensor: each rank holds a shard (its *local tensor*)
and, after backward, the matching shard of the reduced gradient. fusedamp's operators take
plain tensors, so the C++ engine steps the local shards (shard_engine.ShardEngine), with the
one collective a global decision needs between its phases (part_engine.py): every rank skips
alike and clips by the global norm. A loss scaler unscales and checks the local gradient shards
with found_inf reduced over the mesh (``unscale_shards``).

With ``MixedPrecisionPolicy(param_dtype=torch.bfloat16 or torch.float16,
reduce_dtype=torch.float32)`` the sharded parameters are FP32: they ARE the master weights
(the engine keeps no second copy; master_weights has nothing to do for FP32 tensors), and the
gradient shards are FP32. A model sharded in FP16/BF16 without a policy gets FP32 masters of
its local shards only.

Optimizer state is reported as DTensors laid out like their parameters (what
torch.distributed.checkpoint expects); ``load_state_dict`` takes those, or full tensors, which
each rank slices locally.

Supported layouts: every parameter a DTensor on one mesh, sharded (Shard) over the same mesh
dimensions and replicated over the others (FSDP; HSDP's replicate dimension is left out of the
reduction, its ranks hold identical gradients). Parameters that are plain tensors next to
DTensors are refused: their gradients are per rank and would be counted once per rank.
"""
from __future__ import annotations

import inspect
import sys

import torch
import torch.distributed as dist

from ._library import _C
from .part_engine import reduce_over

try:
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # torch built without distributed
    DTensor = None

__all__ = ["has_dtensors", "local_tensor", "local_grad_views", "check_plain_step",
           "unscale_shards", "local_names", "reduce_over", "check_gatherable",
           "reduction_group"]


def has_dtensors(tensors) -> bool:
    return DTensor is not None and any(isinstance(t, DTensor) for t in tensors)


def local_tensor(p):
    """DTensor p's local tensor: under no_grad, to_local() is that tensor object itself (no
    autograd node)."""
    with torch.no_grad():
        return p.to_local()


def local_grad_views(params):
    """For a loss scaler that unscales or checks gradients itself: each DTensor parameter is
    replaced by an alias of its local shard carrying the local gradient shard (plain tensors
    pass unchanged). The aliases live only as long as the caller holds them."""
    if not has_dtensors(params):
        return params
    views = []
    for p in params:
        if isinstance(p, DTensor):
            v = local_tensor(p).detach()
            v.grad = local_tensor(p.grad)
            p = v
        views.append(p)
    return views


@torch.no_grad()
def unscale_shards(scaler_engine, key, params, record_for):
    """A loss scaler's unscale_ over DTensor parameters: each rank unscales its gradient
    shards; found_inf (so that every rank skips alike) and the pass's telemetry (record_for:
    the scaler engine whose record it feeds, or None) are reduced over the mesh."""
    _, group = reduction_group(params)
    shards = [local_tensor(p) for p in params]
    # The local tensors themselves carry the gradient shards (not aliases): the telemetry
    # names a parameter by them (GradScaler.telemetry maps them back to the model's names).
    for p, local in zip(params, shards):
        local.grad = local_tensor(p.grad)
    try:
        pass_stats = _C.ShardedGradStats(record_for)
        scaler_engine.unscale_(key, shards, pass_stats)
        reduce_over(pass_stats, group)
        pass_stats.finish(sum(p.numel() for p in params))
    finally:
        for local in shards:
            local.grad = None


def local_names(named_parameters):
    """(id of a DTensor parameter's local tensor, name) for the DTensors among
    `named_parameters`: what a sharded pass's record names a parameter by."""
    if DTensor is None:
        return {}
    return {id(local_tensor(p)): n for n, p in named_parameters if isinstance(p, DTensor)}


def check_plain_step(params):
    """A scaler steps an optimizer without torch's AMP protocol only after reading found_inf
    on the host; with DTensor gradients that flag would hold this rank's shards only, and the
    ranks could disagree."""
    if has_dtensors(params):
        raise NotImplementedError(
            "fusedamp.GradScaler: this optimizer does not take grad_scale/found_inf in its step "
            "(torch's AMP protocol), so the scaler would decide on this rank's gradient shards "
            "alone; over DTensor (FSDP2) parameters use fusedamp.optim.AdamW/Adam/SGD, which "
            "reduce found_inf over the mesh")


def _gathered_by_torch():
    """Whether torch.distributed.checkpoint's get_optimizer_state_dict (or get_state_dict) with
    StateDictOptions(full_state_dict=True) is what asks for the state dict: it all-gathers every
    DTensor in it once state_dict() returns, so this is the last moment to refuse it cleanly.
    Its options reach state_dict() by no argument; they are read from its frame (False when
    torch's internals look otherwise: the gather then fails as before)."""
    try:
        from torch.distributed.checkpoint import state_dict as dcp_state_dict

        code = inspect.unwrap(dcp_state_dict._get_optim_state_dict).__code__
    except (ImportError, AttributeError):
        return False
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame is not None and getattr(frame.f_locals.get("info"), "full_state_dict", False)


def check_gatherable(state):
    """Refuses, before anything is gathered or changed, a consolidated state dict of a state
    holding master_weights="split"'s int16 remainders as DTensors: neither Gloo nor NCCL has a
    16-bit integer all-gather (Gloo's answer is a bare 'Invalid scalar type')."""
    if DTensor is None or not any(isinstance(v, DTensor) and v.dtype == torch.int16
                                  for s in state.values() for v in s.values()):
        return
    if _gathered_by_torch():
        raise NotImplementedError(
            "fusedamp.optim: a full (consolidated) optimizer state dict "
            "(StateDictOptions(full_state_dict=True)) cannot be made with "
            "master_weights='split' on FSDP2: its int16 remainders (param_remainder) would "
            "have to be all-gathered, and neither Gloo nor NCCL has a 16-bit integer "
            "collective. Save the sharded state dict instead (full_state_dict=False, the "
            "default, with torch.distributed.checkpoint: it loads on any number of ranks, and "
            "into one process), or use master_weights='split8' or True, whose state gathers "
            "(docs/distributed.md). Nothing was changed.")


def reduction_group(params):
    """The process group over which per-shard sums become global ones, or None when every
    parameter is replicated (nothing to reduce)."""
    if not all(isinstance(p, DTensor) for p in params):
        raise ValueError("fusedamp.optim: the parameters mix DTensors (FSDP2 shards) and plain "
                         "tensors; put every parameter of the model under fully_shard, or give "
                         "the plain ones to a separate optimizer")
    meshes = {p.device_mesh for p in params}
    if len(meshes) != 1:
        raise NotImplementedError("fusedamp.optim: DTensor parameters on different device "
                                  "meshes in one optimizer are not supported")
    mesh = meshes.pop()
    sharded_dims = set()
    for p in params:
        for placement in p.placements:
            if not (placement.is_shard() or isinstance(placement, Replicate)):
                raise NotImplementedError(f"fusedamp.optim: parameter placement {placement} is "
                                          "not supported (Shard or Replicate)")
        sharded_dims.add(tuple(i for i, pl in enumerate(p.placements) if pl.is_shard()))
    if len(sharded_dims) != 1:
        raise NotImplementedError("fusedamp.optim: the DTensor parameters are sharded over "
                                  f"different mesh dimensions {sorted(sharded_dims)}")
    dims = sharded_dims.pop()
    if not dims:
        return mesh, None
    if len(dims) == 1:
        return mesh, mesh.get_group(dims[0])
    if len(dims) == mesh.ndim and mesh.size() == dist.get_world_size():
        return mesh, dist.group.WORLD
    raise NotImplementedError("fusedamp.optim: parameters sharded over several dimensions of "
                              "a mesh smaller than the world are not supported")
