"""torch.optim-style master-weight optimizers backed by the C++ engine.

``AdamW``, ``Adam`` and ``SGD`` are ``torch.optim.Optimizer`` subclasses: param groups, LR
schedulers, ``zero_grad``, hooks and ``state_dict`` work as in torch. Each step pushes the
groups' hyper-parameters into the engine (fusedamp._C) and runs it there: one read-only
``grad_stats_`` pass per device (when clipping, loss scaling or non-finite protection need it)
and one fused ``adam_step_``/``sgd_step_`` per (group, device, dtype) bucket. No host
synchronisation; a step whose gradients hold inf/NaN changes nothing.

Extra arguments over torch's:
  master_weights (default True)  FP32 master copy for FP16/BF16 parameters
  max_grad_norm  (default None)  fused global-norm clipping (clip_grad_norm_'s formula)
  skip_nonfinite (default True)  skip the step on inf/NaN even without a loss scaler
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable

import torch

from ._library import _C
from .diagnostics import History

__all__ = ["AdamW", "Adam", "SGD", "FusedOptimizer"]

_BOOL_OPTIONS = ("maximize", "master_weights", "skip_nonfinite", "nesterov")


class FusedOptimizer(torch.optim.Optimizer):
    """Common machinery; see AdamW, Adam and SGD."""

    _engine_cls = None  # set by subclasses
    _pushed_names: tuple = ()

    def __init__(self, params, defaults: Dict[str, Any]):
        self._engine = None
        super().__init__(params, defaults)
        self._build_engine()
        self._grad_norms = History()

    # ---- engine construction and hyper-parameter push ---------------------------------
    def _build_engine(self):
        for i, g in enumerate(self.param_groups):
            self._validate_group(g, i)
        self._engine = self._engine_cls([list(g["params"]) for g in self.param_groups])
        self._pushed = [dict() for _ in self.param_groups]
        self._push_options()

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if self._engine is not None:  # during __init__ the engine is built once at the end
            state = {p: self._engine.param_state(p) for g in self.param_groups[:-1]
                     for p in g["params"]}
            self._build_engine()
            for p, s in state.items():
                if s:
                    self._engine.set_param_state(p, s)

    def _group_values(self, group):
        raise NotImplementedError

    def _validate_group(self, group, index):
        if group.get("amsgrad", False):
            raise ValueError("fusedamp: amsgrad is not supported")
        if group.get("differentiable", False):
            raise ValueError("fusedamp: differentiable=True is not supported")
        for p in group["params"]:
            if not isinstance(p, torch.Tensor) or not p.is_leaf:
                raise ValueError("fusedamp: optimizer can only optimize leaf tensors")
            if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"fusedamp: unsupported parameter dtype {p.dtype}")

    def _push_options(self):
        """Writes each group's current values into the engine (only those that changed):
        this is how LR schedulers and manual edits of param_groups reach the C++ step."""
        engine = self._engine
        for i, group in enumerate(self.param_groups):
            pushed = self._pushed[i]
            lr = group["lr"]
            if isinstance(lr, torch.Tensor):
                if pushed.get("lr_tensor") is not lr:
                    engine.set_group_lr_tensor(i, lr.detach().float().reshape(1)
                                               if lr.dtype != torch.float32 or lr.dim() != 1
                                               else lr)
                    pushed["lr_tensor"] = lr
            elif pushed.get("lr") != lr or "lr_tensor" in pushed:
                if "lr_tensor" in pushed:
                    engine.set_group_lr_tensor(i, torch.Tensor())
                    del pushed["lr_tensor"]
                engine.set_group_option(i, "lr", float(lr))
                pushed["lr"] = lr
            for name, value in self._group_values(group):
                if pushed.get(name) != value:
                    engine.set_group_option(i, name, float(value))
                    pushed[name] = value

    # ---- the step --------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, *, _scaled_by=None):
        """One fused step. (``_scaled_by`` is how fusedamp.GradScaler.step routes its scaled
        step through here, so that step hooks and LR-scheduler bookkeeping see it.)"""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._push_options()
        if _scaled_by is not None:
            _scaled_by._fused_step(self)
            return loss
        self._engine.step()
        # grad_stats_ ran in this step when clipping or non-finite protection is on: its sum
        # of squares gives the global gradient norm, kept on the device.
        if any(g["max_grad_norm"] or g["skip_nonfinite"] for g in self.param_groups):
            self._record_grad_norm(None)
        return loss

    def _record_grad_norm(self, inv_scale):
        sum_sq = self._engine.grad_sum_sq()
        if sum_sq is not None:
            norm = sum_sq.sqrt()
            self._grad_norms.record(norm if inv_scale is None else norm * inv_scale)

    def grad_norm_history(self):
        """Global gradient norm (unscaled, before clipping) of each recorded step, oldest
        first (one synchronisation). Steps after an explicit scaler.unscale_() without
        clipping are not recorded (no norm pass ran)."""
        return self._grad_norms.values()

    # ---- step accounting (device tensors; reading them is the caller's choice) ---------
    @property
    def last_step_applied(self):
        """1.0 if the last step was applied, 0.0 if skipped (device tensor; None before)."""
        return self._engine.last_step_applied()

    @property
    def skipped_steps(self):
        """Number of skipped steps (device int64 tensor; None before the first step)."""
        return self._engine.skipped_steps()

    @property
    def grad_sum_sq(self):
        """Sum of squares of the last step's (scaled) gradients (device tensor)."""
        return self._engine.grad_sum_sq()

    # ---- state ----------------------------------------------------------------------
    @property
    def state(self):
        # torch.optim keeps per-parameter state in self.state; here it lives in the engine and
        # is exposed as the tensors themselves (no copies).
        if getattr(self, "_engine", None) is None:
            return self.__dict__.setdefault("_pre_state", {})
        out = {}
        for g in self.param_groups:
            for p in g["params"]:
                s = self._engine.param_state(p)
                if s:
                    out[p] = s
        return out

    @state.setter
    def state(self, value):
        self.__dict__["_pre_state"] = value

    def state_dict(self):
        index, groups = pack_param_groups(self.param_groups)
        state = {}
        for g in self.param_groups:
            for p in g["params"]:
                s = self._engine.param_state(p)
                if s:
                    state[index[id(p)]] = {k: v.clone() for k, v in s.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("fusedamp: loaded state dict has a different number of param groups")
        for mine, theirs in zip(self.param_groups, groups):
            if len(mine["params"]) != len(theirs["params"]):
                raise ValueError("fusedamp: loaded state dict contains a parameter group that "
                                 "doesn't match the size of optimizer's group")
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in groups for i in g["params"]]
        # Validate every entry before touching anything: the engine checks shapes and keys.
        for i, p in zip(ids, params):
            s = state_dict["state"].get(i)
            if s is not None:
                for k, v in s.items():
                    if not isinstance(v, torch.Tensor):
                        raise ValueError(f"fusedamp: state entry {k!r} of parameter {i} is not a tensor")
                    if k != "step" and v.shape != p.shape:
                        raise ValueError(f"fusedamp: state {k!r} of parameter {i} has shape "
                                         f"{tuple(v.shape)}, the parameter {tuple(p.shape)}")
        for i, p in zip(ids, params):
            s = state_dict["state"].get(i)
            if s is not None:
                self._engine.set_param_state(p, dict(s))
        for mine, theirs in zip(self.param_groups, groups):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = v
        self._pushed = [dict() for _ in self.param_groups]
        self._push_options()

    def __getstate__(self):
        raise TypeError("fusedamp optimizers are not picklable; use state_dict()")


