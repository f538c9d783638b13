"""fusedamp's optimizers and scaler on FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 makes every parameter it manages a DTensor: each rank holds a shard (its *local tensor*)
and, after backward, the matching shard of the reduced gradient. fusedamp's operators take
plain tensors, so the C++ engine steps the local shards, and this module puts the one
collective a global decision needs between the engine's phases (as distributed.py does):

  1. gather_grads        the local gradient shards (bound to the local tensors for the step)
  2. compute_grad_stats  FP32[2] = [found_inf, sum of squares] of this rank's shards, summed
                         over the mesh's shard dimension in ONE all-reduce (no host sync), so
                         every rank skips alike and clips by the global norm
  3. apply_update        the fused update of the local shards

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

import contextlib
import inspect
import math
import sys

import torch
import torch.distributed as dist

from ._library import _C

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
except ImportError:  # torch built without distributed
    DTensor = None

__all__ = ["has_dtensors", "make_engine", "local_grad_views", "check_plain_step",
           "unscale_shards", "local_names", "reduce_over", "check_gatherable"]


def has_dtensors(tensors) -> bool:
    return DTensor is not None and any(isinstance(t, DTensor) for t in tensors)


def make_engine(engine_cls, groups, partition_of=None):
    """The engine for these param groups: the C++ engine itself for plain tensors, a
    ShardEngine over the local shards for DTensor parameters, a PartitionEngine where the
    groups are this rank's partition of parameters stepped across `partition_of` (a process
    group: ZeRO stage 1)."""
    if has_dtensors(p for g in groups for p in g):
        return ShardEngine(engine_cls, groups)
    if partition_of is not None:
        return PartitionEngine(engine_cls(groups), partition_of)
    return engine_cls(groups)


def _local(p):
    # Under no_grad DTensor.to_local() is the local tensor object itself (no autograd node).
    with torch.no_grad():
        return p.to_local()


# The block scales of 8-bit state, and their columns: one per quantized list.
_SCALES_COLUMNS = {"moment_scales": 2, "momentum_scales": 1}


def _scales_layout(p):
    """The full shape of DTensor p's 8-bit moment scales when every local shard holds whole
    blocks of p and its scales are the dim-0 shard of that shape that p's placements give (the
    codes and scales are then one process's, and reshard as the parameter does); None when not.
    (SGD's momentum_scales: the same rows, one column.)

    p's scales (fusedamp._C.moment_scales_shape) have p's rows where its rows are whole blocks:
    any dim-0 sharding keeps that. Otherwise they are [blocks, 2] over p's elements: each shard
    must begin on a block and hold the rows torch.chunk gives it of the blocks."""
    sharded = [(d, pl) for d, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    if len(sharded) > 1 or any(type(pl) is not Shard or pl.dim != 0 for _, pl in sharded):
        return None  # sharded on another dimension, or more than once
    shape = tuple(_C.moment_scales_shape(torch.empty_strided(p.shape, p.stride(),
                                                             device="meta")))
    if len(shape) == 3 or not sharded:
        return shape
    shards = p.device_mesh.size(sharded[0][0])
    rows = p.shape[0] if p.dim() else 1
    row = p.numel() // rows if rows else 0
    block = _C.MOMENT_BLOCK
    blocks = shape[0]
    rows_each, blocks_each = -(-rows // shards), -(-blocks // shards)
    for r in range(shards):
        first = min(r * rows_each, rows)
        n = (min(first + rows_each, rows) - first) * row
        if n and (first * row) % block:
            return None
        if -(-n // block) != max(0, min(blocks_each, blocks - r * blocks_each)):
            return None
    return shape


def _dequantized(p, state):
    """A full state entry with its 8-bit state (Adam's moments or SGD's momentum buffer, with
    their block scales) as FP32 values, converted by the engine (nothing else in it changes)."""
    names = ("exp_avg", "exp_avg_sq", "moment_scales", "momentum_buffer", "momentum_scales")
    quantized = {k: state[k] for k in names if k in state}
    quantized["step"] = state.get("step", torch.zeros(()))
    full = torch.empty(p.shape, dtype=p.dtype)  # the blocks follow the full parameter's order
    _, converted = _C.convert_param_state(full, quantized, False, torch.float32)
    out = {k: v for k, v in state.items() if k not in _SCALES_COLUMNS}
    for k in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
        if k in out:
            out[k] = converted[k]
    return out


def local_grad_views(params):
    """For a loss scaler that unscales or checks gradients itself: each DTensor parameter is
    replaced by an alias of its local shard carrying the local gradient shard (plain tensors
    pass unchanged). The aliases live only as long as the caller holds them."""
    if not has_dtensors(params):
        return params
    views = []
    for p in params:
        if isinstance(p, DTensor):
            v = _local(p).detach()
            v.grad = _local(p.grad)
            p = v
        views.append(p)
    return views


@torch.no_grad()
def unscale_shards(scaler_engine, key, params, record_for):
    """A loss scaler's unscale_ over DTensor parameters: each rank unscales its gradient
    shards; found_inf (so that every rank skips alike) and the pass's telemetry (record_for:
    the scaler engine whose record it feeds, or None) are reduced over the mesh."""
    _, group = _reduction_group(params)
    shards = [_local(p) for p in params]
    # The local tensors themselves carry the gradient shards (not aliases): the telemetry
    # names a parameter by them (GradScaler.telemetry maps them back to the model's names).
    for p, local in zip(params, shards):
        local.grad = _local(p.grad)
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
    return {id(_local(p)): n for n, p in named_parameters if isinstance(p, DTensor)}


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


def _reduction_group(params):
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


class _PartEngine:
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


class ShardEngine(_PartEngine):
    """The C++ engine (``engine_cls``) over the local shards of DTensor parameters, with the
    engine's interface: what optim.FusedOptimizer calls. Parameters in and state out are the
    DTensors; everything else is relayed to the engine."""

    def __init__(self, engine_cls, groups):
        self._engine_cls = engine_cls
        self._params = [list(g) for g in groups]
        self._mesh, self._group = _reduction_group([p for g in self._params for p in g])
        self._locals = [[_local(p) for p in g] for g in self._params]
        self._index = {id(p): (gi, i) for gi, g in enumerate(self._params)
                       for i, p in enumerate(g)}
        self._engine = engine_cls(self._locals)
        self._param_groups = None  # torch.optim's group dicts, as last synced
        self._layouts = {}  # id(p): _scales_layout(p), fixed by p's shape, mesh and placements

    # 8-bit moments keep a pair of scales per block of 32 elements of each parameter. The local
    # shards' codes and scales are one process's only where every shard holds whole blocks of
    # its parameter, laid out as a dim-0 shard of the parameter's scales (_scales_layout);
    # other parameters are refused before the options reach the engine.
    def _scales_layout(self, p, name="moment_scales"):
        key = id(p)  # p is one of self._params: alive while the engine is
        if key not in self._layouts:
            self._layouts[key] = _scales_layout(p)
        layout = self._layouts[key]
        return None if layout is None else layout[:-1] + (_SCALES_COLUMNS[name],)

    def _check_int8_blocks(self, param_groups):
        from .optim import names_int8_state  # optim builds its engines here: imported late

        for i, g in enumerate(param_groups):
            if not names_int8_state(g.get("state_dtype")):
                continue
            for p in g["params"]:
                if isinstance(p, DTensor) and self._scales_layout(p) is None:
                    raise ValueError(
                        f"fusedamp: param group {i}: state_dtype=torch.int8 keeps scales per "
                        f"block of {_C.MOMENT_BLOCK} elements of each parameter, but "
                        f"the parameter of shape {tuple(p.shape)} is sharded "
                        f"({tuple(p.placements)} on a mesh of {tuple(p.device_mesh.shape)}) into "
                        "pieces that are not whole blocks of it, so its moments would depend on "
                        "the sharding. Give such parameters (typically small vectors: biases, "
                        "norm weights) a param group of their own with another state_dtype "
                        "(e.g. torch.bfloat16).")

    def sync_options(self, param_groups):
        self._check_int8_blocks(param_groups)
        super().sync_options(param_groups)

    def sync_changed_options(self, param_groups, synced):
        self._check_int8_blocks(param_groups)
        super().sync_changed_options(param_groups, synced)

    # ---- the step -------------------------------------------------------------------------
    def step_amp(self, grad_scale, found_inf, telemetry_of=None, record_as=None):
        # found_inf is reduced even when the gradients were unscaled already, so the statistics
        # pass always runs. It records for the scaler's telemetry (telemetry_of) only while the
        # gradients are scaled: scaler.unscale_ recorded them before unscaling them.
        record_for = telemetry_of if grad_scale is not None else None
        with step_scope(record_as):
            self._phases(grad_scale, found_inf, scaled=True, stats=True, record_for=record_for)

    def _phases(self, grad_scale, found_inf, scaled, stats, record_for=None):
        self._follow_local_tensors()
        elements = self._bind_grads()
        try:
            reduced_phases(self._engine, self._group, grad_scale, found_inf, scaled=scaled,
                           stats=stats, device=self._device(), elements=elements,
                           record_for=record_for)
        finally:
            self._release_grads()

    def _device(self):
        return next(p for g in self._locals for p in g).device

    def _bind_grads(self):
        """Gives the local tensors their gradient shards; returns the gradient elements of
        every rank's shards (the global parameters' sizes)."""
        elements = 0
        for ps, ls in zip(self._params, self._locals):
            for p, local in zip(ps, ls):
                local.grad = None if p.grad is None else _local(p.grad)
                if p.grad is not None:
                    elements += p.numel()
        return elements

    def _release_grads(self):
        # The DTensor gradient keeps the shard (the step unscaled it in place); the alias must
        # not keep it alive after zero_grad.
        for ls in self._locals:
            for local in ls:
                local.grad = None

    def _follow_local_tensors(self):
        """FSDP2 may give a parameter a new local tensor (e.g. a load_state_dict(assign=True)
        or a .to() after sharding): the engine then moves to the new ones, with its state."""
        if all(_local(p) is local for ps, ls in zip(self._params, self._locals)
               for p, local in zip(ps, ls)):
            return
        old, old_locals = self._engine, self._locals
        self._locals = [[_local(p) for p in g] for g in self._params]
        moved = [(new, old.param_state(prev))
                 for nl, ol in zip(self._locals, old_locals) for new, prev in zip(nl, ol)]
        moved = [(t, s) for t, s in moved if s]
        self._engine = self._engine_cls(self._locals)
        if self._param_groups is not None:
            self._engine.sync_options(self._param_groups)
        self._engine.load_param_states([t for t, _ in moved], [s for _, s in moved])
        if old.skipped_steps() is not None:
            self._engine.set_skipped_steps(old.skipped_steps())

    # ---- state: DTensors out, DTensors or full tensors in ---------------------------------
    def _local_of(self, p):
        where = self._index.get(id(p))
        if where is None or self._params[where[0]][where[1]] is not p:
            raise KeyError("fusedamp.optim: not a parameter of this optimizer")
        return self._locals[where[0]][where[1]]

    def master_weight(self, p):
        local = self._local_of(p)
        master = self._engine.master_weight(local)
        if master is None or not isinstance(p, DTensor):
            return master
        return DTensor.from_local(master, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())

    def param_state(self, p):
        local = self._local_of(p)
        state = self._engine.param_state(local)
        out = {}
        for name, t in state.items():
            if name in _SCALES_COLUMNS:  # a dim-0 shard of the parameter's scales
                shape = self._scales_layout(p, name)
                t = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                                       shape=shape,
                                       stride=torch.empty(shape, device="meta").stride())
            elif t.shape == local.shape and name != "step":
                t = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride())
            out[name] = t
        return out

    def _to_local_state(self, p, state):
        scales = [state.get(name) for name in _SCALES_COLUMNS]
        if (any(isinstance(s, torch.Tensor) and not isinstance(s, DTensor) for s in scales)
                and self._scales_layout(p) is None):
            # A full checkpoint's 8-bit state of a parameter this sharding cuts mid-block, for
            # a group without it (one with it was refused at construction): its FP32 values,
            # from the engine's own conversion, shard as any full moment does.
            state = _dequantized(p, state)
        out = {}
        for name, v in state.items():
            if name == "step" or not isinstance(v, torch.Tensor):
                out[name] = v
                continue
            full_shape = p.shape
            if name in _SCALES_COLUMNS:
                full_shape = self._scales_layout(p, name)
                if full_shape is None:
                    raise ValueError("fusedamp.optim: 8-bit state of a parameter sharded into "
                                     "pieces that are not whole blocks of it cannot be loaded")
                if not isinstance(v, DTensor) and v.numel() == math.prod(full_shape):
                    v = v.reshape(full_shape)  # the same blocks as [blocks, columns]
            if isinstance(v, DTensor):
                if v.device_mesh != p.device_mesh or tuple(v.placements) != tuple(p.placements):
                    v = v.redistribute(p.device_mesh, p.placements)
            elif tuple(v.shape) == tuple(full_shape):  # a full tensor: this rank's slice of it
                v = distribute_tensor(v.to(_local(p).device), p.device_mesh, p.placements,
                                      src_data_rank=None)
            else:
                raise ValueError(f"fusedamp.optim: state {name!r} has shape {tuple(v.shape)}, "
                                 f"the DTensor parameter {tuple(p.shape)}")
            out[name] = _local(v)
        return out

    def set_param_state(self, p, state, copy=True):
        self._engine.set_param_state(self._local_of(p), self._to_local_state(p, state), copy)

    def load_param_states(self, params, states):
        self._engine.load_param_states([self._local_of(p) for p in params],
                                       [self._to_local_state(p, s) for p, s in zip(params, states)])

    def all_params(self):
        return [p for g in self._params for p in g]


class PartitionEngine(_PartEngine):
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
