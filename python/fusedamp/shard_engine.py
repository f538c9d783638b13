"""The C++ engine over the local shards of DTensor (FSDP2) parameters: ``ShardEngine``.

fusedamp's operators take plain tensors, so the engine steps each rank's local shards, with
the statistics pass reduced over the mesh's shard dimension between its phases
(part_engine.py). Its state goes out as DTensors laid out like their parameters (what
torch.distributed.checkpoint expects) and comes in as those, or as full tensors, which each
rank slices locally. 8-bit state keeps block scales per 32 elements of each parameter: a
parameter whose shards cut its blocks is refused for it (``_scales_layout``).
"""
from __future__ import annotations

import math

import torch

from ._library import _C
from .fsdp import local_tensor, reduction_group
from .optim_options import names_int8_state
from .part_engine import PartEngine, reduced_phases, step_scope

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
except ImportError:  # torch built without distributed: optim.make_engine builds no ShardEngine
    DTensor = None

__all__ = ["ShardEngine"]

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


class ShardEngine(PartEngine):
    """The C++ engine (``engine_cls``) over the local shards of DTensor parameters, with the
    engine's interface: what optim.FusedOptimizer calls. Parameters in and state out are the
    DTensors; everything else is relayed to the engine."""

    def __init__(self, engine_cls, groups):
        self._engine_cls = engine_cls
        self._params = [list(g) for g in groups]
        self._mesh, self._group = reduction_group([p for g in self._params for p in g])
        self._locals = [[local_tensor(p) for p in g] for g in self._params]
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
                local.grad = None if p.grad is None else local_tensor(p.grad)
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
        if all(local_tensor(p) is local for ps, ls in zip(self._params, self._locals)
               for p, local in zip(ps, ls)):
            return
        old, old_locals = self._engine, self._locals
        self._locals = [[local_tensor(p) for p in g] for g in self._params]
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
                v = distribute_tensor(v.to(local_tensor(p).device), p.device_mesh, p.placements,
                                      src_data_rank=None)
            else:
                raise ValueError(f"fusedamp.optim: state {name!r} has shape {tuple(v.shape)}, "
                                 f"the DTensor parameter {tuple(p.shape)}")
            out[name] = local_tensor(v)
        return out

    def set_param_state(self, p, state, copy=True):
        self._engine.set_param_state(self._local_of(p), self._to_local_state(p, state), copy)

    def load_param_states(self, params, states):
        self._engine.load_param_states([self._local_of(p) for p in params],
                                       [self._to_local_state(p, s) for p, s in zip(params, states)])

    def all_params(self):
        return [p for g in self._params for p in g]
