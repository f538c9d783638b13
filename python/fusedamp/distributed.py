"""fusedamp on torch.distributed: a ZeRO stage-1 sharded master-weight optimizer.

``ShardedOptimizer`` is a ``torch.optim.Optimizer`` (LR schedulers work) that keeps the FP32
master weights and the optimizer moments of only this rank's 1/N of the parameters. All
communication goes through ``torch.distributed`` collectives on ``process_group``.

Layout. The parameters of each (param group, dtype) are packed into one flat buffer, padded to
a multiple of the world size; every parameter's ``.data`` becomes a view of that buffer, so
the all-gather at the end of a step writes the model weights directly. Rank r owns the
contiguous slice ``[r*S, (r+1)*S)`` of each buffer (S = padded numel / N) and keeps, for it
only, flat FP32 master/moment tensors. Inside a shard a parameter's piece is a *segment*: the
fused ops see one tensor per segment, each with its own step count, so a sharded step does
exactly what ``fusedamp.optim`` does for those elements.

One step (no host synchronisation):
  1. copy the grads into a flat grad buffer per bucket (one ``_foreach_copy_``), pre-divide by
     N (as DDP does, so that the FP16 sum cannot overflow where the mean would not) and
     reduce-scatter it into this rank's shard;
  2. ``grad_stats_`` over the shard -> found_inf and sum of squares in a 2-element FP32 tensor,
     summed over the ranks in ONE all-reduce: every rank sees the global overflow flag and the
     global gradient norm, so the skip decision and the clip coefficient are the same everywhere;
  3. ``adam_step_``/``sgd_step_`` on the shard (FP32 master -> FP16/BF16 shard of the model),
     skipped on the device when found_inf != 0;
  4. all-gather the low-precision shards into the flat buffers (on a skipped step this rewrites
     the unchanged values, so all ranks stay bit-identical).

Loss scaling: ``scaler.step(opt)`` / ``scaler.update()`` with a ``fusedamp.GradScaler`` (the
scaler hands its inverse scale over and records the global found_inf, so the scale sequence is
the same on every rank), or ``opt.step(inv_scale=...)`` by hand.

Checkpoints: ``state_dict()`` is this rank's shard (resume on the same number of ranks is
bit-exact); ``consolidated_state_dict(to=0)`` gathers the full per-parameter state in the format
of ``fusedamp.optim`` (``step``, ``master_param``, ``exp_avg``, ...), which
``load_state_dict`` accepts on any number of ranks (and ``fusedamp.optim.AdamW`` loads too).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ._library import _C  # noqa: F401  (registers torch.ops.fusedamp)
from .optim import pack_param_groups

__all__ = ["ShardedOptimizer", "optimizer_state_bytes"]

_FORMAT = "fusedamp.sharded/1"
_KINDS = ("adamw", "adam", "sgd")


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state held by this process: the shard's state for a
    ``ShardedOptimizer``; every tensor in ``optimizer.state`` otherwise."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.state_bytes()
    total = 0
    for s in optimizer.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


class _Bucket:
    """The flat buffer of one (param group, dtype) and this rank's shard of it."""

    def __init__(self, group_index, params, dtype, device, rank, world, master_weights, slots):
        self.group = group_index
        self.params = params
        self.dtype = dtype
        self.offsets = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.shard = -(-n // world)  # ceil
        padded = self.shard * world
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard
        self.flat = torch.zeros(padded, dtype=dtype, device=device)
        self.flat_grad = torch.zeros(padded, dtype=dtype, device=device)
        self.grad_shard = torch.zeros(self.shard, dtype=dtype, device=device)
        with torch.no_grad():
            for p, off in zip(params, self.offsets):
                self.flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.flat[off:off + p.numel()].view(p.shape)
        self.grad_views = [self.flat_grad[o:o + p.numel()].view(p.shape)
                           for p, o in zip(params, self.offsets)]
        # Segments: (parameter index, start, end) in flat coordinates, inside [lo, hi).
        self.segments = []
        for i, (p, off) in enumerate(zip(params, self.offsets)):
            a, b = max(off, self.lo), min(off + p.numel(), self.hi)
            if a < b:
                self.segments.append((i, a, b))
        f32 = dict(dtype=torch.float32, device=device)
        shard_param = self.flat[self.lo:self.hi]
        self.master = (shard_param.float() if master_weights and dtype != torch.float32
                       else None)
        self.slots = [torch.zeros(self.shard, **f32) for _ in range(slots)]
        self.steps = torch.zeros(len(self.segments), **f32)

        def seg(t):
            return [t[a - self.lo:b - self.lo] for _, a, b in self.segments]

        self.seg_params = seg(shard_param)
        self.seg_grads = seg(self.grad_shard)
        self.seg_master = seg(self.master) if self.master is not None else []
        self.seg_slots = [seg(s) for s in self.slots]
        self.seg_steps = [self.steps[k:k + 1] for k in range(len(self.segments))]

    def state_bytes(self):
        ts = ([self.master] if self.master is not None else []) + self.slots + [self.steps]
        return sum(t.numel() * t.element_size() for t in ts)


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage-1 AdamW/Adam/SGD with FP32 master weights over ``process_group``.

    ``ShardedOptimizer(params, optimizer="adamw", process_group=None, *, lr=1e-3,
    betas=(0.9, 0.999), eps=1e-8, weight_decay=None, momentum=0.0, dampening=0.0,
    nesterov=False, maximize=False, master_weights=True, max_grad_norm=None,
    grads_averaged=False, sync_params=True)``

    - ``optimizer``: "adamw" (weight_decay defaults to 1e-2), "adam" or "sgd" (defaults to 0).
    - ``max_grad_norm``: fused clipping by the global norm (all ranks, all groups).
    - ``grads_averaged``: the grads are already identical on every rank (e.g. a DDP model);
      then each rank just uses its shard and no gradient collective is issued.
    - ``sync_params``: broadcast the parameters from the group's first rank at construction.

    Every parameter must be on one device; the model must run the same graph on every rank. A
    parameter whose ``.grad`` is None on the rank owning a segment of it is not stepped there
    (as in torch.optim). ``add_param_group`` after construction is not supported.
    """

    def __init__(self, params, optimizer: str = "adamw", process_group=None, *, lr=1e-3,
                 betas=(0.9, 0.999), eps=1e-8, weight_decay=None, momentum=0.0, dampening=0.0,
                 nesterov=False, maximize=False, master_weights=True, max_grad_norm=None,
                 grads_averaged=False, sync_params=True):
        kind = optimizer.lower()
        if kind not in _KINDS:
            raise ValueError(f"fusedamp.distributed: optimizer must be one of {_KINDS}, got "
                             f"{optimizer!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("fusedamp.distributed.ShardedOptimizer needs an initialised "
                               "torch.distributed process group (dist.init_process_group)")
        if weight_decay is None:
            weight_decay = 1e-2 if kind == "adamw" else 0.0
        if kind == "sgd":
            defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                            weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                            master_weights=master_weights, max_grad_norm=max_grad_norm)
        else:
            defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                            maximize=maximize, master_weights=master_weights,
                            max_grad_norm=max_grad_norm)
        self._kind = kind
        self._group = process_group
        self._world = dist.get_world_size(process_group)
        self._rank = dist.get_rank(process_group)
        self._grads_averaged = bool(grads_averaged)
        self._buckets: List[_Bucket] = []
        super().__init__(params, defaults)
        for i, g in enumerate(self.param_groups):
            self._validate_group(g, i)
        params_all = [p for g in self.param_groups for p in g["params"]]
        devices = {p.device for p in params_all}
        if len(devices) != 1:
            raise ValueError("fusedamp.distributed.ShardedOptimizer: all parameters must be on "
                             f"one device, got {sorted(map(str, devices))}")
        self._device = devices.pop()
        slots = 2 if kind != "sgd" else 0
        for gi, g in enumerate(self.param_groups):
            if kind == "sgd":
                slots = 1 if g["momentum"] != 0 else 0
            by_dtype: Dict[torch.dtype, list] = {}
            for p in g["params"]:
                by_dtype.setdefault(p.dtype, []).append(p)
            for dtype, ps in by_dtype.items():
                self._buckets.append(_Bucket(gi, ps, dtype, self._device, self._rank,
                                             self._world, bool(g["master_weights"]), slots))
        if sync_params and self._world > 1:
            src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
            for b in self._buckets:
                dist.broadcast(b.flat, src=src, group=process_group)
            for b in self._buckets:
                if b.master is not None:
                    b.master.copy_(b.flat[b.lo:b.hi])
        f32 = dict(dtype=torch.float32, device=self._device)
        self._stats = torch.zeros(2, **f32)  # [found_inf, sum of squares], summed over ranks
        self._last_applied = None
        self._skipped = None

    def _validate_group(self, g, i):
        lr = g["lr"]
        if not isinstance(lr, torch.Tensor) and (not math.isfinite(lr) or lr < 0):
            raise ValueError(f"Invalid learning rate: {lr}")
        if g["weight_decay"] < 0 or not math.isfinite(g["weight_decay"]):
            raise ValueError(f"Invalid weight_decay value: {g['weight_decay']}")
        mgn = g["max_grad_norm"]
        if mgn is not None and not (mgn > 0 and math.isfinite(mgn)):
            raise ValueError(f"Invalid max_grad_norm: {mgn} (None or > 0)")
        if self._kind != "sgd":
            b1, b2 = g["betas"]
            if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
                raise ValueError(f"Invalid betas: {g['betas']}")
            if g["eps"] < 0:
                raise ValueError(f"Invalid epsilon value: {g['eps']}")
        else:
            if g["momentum"] < 0:
                raise ValueError(f"Invalid momentum value: {g['momentum']}")
            if g["nesterov"] and (g["momentum"] <= 0 or g["dampening"] != 0):
                raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        for p in g["params"]:
            if not isinstance(p, torch.Tensor) or not p.is_leaf:
                raise ValueError("fusedamp: optimizer can only optimize leaf tensors")
            if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"fusedamp: unsupported parameter dtype {p.dtype}")

    def add_param_group(self, param_group):
        if self._buckets:
            raise RuntimeError("fusedamp.distributed.ShardedOptimizer: add_param_group after "
                               "construction is not supported (the flat buffers are fixed)")
        super().add_param_group(param_group)

    # ---- properties ------------------------------------------------------------------
    @property
    def world_size(self):
        return self._world

    @property
    def rank(self):
        return self._rank

    @property
    def last_step_applied(self):
        """1.0 if the last step was applied on every rank, 0.0 if skipped (device tensor)."""
        return self._last_applied

    @property
    def skipped_steps(self):
        """Number of skipped steps (device int64 tensor; None before the first step)."""
        return self._skipped

    @property
    def grad_sum_sq(self):
        """Global sum of squares of the last step's (scaled, averaged) gradients."""
        return self._stats[1:2]

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (master weights, moments, step counts of
        its shard); the flat parameter/gradient buffers are not state."""
        return sum(b.state_bytes() for b in self._buckets)

    def buffer_bytes(self) -> int:
        """Bytes of the communication buffers (flat grads and the grad shard) on this rank."""
        return sum(b.flat_grad.numel() * b.flat_grad.element_size()
                   + b.grad_shard.numel() * b.grad_shard.element_size() for b in self._buckets)

    # ---- the step --------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, *, inv_scale: Optional[torch.Tensor] = None):
        """One sharded step. ``inv_scale``: the inverse loss scale as a 1-element FP32 device
        tensor (what ``fusedamp.GradScaler.step(opt)`` passes). Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sharded_step(inv_scale)
        return loss

    def _fusedamp_step_scaled(self, inv_scale):
        """The protocol fusedamp.GradScaler.step uses: step with this inverse scale and return
        the found_inf that every rank agrees on (for the scaler's update)."""
        self.step(inv_scale=inv_scale)  # through torch's wrapper: hooks, LR-scheduler checks
        return self._stats[0:1]

    def _sharded_step(self, inv_scale):
        group, world = self._group, self._world
        has_grad = []
        for b in self._buckets:
            flags = [p.grad is not None for p in b.params]
            for p in b.params:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError("fusedamp: sparse gradients are not supported")
            dst = [v for v, f in zip(b.grad_views, flags) if f]
            src = [p.grad for p, f in zip(b.params, flags) if f]
            if len(dst) < len(flags):
                for v, f in zip(b.grad_views, flags):
                    if not f:
                        v.zero_()
            if dst:
                torch._foreach_copy_(dst, src)
            has_grad.append(flags)
        works = []
        for b in self._buckets:
            if world == 1:
                b.grad_shard.copy_(b.flat_grad)
            elif self._grads_averaged:
                b.grad_shard.copy_(b.flat_grad[b.lo:b.hi])
            else:
                b.flat_grad.mul_(1.0 / world)
                works.append(dist.reduce_scatter_tensor(b.grad_shard, b.flat_grad,
                                                        group=group, async_op=True))
        for w in works:
            w.wait()
        # Segments stepped on this rank: those whose parameter has a gradient here.
        live = [[k for k, (i, _, _) in enumerate(b.segments) if flags[i]]
                for b, flags in zip(self._buckets, has_grad)]
        stats = self._stats
        stats.zero_()
        found, sum_sq = stats[0:1], stats[1:2]
        grads = [b.seg_grads[k] for b, ks in zip(self._buckets, live) for k in ks]
        if grads:
            torch.ops.fusedamp.grad_stats_(grads, found, sum_sq)
        if world > 1:
            dist.all_reduce(stats, group=group)
        if inv_scale is not None:
            inv_scale = inv_scale.to(self._device, non_blocking=True).reshape(1).float()
        for b, ks in zip(self._buckets, live):
            if ks:
                self._run_bucket(b, ks, inv_scale, found, sum_sq)
        works = [dist.all_gather_into_tensor(b.flat, b.flat[b.lo:b.hi], group=group,
                                             async_op=True)
                 for b in self._buckets if world > 1]
        for w in works:
            w.wait()
        skipped = found.ne(0)
        if self._skipped is None:
            self._skipped = torch.zeros(1, dtype=torch.int64, device=self._device)
            self._last_applied = torch.ones(1, dtype=torch.float32, device=self._device)
        self._skipped.add_(skipped)
        self._last_applied.copy_(skipped.logical_not())

    def _run_bucket(self, b, ks, inv_scale, found, sum_sq):
        g = self.param_groups[b.group]

        def pick(lst):
            return [lst[k] for k in ks]

        lr = g["lr"]
        lr_tensor = None
        if isinstance(lr, torch.Tensor):
            lr_tensor = lr.detach().to(self._device).float().reshape(1)
            lr = 0.0
        mgn = g["max_grad_norm"]
        common = dict(lr=float(lr), weight_decay=float(g["weight_decay"]),
                      maximize=bool(g["maximize"]), lr_tensor=lr_tensor, inv_scale=inv_scale,
                      found_inf=found, grad_sum_sq=sum_sq if mgn else None,
                      max_grad_norm=float(mgn) if mgn else None)
        masters = pick(b.seg_master) if b.master is not None else []
        if self._kind == "sgd":
            torch.ops.fusedamp.sgd_step_(
                pick(b.seg_params), masters, pick(b.seg_grads),
                pick(b.seg_slots[0]) if b.slots else [], pick(b.seg_steps),
                momentum=float(g["momentum"]), dampening=float(g["dampening"]),
                nesterov=bool(g["nesterov"]), **common)
        else:
            b1, b2 = g["betas"]
            torch.ops.fusedamp.adam_step_(
                pick(b.seg_params), masters, pick(b.seg_grads), pick(b.seg_slots[0]),
                pick(b.seg_slots[1]), pick(b.seg_steps), beta1=float(b1), beta2=float(b2),
                eps=float(g["eps"]), decoupled_weight_decay=self._kind == "adamw", **common)

    # ---- checkpoints -----------------------------------------------------------------
    def _slot_names(self):
        if self._kind == "sgd":
            return ("momentum_buffer",)
        return ("exp_avg", "exp_avg_sq")

    def _packed_groups(self):
        return pack_param_groups(self.param_groups)

    def state_dict(self) -> Dict[str, Any]:
        """This rank's shard of the state (load it on the same rank of the same world size)."""
        index, groups = self._packed_groups()
        names = self._slot_names()
        buckets = []
        for b in self._buckets:
            entry = {"group": b.group, "dtype": str(b.dtype), "numel": b.numel,
                     "params": [index[id(p)] for p in b.params], "lo": b.lo, "hi": b.hi,
                     "steps": b.steps.clone()}
            if b.master is not None:
                entry["master_param"] = b.master.clone()
            for name, s in zip(names, b.slots):
                entry[name] = s.clone()
            buckets.append(entry)
        return {"format": _FORMAT, "optimizer": self._kind, "world_size": self._world,
                "rank": self._rank, "param_groups": groups, "buckets": buckets,
                "skipped_steps": None if self._skipped is None else self._skipped.clone()}

    @torch.no_grad()
    def consolidated_state_dict(self, to: Optional[int] = 0) -> Optional[Dict[str, Any]]:
        """Gathers the full per-parameter state (the format of fusedamp.optim) to rank ``to``
        of the process group (None: to every rank). A collective: call it on every rank.
        Returns the state dict on the receiving rank(s), None elsewhere."""
        index, groups = self._packed_groups()
        names = self._slot_names()
        state: Dict[int, Dict[str, torch.Tensor]] = {}
        for b in self._buckets:
            full = {}
            pieces = ([("master_param", b.master)] if b.master is not None else []) + list(
                zip(names, b.slots))
            for name, t in pieces:
                out = torch.empty(b.shard * self._world, dtype=t.dtype, device=t.device)
                dist.all_gather_into_tensor(out, t, group=self._group)
                full[name] = out
            # Each parameter's step from the segment holding its first element: exactly one
            # rank contributes a non-zero to each entry of this sum.
            steps = torch.zeros(len(b.params), dtype=torch.float32, device=self._device)
            for k, (i, a, _) in enumerate(b.segments):
                if a == b.offsets[i]:
                    steps[i] = b.steps[k]
            dist.all_reduce(steps, group=self._group)
            if to is not None and self._rank != to:
                continue
            steps = steps.cpu()
            for i, (p, off) in enumerate(zip(b.params, b.offsets)):
                s = {"step": steps[i].clone()}
                for name, t in full.items():
                    s[name] = t[off:off + p.numel()].view(p.shape).cpu().clone()
                state[index[id(p)]] = s
        if to is not None and self._rank != to:
            return None
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: Dict[str, Any]):
        """Loads a shard (``state_dict()`` of the same rank and world size) or a full state
        (``consolidated_state_dict()``, or a fusedamp.optim state dict) on any world size."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(m["params"]) != len(t["params"]) for m, t in zip(self.param_groups, groups)):
            raise ValueError("fusedamp.distributed: the state dict's param groups do not match "
                             "this optimizer's")
        if state_dict.get("format") == _FORMAT:
            self._load_shard(state_dict)
        else:
            self._load_full(state_dict)
        for mine, theirs in zip(self.param_groups, groups):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = v

    def _load_shard(self, sd):
        if sd["world_size"] != self._world or sd["rank"] != self._rank:
            raise ValueError(f"fusedamp.distributed: shard of rank {sd['rank']}/"
                             f"{sd['world_size']} cannot be loaded on rank {self._rank}/"
                             f"{self._world}; load a consolidated_state_dict() instead")
        if sd["optimizer"] != self._kind or len(sd["buckets"]) != len(self._buckets):
            raise ValueError("fusedamp.distributed: the shard was saved by another optimizer "
                             "layout")
        index, _ = self._packed_groups()
        names = self._slot_names()
        for b, e in zip(self._buckets, sd["buckets"]):
            if (e["numel"] != b.numel or e["lo"] != b.lo or e["hi"] != b.hi
                    or e["params"] != [index[id(p)] for p in b.params]
                    or ("master_param" in e) != (b.master is not None)):
                raise ValueError("fusedamp.distributed: the shard's buckets do not match this "
                                 "optimizer's (different parameters or dtypes)")
        for b, e in zip(self._buckets, sd["buckets"]):
            b.steps.copy_(e["steps"])
            if b.master is not None:
                b.master.copy_(e["master_param"])
            for name, s in zip(names, b.slots):
                s.copy_(e[name])
        if sd.get("skipped_steps") is not None:
            self._skipped = sd["skipped_steps"].to(self._device).clone()
            self._last_applied = torch.ones(1, dtype=torch.float32, device=self._device)

    def _load_full(self, sd):
        index, _ = self._packed_groups()
        names = self._slot_names()
        state = sd["state"]
        for b in self._buckets:  # validate everything before changing anything
            for p in b.params:
                s = state.get(index[id(p)])
                if s is None:
                    continue
                for k, v in s.items():
                    if k != "step" and tuple(v.shape) != tuple(p.shape):
                        raise ValueError(f"fusedamp.distributed: state {k!r} of parameter "
                                         f"{index[id(p)]} has shape {tuple(v.shape)}, the "
                                         f"parameter {tuple(p.shape)}")
        for b in self._buckets:
            for k, (i, a, e) in enumerate(b.segments):
                p = b.params[i]
                s = state.get(index[id(p)])
                lo, hi = a - b.offsets[i], e - b.offsets[i]  # within the parameter
                if s is None:  # never stepped: fresh state
                    b.steps[k] = 0
                    if b.master is not None:
                        b.seg_master[k].copy_(p.detach().reshape(-1)[lo:hi])
                    for seg in b.seg_slots:
                        seg[k].zero_()
                    continue
                b.steps[k] = float(s["step"].reshape(-1)[0])
                if b.master is not None:
                    src = s.get("master_param", p.detach())
                    b.seg_master[k].copy_(src.reshape(-1)[lo:hi])
                for name, seg in zip(names, b.seg_slots):
                    if name in s:
                        seg[k].copy_(s[name].reshape(-1)[lo:hi])
                    else:
                        seg[k].zero_()
