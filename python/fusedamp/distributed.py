"""fusedamp on torch.distributed: ZeRO stage 1.

``ZeroRedundancyOptimizer`` (zero.py) is torch's, over a fusedamp optimizer. ``ShardedOptimizer``
is deprecated (removed in the next release): on the same model and work it measured no faster
than DDP + ZeroRedundancyOptimizer with the same state per rank
(benchmarks/results/distributed_cpu.md); its consolidated checkpoints load into both
ZeroRedundancyOptimizer and fusedamp.optim.

``ShardedOptimizer`` keeps the master weights (any of fusedamp.optim's modes) and moments of
only this rank's 1/N of the parameters, laid out by flat_shard.FlatShard. The step is the C++
engine's (fusedamp._C), run over this rank's segments (each stepped as a parameter of its own,
exactly as fusedamp.optim steps it) with the collectives between its phases, and no host sync:
  1. grads copied into flat buffers, pre-divided by N (as DDP does, so an FP16 sum cannot
     overflow where the mean would not) and reduce-scattered to the shard;
  2. engine: one grad_stats_ pass -> [found_inf, sum_sq], summed over the ranks in ONE
     all-reduce, so every rank skips and clips alike;
  3. engine: the fused update of the shard; then the model shards are all-gathered.
Loss scaling: ``scaler.step(opt)`` (torch's AMP protocol). Checkpoints: ``state_dict()`` is this
rank's shard (resume on the same ranks is bit-exact); ``consolidated_state_dict(to=0)``
gathers fusedamp.optim's format, which ``load_state_dict`` accepts on any number of ranks.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as _TorchZeRO

from ._library import _C
from .flat_shard import converted_state, flat_shards
from .optim import StepResults, amp_handover, closure_loss
from .optim_options import names_int8_state
from .optim_state import pack_param_groups
from .zero import ZeroRedundancyOptimizer

__all__ = ["ShardedOptimizer", "ZeroRedundancyOptimizer", "optimizer_state_bytes"]

_FORMAT = "fusedamp.sharded/1"
_ENGINES = {"adamw": _C.AdamW, "adam": _C.Adam, "sgd": _C.SGD}


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state held by this process: the shard's state for a
    ``ShardedOptimizer``, the local optimizer's for a ZeroRedundancyOptimizer (torch's or
    fusedamp's); every tensor in ``optimizer.state`` otherwise."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.state_bytes()
    if isinstance(optimizer, _TorchZeRO):
        optimizer = optimizer.optim
    return sum(v.numel() * v.element_size() for s in optimizer.state.values()
               for v in s.values() if isinstance(v, torch.Tensor))


class ShardedOptimizer(StepResults, torch.optim.Optimizer):
    """ZeRO stage-1 AdamW/Adam/SGD with master weights over ``process_group``.

    ``ShardedOptimizer(params, optimizer="adamw", process_group=None, *, lr=1e-3,
    betas=(0.9, 0.999), eps=1e-8, weight_decay=None, momentum=0.0, dampening=0.0,
    nesterov=False, maximize=False, master_weights=True, state_dtype=torch.float32,
    rounding_seed=0, max_grad_norm=None, grads_averaged=False, sync_params=True)``:
    ``optimizer`` is "adamw" (weight_decay defaults to 1e-2), "adam" or "sgd" (0);
    ``master_weights``, ``state_dtype``, ``rounding_seed`` as in fusedamp.optim (per group);
    ``max_grad_norm`` clips by the global norm (all ranks and groups); ``grads_averaged``: grads
    are already identical on every rank (DDP): no gradient collective; ``sync_params``:
    broadcast the parameters from the group's first rank. One device, the same graph on every
    rank; a parameter without ``.grad`` is not stepped. Stochastic rounding draws per shard
    segment: the same world size resumes bit-identically, another draws other (equally
    distributed) bits.
    """

    _step_supports_amp_scaling = True
    _step_checks_nonfinite = True

    def __init__(self, params, optimizer: str = "adamw", process_group=None, *, lr=1e-3,
                 betas=(0.9, 0.999), eps=1e-8, weight_decay=None, momentum=0.0, dampening=0.0,
                 nesterov=False, maximize=False, master_weights=True, state_dtype=torch.float32,
                 rounding_seed=0, max_grad_norm=None, grads_averaged=False, sync_params=True):
        warnings.warn("fusedamp.distributed.ShardedOptimizer is deprecated and will be removed "
                      "in the next release: use DistributedDataParallel with "
                      "fusedamp.distributed.ZeroRedundancyOptimizer(params, "
                      "optimizer_class=fusedamp.optim.AdamW, ...) (ZeRO-1, the same state per "
                      "rank), or FSDP2 (fully_shard) with fusedamp.optim; its consolidated "
                      "checkpoints load into both", DeprecationWarning, stacklevel=2)
        kind = optimizer.lower()
        if kind not in _ENGINES:
            raise ValueError(f"fusedamp.distributed: optimizer must be one of {tuple(_ENGINES)}, "
                             f"got {optimizer!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("fusedamp.distributed.ShardedOptimizer needs an initialised "
                               "torch.distributed process group (dist.init_process_group)")
        params = list(params)
        for value in [state_dtype] + [g.get("state_dtype") for g in params if isinstance(g, dict)]:
            if names_int8_state(value):
                raise ValueError("fusedamp.distributed.ShardedOptimizer: state_dtype=torch.int8 "
                                 "is not supported (its flat shards would cut the 32-element "
                                 "blocks of 8-bit moments); use "
                                 "fusedamp.distributed.ZeroRedundancyOptimizer")
        for value in [master_weights] + [g.get("master_weights") for g in params
                                         if isinstance(g, dict)]:
            if value == "split8":
                raise ValueError("fusedamp.distributed.ShardedOptimizer (deprecated) does not "
                                 "take master_weights=\"split8\"; use "
                                 "fusedamp.distributed.ZeroRedundancyOptimizer")
        weight_decay = (1e-2 if kind == "adamw" else 0.0) if weight_decay is None else weight_decay
        defaults = dict(lr=lr, weight_decay=weight_decay, maximize=maximize,
                        master_weights=master_weights, state_dtype=state_dtype,
                        rounding_seed=rounding_seed, max_grad_norm=max_grad_norm)
        defaults.update(dict(momentum=momentum, dampening=dampening, nesterov=nesterov)
                        if kind == "sgd" else dict(betas=betas, eps=eps))
        self._kind, self._group = kind, process_group
        self._world, self._rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self._grads_averaged = bool(grads_averaged)
        self._buckets = []
        super().__init__(params, defaults)
        _ENGINES[kind].validate(self.param_groups)  # ValueError before the model is touched
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) != 1:
            raise ValueError("fusedamp.distributed.ShardedOptimizer: all parameters must be on "
                             f"one device, got {sorted(map(str, devices))}")
        self._device = devices.pop()
        index, _ = pack_param_groups(self.param_groups)
        self._buckets = flat_shards(self.param_groups, kind, index, self._rank, self._world)
        self._layout_values = [tuple(g[k] for k in self._LAYOUT_KEYS) for g in self.param_groups]
        self._engine = _ENGINES[kind]([[s for b in self._buckets if b.group == gi
                                        for s in b.seg_params]
                                       for gi in range(len(self.param_groups))])
        self._engine.sync_options(self.param_groups)
        if sync_params and self._world > 1:
            src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
            for b in self._buckets:
                dist.broadcast(b.flat, src=src, group=process_group)
                b.reset_store()
        for seg, state in (entry for b in self._buckets for entry in b.segment_states()):
            self._engine.set_param_state(seg, state, copy=False)

    def add_param_group(self, param_group):
        if self._buckets:
            raise RuntimeError("fusedamp.distributed.ShardedOptimizer: add_param_group after "
                               "construction is not supported (the flat buffers are fixed)")
        super().add_param_group(param_group)

    world_size = property(lambda self: self._world)
    rank = property(lambda self: self._rank)

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (master weights, moments and step counts of
        its shard); the flat parameter/gradient buffers are not state."""
        return sum(b.state_bytes() for b in self._buckets)

    def buffer_bytes(self) -> int:
        """Bytes of the communication buffers (flat grads and the grad shard) on this rank."""
        return sum(b.buffer_bytes() for b in self._buckets)

    # ---- the step --------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One sharded step; under a loss scaler (torch's AMP protocol) a scaled one."""
        loss = closure_loss(closure)
        self._check_layout()
        grad_scale, found_inf = amp_handover(self)
        for w in [b.reduce_scatter_grad(self._group, self._world, self._grads_averaged)
                  for b in self._buckets]:
            if w is not None:
                w.wait()
        engine = self._engine
        engine.sync_options(self.param_groups)
        has_grads = engine.gather_grads()
        if has_grads:
            stats = engine.compute_grad_stats(found_inf)
        else:  # nothing of this rank's shard to step; the collective is everyone's
            stats = torch.zeros(2, device=self._device)
            if found_inf is not None:
                stats[0] = found_inf
        if self._world > 1:
            dist.all_reduce(stats, group=self._group)
        if has_grads:
            engine.apply_update(grad_scale, found_inf, scaled=True)
        elif found_inf is not None:
            found_inf.copy_(stats[0])
        for w in [dist.all_gather_into_tensor(b.flat, b.flat[b.lo:b.hi], group=self._group,
                                              async_op=True) for b in self._buckets
                  if self._world > 1]:
            w.wait()
        return loss

    _LAYOUT_KEYS = ("master_weights", "state_dtype")

    def _check_layout(self):
        """The flat state buffers were laid out for each group's master_weights and state_dtype:
        a changed value would make the engine step other tensors than the shard's."""
        for gi, (g, fixed) in enumerate(zip(self.param_groups, self._layout_values)):
            for key, value in zip(self._LAYOUT_KEYS, fixed):
                if g[key] is not value and g[key] != value:
                    raise ValueError(
                        f"fusedamp.distributed.ShardedOptimizer: param group {gi}'s {key} is "
                        f"fixed at construction ({value!r}), got {g[key]!r}; build a new "
                        "optimizer and load consolidated_state_dict() to change it")

    # ---- checkpoints -----------------------------------------------------------------
    def _segment_entries(self):
        index, _ = pack_param_groups(self.param_groups)
        return (entry for b in self._buckets for entry in b.segment_entries(index))

    def state_dict(self):
        """This rank's shard of the state (load it on the same rank of the same world size):
        per segment, keyed by (parameter index, first element), its pieces of the state."""
        skipped = self._engine.skipped_steps()
        return {"format": _FORMAT, "optimizer": self._kind, "world_size": self._world,
                "rank": self._rank, "param_groups": pack_param_groups(self.param_groups)[1],
                "skipped_steps": None if skipped is None else skipped.clone(),
                "segments": {(i, lo): {n: t.clone() for n, t in state.items()}
                             for _, i, lo, _, _, state in self._segment_entries()}}

    @torch.no_grad()
    def consolidated_state_dict(self, to=0):
        """Gathers the full per-parameter state (fusedamp.optim's format) to rank ``to`` of the
        process group (None: to every rank). A collective: call it on every rank. Returns the
        state dict on the receiving rank(s), None elsewhere."""
        index, groups = pack_param_groups(self.param_groups)
        receiving = to is None or self._rank == to
        state = {}
        for b in self._buckets:
            full, steps = b.gathered_state(self._group)
            for i, (p, off) in enumerate(zip(b.params, b.offsets)) if receiving else ():
                state[index[id(p)]] = dict({n: t[off:off + p.numel()].view(p.shape).cpu().clone()
                                            for n, t in full.items()}, step=steps[i].cpu().clone())
        return {"state": state, "param_groups": groups} if receiving else None

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        """Loads a shard (``state_dict()`` of the same rank and world size) or a full state
        (``consolidated_state_dict()``, or a fusedamp.optim state dict) on any world size. A
        full state of another master-weight mode or moment dtype is converted by the engine to
        this optimizer's (master_weights and state_dtype stay the constructor's; the split
        mode may move a weight by one ulp: the model gets the weight its pair needs). Everything
        is checked and converted before anything is changed."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(m["params"]) != len(t["params"]) for m, t in zip(self.param_groups, groups)):
            raise ValueError("fusedamp.distributed: the state dict's param groups do not match "
                             "this optimizer's")
        shard = state_dict.get("format") == _FORMAT
        if shard and (state_dict["world_size"], state_dict["rank"]) != (self._world, self._rank):
            raise ValueError(f"fusedamp.distributed: shard of rank {state_dict['rank']}/"
                             f"{state_dict['world_size']} cannot be loaded on rank {self._rank}/"
                             f"{self._world}; load a consolidated_state_dict() instead")
        writes, converted = [], {}
        for gi, i, lo, hi, p, state in self._segment_entries():
            if shard:
                source = state_dict["segments"].get((i, lo))
                if state_dict["optimizer"] != self._kind or source is None or any(
                        n not in source or source[n].shape != t.shape for n, t in state.items()):
                    raise ValueError("fusedamp.distributed: the shard does not match this "
                                     f"optimizer's (parameter {i}, element {lo}: another "
                                     "optimizer, layout or master-weight mode); load a "
                                     "consolidated_state_dict() instead")
                writes += [(t, source[n]) for n, t in state.items()]
                continue
            if i not in converted:
                g = self.param_groups[gi]
                converted[i] = converted_state(p.detach(), state_dict["state"].get(i),
                                               g["master_weights"], g["state_dtype"], i)
            _, full = converted[i]
            for name, t in state.items():
                if name in full:
                    value = (full[name].reshape(()) if name == "step"
                             else full[name].reshape(-1)[lo:hi])
                else:  # moments of a state that has none yet
                    value = 0.0
                writes.append((t, value))
        # Everything is checked and converted: commit. Every rank writes whole weights (each
        # converted the same state the same way), so the model stays identical everywhere.
        params = [p for g in self.param_groups for p in g["params"]]
        writes += [(params[i], weight) for i, (weight, _) in converted.items()]
        for dst, src in writes:
            dst.copy_(src) if isinstance(src, torch.Tensor) else dst.fill_(src)
        if shard and state_dict.get("skipped_steps") is not None:
            self._engine.set_skipped_steps(state_dict["skipped_steps"])
        for mine, theirs in zip(self.param_groups, groups):
            mine.update({k: v for k, v in theirs.items()
                         if k != "params" and k not in self._LAYOUT_KEYS})
