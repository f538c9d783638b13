"""fusedamp on torch.distributed: a ZeRO stage-1 sharded master-weight optimizer.

``ShardedOptimizer`` keeps the FP32 master weights and moments of only this rank's 1/N of the
parameters. What is sharded is decided here; the step itself is the C++ engine's
(fusedamp._C), run over this rank's shard with the collectives between its phases:

  1. copy the grads into one flat buffer per (param group, dtype), pre-divide by N (as DDP does,
     so the FP16 sum cannot overflow where the mean would not), reduce-scatter it to the shard;
  2. engine: gather the shard's gradients, one ``grad_stats_`` pass -> [found_inf, sum_sq],
     summed over the ranks in ONE all-reduce, so every rank skips (and clips) alike;
  3. engine: the fused update of the shard (FP32 master -> FP16/BF16 model shard), skipped on
     the device when found_inf != 0; then all-gather the model shards into the flat buffers.

Layout: every parameter's ``.data`` is a view of its flat buffer, so the all-gather writes the
model weights directly. Rank r owns the slice ``[r*S, (r+1)*S)`` of each buffer (S = padded
numel / N); inside it a parameter's piece is a *segment*, which the engine steps as a parameter
of its own (its state — step count, master, moments — being views into flat FP32 buffers), so a
sharded step does exactly what ``fusedamp.optim`` does for those elements. No host sync.

Loss scaling: ``scaler.step(opt)`` (torch's AMP protocol, as fusedamp.optim). Checkpoints:
``state_dict()`` is this rank's shard (resume on the same ranks is bit-exact);
``consolidated_state_dict(to=0)`` gathers the per-parameter state in fusedamp.optim's format,
which ``load_state_dict`` accepts on any number of ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._library import _C
from .optim import pack_param_groups

__all__ = ["ShardedOptimizer", "optimizer_state_bytes"]

_FORMAT = "fusedamp.sharded/1"
_ENGINES = {"adamw": _C.AdamW, "adam": _C.Adam, "sgd": _C.SGD}


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state held by this process: the shard's state for a
    ``ShardedOptimizer``; every tensor in ``optimizer.state`` otherwise."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.state_bytes()
    return sum(v.numel() * v.element_size() for s in optimizer.state.values()
               for v in s.values() if isinstance(v, torch.Tensor))


class _Bucket:
    """The flat buffer of one (param group, dtype), this rank's shard of it, and the shard's
    state as flat FP32 buffers whose segment views the engine steps."""

    def __init__(self, group, params, rank, world, master_weights, slot_names):
        self.group, self.params = group, params
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets.pop()
        self.shard = -(-self.numel // world)  # ceil
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard
        dtype, device = params[0].dtype, params[0].device
        self.flat = torch.zeros(self.shard * world, dtype=dtype, device=device)
        self.flat_grad = torch.zeros_like(self.flat)
        self.grad_shard = torch.zeros(self.shard, dtype=dtype, device=device)
        for p, off in zip(params, self.offsets):
            self.flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[off:off + p.numel()].view(p.shape)
        self.grad_views = [self.flat_grad[o:o + p.numel()].view(p.shape)
                           for p, o in zip(params, self.offsets)]
        # Segments: (parameter index, start, end) in flat coordinates, inside [lo, hi).
        self.segments = [(i, max(o, self.lo), min(o + p.numel(), self.hi))
                         for i, (p, o) in enumerate(zip(params, self.offsets))
                         if max(o, self.lo) < min(o + p.numel(), self.hi)]
        f32 = dict(dtype=torch.float32, device=device)
        use_master = master_weights and dtype != torch.float32
        self.master = self.flat[self.lo:self.hi].float() if use_master else None
        self.slots = {name: torch.zeros(self.shard, **f32) for name in slot_names}
        self.steps = torch.zeros(len(self.segments), **f32)

    def seg(self, t, k):
        """Segment k of a shard-sized flat tensor."""
        _, a, b = self.segments[k]
        return t[a - self.lo:b - self.lo]

    def make_segments(self):
        """The engine's parameters: one detached view of the model's flat buffer per segment,
        whose .grad is the matching view of the reduced grad shard."""
        shard = self.flat[self.lo:self.hi]
        self.seg_params = [self.seg(shard, k).detach() for k in range(len(self.segments))]
        self.seg_grads = [self.seg(self.grad_shard, k) for k in range(len(self.segments))]

    def segment_states(self):
        """Each segment's state for the engine: views of the flat state buffers (kept, not
        copied, so the engine steps them in place)."""
        for k, seg in enumerate(self.seg_params):
            state = {"step": self.steps[k]}
            if self.master is not None:
                state["master_param"] = self.seg(self.master, k)
            state.update({n: self.seg(t, k) for n, t in self.slots.items()})
            yield seg, state

    def state_bytes(self):
        ts = ([self.master] if self.master is not None else []) + [*self.slots.values(), self.steps]
        return sum(t.numel() * t.element_size() for t in ts)


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage-1 AdamW/Adam/SGD with FP32 master weights over ``process_group``.

    ``ShardedOptimizer(params, optimizer="adamw", process_group=None, *, lr=1e-3,
    betas=(0.9, 0.999), eps=1e-8, weight_decay=None, momentum=0.0, dampening=0.0,
    nesterov=False, maximize=False, master_weights=True, max_grad_norm=None,
    grads_averaged=False, sync_params=True)``: ``optimizer`` is "adamw" (weight_decay defaults to
    1e-2), "adam" or "sgd" (0); ``max_grad_norm`` clips by the global norm (all ranks and
    groups); ``grads_averaged``: the grads are already identical on every rank (a DDP model), so
    no gradient collective is issued; ``sync_params``: broadcast the parameters from the group's
    first rank. All parameters must be on one device and every rank must run the same graph; a
    parameter without ``.grad`` is not stepped (as in torch.optim). No ``add_param_group``.
    """

    _step_supports_amp_scaling = True
    _step_checks_nonfinite = True

    def __init__(self, params, optimizer: str = "adamw", process_group=None, *, lr=1e-3,
                 betas=(0.9, 0.999), eps=1e-8, weight_decay=None, momentum=0.0, dampening=0.0,
                 nesterov=False, maximize=False, master_weights=True, max_grad_norm=None,
                 grads_averaged=False, sync_params=True):
        kind = optimizer.lower()
        if kind not in _ENGINES:
            raise ValueError(f"fusedamp.distributed: optimizer must be one of {tuple(_ENGINES)}, "
                             f"got {optimizer!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("fusedamp.distributed.ShardedOptimizer needs an initialised "
                               "torch.distributed process group (dist.init_process_group)")
        weight_decay = (1e-2 if kind == "adamw" else 0.0) if weight_decay is None else weight_decay
        defaults = dict(lr=lr, weight_decay=weight_decay, maximize=maximize,
                        master_weights=master_weights, max_grad_norm=max_grad_norm)
        defaults.update(dict(momentum=momentum, dampening=dampening, nesterov=nesterov)
                        if kind == "sgd" else dict(betas=betas, eps=eps))
        self._kind, self._group = kind, process_group
        self._world, self._rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self._grads_averaged = bool(grads_averaged)
        self._buckets = []
        super().__init__(params, defaults)
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) != 1:
            raise ValueError("fusedamp.distributed.ShardedOptimizer: all parameters must be on "
                             f"one device, got {sorted(map(str, devices))}")
        self._device = devices.pop()
        for gi, g in enumerate(self.param_groups):
            names = (("momentum_buffer",) if g["momentum"] != 0 else ()) if kind == "sgd" else (
                "exp_avg", "exp_avg_sq")
            by_dtype = {}
            for p in g["params"]:
                by_dtype.setdefault(p.dtype, []).append(p)
            self._buckets += [_Bucket(gi, ps, self._rank, self._world, g["master_weights"], names)
                              for ps in by_dtype.values()]
        for b in self._buckets:
            b.make_segments()
        self._engine = _ENGINES[kind]([[s for b in self._buckets if b.group == gi
                                        for s in b.seg_params] for gi in range(len(self.param_groups))])
        self._engine.sync_options(self.param_groups)
        self._engine.check_options()  # ValueError before anything else happens
        if sync_params and self._world > 1:
            src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
            for b in self._buckets:
                dist.broadcast(b.flat, src=src, group=process_group)
                if b.master is not None:
                    b.master.copy_(b.flat[b.lo:b.hi])
        for b in self._buckets:
            for seg, state in b.segment_states():
                self._engine.set_param_state(seg, state, copy=False)

    def add_param_group(self, param_group):
        if self._buckets:
            raise RuntimeError("fusedamp.distributed.ShardedOptimizer: add_param_group after "
                               "construction is not supported (the flat buffers are fixed)")
        super().add_param_group(param_group)

    world_size = property(lambda self: self._world)
    rank = property(lambda self: self._rank)
    last_step_applied = property(lambda self: self._engine.last_step_applied(),
                                 doc="1.0 if the last step was applied (every rank), 0.0 if not")
    skipped_steps = property(lambda self: self._engine.skipped_steps(),
                             doc="Number of skipped steps (device int64 tensor)")
    grad_sum_sq = property(lambda self: self._engine.grad_sum_sq(),
                           doc="Global sum of squares of the last step's (scaled) gradients")

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (master weights, moments and step counts of
        its shard); the flat parameter/gradient buffers are not state."""
        return sum(b.state_bytes() for b in self._buckets)

    def buffer_bytes(self) -> int:
        """Bytes of the communication buffers (flat grads and the grad shard) on this rank."""
        return sum((b.flat_grad.numel() + b.grad_shard.numel()) * b.flat.element_size()
                   for b in self._buckets)

    # ---- the step --------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One sharded step; under a loss scaler (torch's AMP protocol) a scaled one."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        self._reduce_scatter_grads()
        engine = self._engine
        engine.sync_options(self.param_groups)
        has_grads = engine.gather_grads()
        if has_grads:
            stats = engine.compute_grad_stats(found_inf)
        else:  # nothing of this rank's shard to step, but the collective is everyone's
            stats = torch.zeros(2, dtype=torch.float32, device=self._device)
            if found_inf is not None:
                stats[0:1].copy_(found_inf)
        if self._world > 1:
            dist.all_reduce(stats, group=self._group)
        if has_grads:
            engine.apply_update(grad_scale, found_inf, scaled=True)
        elif found_inf is not None:
            found_inf.copy_(stats[0:1])
        if self._world > 1:
            works = [dist.all_gather_into_tensor(b.flat, b.flat[b.lo:b.hi], group=self._group,
                                                 async_op=True) for b in self._buckets]
            for w in works:
                w.wait()
        return loss

    def _reduce_scatter_grads(self):
        works = []
        for b in self._buckets:
            present = [p.grad is not None for p in b.params]
            if any(p.grad is not None and p.grad.is_sparse for p in b.params):
                raise RuntimeError("fusedamp: sparse gradients are not supported")
            for view, here in zip(b.grad_views, present):
                if not here:
                    view.zero_()
            if any(present):
                torch._foreach_copy_([v for v, h in zip(b.grad_views, present) if h],
                                     [p.grad for p in b.params if p.grad is not None])
            for (i, _, _), seg, grad in zip(b.segments, b.seg_params, b.seg_grads):
                seg.grad = grad if present[i] else None
            if self._world == 1:
                b.grad_shard.copy_(b.flat_grad)
            elif self._grads_averaged:
                b.grad_shard.copy_(b.flat_grad[b.lo:b.hi])
            else:
                b.flat_grad.mul_(1.0 / self._world)
                works.append(dist.reduce_scatter_tensor(b.grad_shard, b.flat_grad,
                                                        group=self._group, async_op=True))
        for w in works:
            w.wait()

    # ---- checkpoints -----------------------------------------------------------------
    def state_dict(self):
        """This rank's shard of the state (load it on the same rank of the same world size)."""
        index, groups = pack_param_groups(self.param_groups)
        skipped = self._engine.skipped_steps()
        return {"format": _FORMAT, "optimizer": self._kind, "world_size": self._world,
                "rank": self._rank, "param_groups": groups,
                "skipped_steps": None if skipped is None else skipped.clone(),
                "buckets": [dict({"group": b.group, "numel": b.numel, "lo": b.lo, "hi": b.hi,
                                  "params": [index[id(p)] for p in b.params],
                                  "steps": b.steps.clone()},
                                 **({"master_param": b.master.clone()} if b.master is not None
                                    else {}),
                                 **{n: t.clone() for n, t in b.slots.items()})
                            for b in self._buckets]}

    @torch.no_grad()
    def consolidated_state_dict(self, to=0):
        """Gathers the full per-parameter state (fusedamp.optim's format) to rank ``to`` of the
        process group (None: to every rank). A collective: call it on every rank. Returns the
        state dict on the receiving rank(s), None elsewhere."""
        index, groups = pack_param_groups(self.param_groups)
        receiving = to is None or self._rank == to
        state = {}
        for b in self._buckets:
            full = {}
            named = ([("master_param", b.master)] if b.master is not None else []) + list(
                b.slots.items())
            for name, t in named:
                full[name] = torch.empty(b.shard * self._world, dtype=t.dtype, device=t.device)
                dist.all_gather_into_tensor(full[name], t, group=self._group)
            # Each parameter's step from the segment holding its first element: exactly one
            # rank contributes a non-zero to each entry of this sum.
            steps = torch.zeros(len(b.params), dtype=torch.float32, device=self._device)
            for k, (i, a, _) in enumerate(b.segments):
                if a == b.offsets[i]:
                    steps[i] = b.steps[k]
            dist.all_reduce(steps, group=self._group)
            if receiving:
                for i, (p, off) in enumerate(zip(b.params, b.offsets)):
                    state[index[id(p)]] = dict(
                        {n: t[off:off + p.numel()].view(p.shape).cpu().clone()
                         for n, t in full.items()}, step=steps[i].cpu().clone())
        return {"state": state, "param_groups": groups} if receiving else None

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        """Loads a shard (``state_dict()`` of the same rank and world size) or a full state
        (``consolidated_state_dict()``, or a fusedamp.optim state dict) on any world size.
        Everything is checked before anything is changed."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(m["params"]) != len(t["params"]) for m, t in zip(self.param_groups, groups)):
            raise ValueError("fusedamp.distributed: the state dict's param groups do not match "
                             "this optimizer's")
        index, _ = pack_param_groups(self.param_groups)
        if state_dict.get("format") == _FORMAT:
            writes = self._shard_writes(state_dict, index)
            skipped = state_dict.get("skipped_steps")
        else:
            writes = self._full_writes(state_dict["state"], index)
            skipped = None
        for dst, src in writes:
            dst.copy_(src)
        if skipped is not None:
            self._engine.set_skipped_steps(skipped)
        for mine, theirs in zip(self.param_groups, groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})

    def _shard_writes(self, sd, index):
        if sd["world_size"] != self._world or sd["rank"] != self._rank:
            raise ValueError(f"fusedamp.distributed: shard of rank {sd['rank']}/"
                             f"{sd['world_size']} cannot be loaded on rank {self._rank}/"
                             f"{self._world}; load a consolidated_state_dict() instead")
        if sd["optimizer"] != self._kind or len(sd["buckets"]) != len(self._buckets):
            raise ValueError("fusedamp.distributed: the shard was saved by another optimizer "
                             "layout")
        writes = []
        for b, e in zip(self._buckets, sd["buckets"]):
            if (e["numel"] != b.numel or e["lo"] != b.lo or e["hi"] != b.hi
                    or e["params"] != [index[id(p)] for p in b.params]
                    or ("master_param" in e) != (b.master is not None)):
                raise ValueError("fusedamp.distributed: the shard's buckets do not match this "
                                 "optimizer's (different parameters or dtypes)")
            writes += [(b.steps, e["steps"])] + [(t, e[n]) for n, t in b.slots.items()] + (
                [(b.master, e["master_param"])] if b.master is not None else [])
        return writes

    def _full_writes(self, state, index):
        """Per segment: the piece of each parameter's full state (fresh state where the
        parameter was never stepped: step 0, master = the weights, moments 0)."""
        writes = []
        for b in self._buckets:
            for k, (i, a, e) in enumerate(b.segments):
                p = b.params[i]
                s = state.get(index[id(p)], {})
                for name, v in s.items():
                    if name != "step" and tuple(v.shape) != tuple(p.shape):
                        raise ValueError(f"fusedamp.distributed: state {name!r} of parameter "
                                         f"{index[id(p)]} has shape {tuple(v.shape)}, the "
                                         f"parameter {tuple(p.shape)}")
                lo, hi = a - b.offsets[i], e - b.offsets[i]  # within the parameter
                writes.append((b.steps[k], torch.tensor(float(s["step"].reshape(-1)[0]))
                               if s else torch.zeros(())))
                if b.master is not None:
                    writes.append((b.seg(b.master, k),
                                   s.get("master_param", p.detach()).reshape(-1)[lo:hi]))
                for name, t in b.slots.items():
                    writes.append((b.seg(t, k), s[name].reshape(-1)[lo:hi] if name in s
                                   else torch.zeros(hi - lo)))
        return writes