def pack_param_groups(param_groups):
    """torch.optim's state_dict layout of param groups: each parameter replaced by its index
    in group order. Returns ({id(param): index}, packed groups)."""
    index, groups = {}, []
    for g in param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = []
        for p in g["params"]:
            index.setdefault(id(p), len(index))
            packed["params"].append(index[id(p)])
        groups.append(packed)
    return index, groups


def _check_common(lr, eps, weight_decay, max_grad_norm):
    if not isinstance(lr, torch.Tensor) and (not math.isfinite(lr) or lr < 0.0):
        raise ValueError(f"Invalid learning rate: {lr}")
    if eps is not None and (not math.isfinite(eps) or eps < 0.0):
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not math.isfinite(weight_decay) or weight_decay < 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if max_grad_norm is not None and not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
        raise ValueError(f"Invalid max_grad_norm: {max_grad_norm} (None or > 0)")


class Adam(FusedOptimizer):
    """torch.optim.Adam (L2 weight decay) with FP32 master weights; see the module doc."""

    _engine_cls = _C.Adam
    _decoupled = False

    def __init__(self, params: Iterable, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, master_weights=True, max_grad_norm=None,
                 skip_nonfinite=True, decoupled_weight_decay=None):
        _check_common(lr, eps, weight_decay, max_grad_norm)
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if decoupled_weight_decay is not None and bool(decoupled_weight_decay) != self._decoupled:
            raise ValueError("fusedamp: use fusedamp.optim.AdamW for decoupled weight decay")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused,
                        master_weights=master_weights, max_grad_norm=max_grad_norm,
                        skip_nonfinite=skip_nonfinite)
        super().__init__(params, defaults)

    def _group_values(self, g):
        b1, b2 = g["betas"]
        return (("beta1", b1), ("beta2", b2), ("eps", g["eps"]),
                ("weight_decay", g["weight_decay"]), ("maximize", bool(g["maximize"])),
                ("master_weights", bool(g["master_weights"])),
                ("skip_nonfinite", bool(g["skip_nonfinite"])),
                ("max_grad_norm", g["max_grad_norm"] if g["max_grad_norm"] else 0.0))


class AdamW(Adam):
    """torch.optim.AdamW (decoupled weight decay) with FP32 master weights."""

    _engine_cls = _C.AdamW
    _decoupled = True

    def __init__(self, params: Iterable, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, amsgrad=False, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class SGD(FusedOptimizer):
    """torch.optim.SGD with FP32 master weights; see the module doc."""

    _engine_cls = _C.SGD

    def __init__(self, params: Iterable, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, foreach=None, differentiable=False,
                 fused=None, master_weights=True, max_grad_norm=None, skip_nonfinite=True):
        _check_common(lr, None, weight_decay, max_grad_norm)
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach,
                        differentiable=differentiable, fused=fused, master_weights=master_weights,
                        max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite)
        super().__init__(params, defaults)

    def _group_values(self, g):
        return (("momentum", g["momentum"]), ("dampening", g["dampening"]),
                ("weight_decay", g["weight_decay"]), ("nesterov", bool(g["nesterov"])),
                ("maximize", bool(g["maximize"])), ("master_weights", bool(g["master_weights"])),
                ("skip_nonfinite", bool(g["skip_nonfinite"])),
                ("max_grad_norm", g["max_grad_norm"] if g["max_grad_norm"] else 0.0))
