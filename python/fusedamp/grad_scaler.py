"""fusedamp.GradScaler — a drop-in for torch.amp.GradScaler, with the state on the device.

With fusedamp's optimizers, ``scale -> backward -> step -> update`` never synchronises with the
host: the scaler hands its device-side inverse scale and ``found_inf`` to the fused step,
which skips itself on the device. With any other ``torch.optim`` optimizer it unscales with
the fused check and, as torch.amp does, reads ``found_inf`` on the host before stepping.

Beyond torch's arguments: ``hysteresis`` (back off only after that many overflowing steps in
a row), ``min_scale`` and ``max_scale``. With hysteresis 1 and no bounds the scale sequence is
torch's. The scale history is kept on the device (``scale_history()``).
"""
from __future__ import annotations

import warnings
from collections import defaultdict

import torch

from ._library import _C
from .diagnostics import History
from .optim import FusedOptimizer

__all__ = ["GradScaler"]

_READY, _UNSCALED, _STEPPED = 0, 1, 2


class GradScaler:
    def __init__(self, device="cuda", init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True, *, hysteresis=1, min_scale=None,
                 max_scale=None, history=True):
        device = torch.device(device)
        if enabled and device.type == "cuda" and not torch.cuda.is_available():
            warnings.warn("fusedamp.GradScaler is enabled, but CUDA is not available. "
                          "Disabling.")
            enabled = False
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        self._enabled = bool(enabled)
        self._engine = _C.GradScaler(str(device), float(init_scale), float(growth_factor),
                                     float(backoff_factor), int(growth_interval), self._enabled,
                                     int(hysteresis), None if min_scale is None else float(min_scale),
                                     None if max_scale is None else float(max_scale))
        # Plain torch.optim optimizers ("foreign": not driven by the C++ engine): their stage
        # and found_inf per iteration, kept here; the scale state itself is the engine's.
        self._stage = defaultdict(lambda: _READY)
        self._foreign_found = {}
        self._fused_used = False
        self._history = History() if history else None  # scale after each update()
        self._unscaled_fused = set()

    # ---- the iteration -----------------------------------------------------------------
    def scale(self, outputs):
        """Multiplies a tensor (or a nest of tensors) by the scale factor."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return self._engine.scale(outputs)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, dict):
            return {k: self.scale(v) for k, v in outputs.items()}
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    def unscale_(self, optimizer):
        """Divides the optimizer's gradients by the scale, in place (e.g. before manual
        clipping), recording inf/NaN. At most once per optimizer per iteration."""
        if not self._enabled:
            return
        if isinstance(optimizer, FusedOptimizer):
            self._fused_used = True
            optimizer._push_options()
            self._engine.unscale_(optimizer._engine)
            self._unscaled_fused.add(id(optimizer))
            return
        if hasattr(optimizer, "_fusedamp_step_scaled"):
            raise RuntimeError("fusedamp.GradScaler.unscale_: this optimizer unscales inside its "
                               "step (use its max_grad_norm for clipping)")
        stage = self._stage[id(optimizer)]
        if stage == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the "
                               "last update().")
        if stage == _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if any(g.is_sparse for g in grads):
            raise RuntimeError("fusedamp.GradScaler: sparse gradients are not supported")
        if not grads:
            raise RuntimeError("fusedamp.GradScaler.unscale_: no parameter has a gradient")
        # torch's own recipe for the inverse scale (double reciprocal), on the device.
        inv_scale = self._engine.scale_tensor().double().reciprocal().float()
        by_device = defaultdict(list)
        for g in grads:
            by_device[g.device].append(g)
        found = None
        with torch.no_grad():
            for dev, gs in by_device.items():
                f = torch.zeros(1, dtype=torch.float32, device=dev)
                torch.ops.fusedamp.unscale_and_check_(gs, f, inv_scale.to(dev, non_blocking=True))
                found = f if found is None else found + f.to(found.device, non_blocking=True)
        self._foreign_found[id(optimizer)] = found
        self._stage[id(optimizer)] = _UNSCALED

    def step(self, optimizer, *args, **kwargs):
        """Steps the optimizer unless its gradients hold inf/NaN. Fused optimizers decide that
        on the device (no sync); other optimizers read found_inf on the host, like torch."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if isinstance(optimizer, FusedOptimizer):
            self._fused_used = True
            optimizer.step(_scaled_by=self)  # through torch's wrapper: hooks, LR schedulers
            return None
        if self._stage[id(optimizer)] == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if hasattr(optimizer, "_fusedamp_step_scaled"):
            # Optimizers that unscale and skip on the device themselves
            # (fusedamp.distributed.ShardedOptimizer): they take the inverse scale and return
            # their found_inf, which update() then uses like a foreign optimizer's (no sync).
            inv_scale = self._engine.scale_tensor().double().reciprocal().float()
            self._foreign_found[id(optimizer)] = optimizer._fusedamp_step_scaled(inv_scale)
            self._stage[id(optimizer)] = _STEPPED
            return None
        if self._stage[id(optimizer)] == _READY:
            self.unscale_(optimizer)
        found = self._foreign_found[id(optimizer)]
        result = None
        if not found.item():
            result = optimizer.step(*args, **kwargs)
        self._stage[id(optimizer)] = _STEPPED
        return result

    def _fused_step(self, optimizer):
        """Called by FusedOptimizer.step(_scaled_by=self): the engine's scaled step."""
        self._engine.step(optimizer._engine)
        if id(optimizer) not in self._unscaled_fused:  # the step's own norm pass ran
            optimizer._record_grad_norm(self._engine.inv_scale_tensor())

    def update(self, new_scale=None):
        """Updates the scale from this iteration's overflow checks (or sets it)."""
        if not self._enabled:
            return
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1:
                    raise ValueError("new_scale should be a 1-element tensor")
                new_scale = new_scale.item()
            self._engine.update_to(float(new_scale))
        elif self._foreign_found:
            if self._fused_used:
                raise RuntimeError("fusedamp.GradScaler: one scaler cannot drive fusedamp and "
                                   "torch.optim optimizers in the same iteration; use two scalers")
            found = None
            for f in self._foreign_found.values():
                found = f if found is None else found + f.to(found.device)
            e = self._engine
            torch.ops.fusedamp.update_scale_(
                e.scale_tensor(), e.growth_tracker(), e.hysteresis_tracker(),
                found.to(e.scale_tensor().device), e.options_growth_factor(),
                e.options_backoff_factor(), e.options_growth_interval(), e.options_hysteresis(),
                e.options_min_scale(), e.options_max_scale())
        else:
            self._engine.update()
        self._stage.clear()
        self._foreign_found.clear()
        self._unscaled_fused.clear()
        self._fused_used = False
        if self._history is not None:
            self._history.record(self._engine.scale_tensor())

    # ---- reading the state (syncs only where it says so) ----------------------------------
    def get_scale(self):
        """The current scale as a Python float (synchronises with the device)."""
        return self._engine.get_scale() if self._enabled else 1.0

    def get_scale_tensor(self):
        """The scale as a 1-element device tensor (no sync)."""
        return self._engine.scale_tensor()

    def scale_history(self):
        """The scale after each update(), oldest first, as floats (one synchronisation)."""
        return [] if self._history is None else self._history.values()

    def get_growth_factor(self):
        return self._engine.options_growth_factor()

    def set_growth_factor(self, v):
        self._engine.set_growth_factor(float(v))

    def get_backoff_factor(self):
        return self._engine.options_backoff_factor()

    def set_backoff_factor(self, v):
        self._engine.set_backoff_factor(float(v))

    def get_growth_interval(self):
        return self._engine.options_growth_interval()

    def set_growth_interval(self, v):
        self._engine.set_growth_interval(int(v))

    def is_enabled(self):
        return self._enabled

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self):
        """torch.amp.GradScaler's keys plus the hysteresis tracker and bounds. Reading the
        counters syncs with the device, as in torch."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._engine.options_growth_factor(),
            "backoff_factor": self._engine.options_backoff_factor(),
            "growth_interval": self._engine.options_growth_interval(),
            "_growth_tracker": self._engine.growth_tracker_value(),
            "hysteresis": self._engine.options_hysteresis(),
            "_hysteresis_tracker": self._engine.hysteresis_tracker_value(),
            "min_scale": self._engine.options_min_scale(),
            "max_scale": self._engine.options_max_scale(),
        }

    def load_state_dict(self, state_dict):
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        # hysteresis and bounds are construction arguments: a checkpoint made with other values
        # is refused rather than silently resumed under a different policy.
        for key, mine in (("hysteresis", self._engine.options_hysteresis()),
                          ("min_scale", self._engine.options_min_scale()),
                          ("max_scale", self._engine.options_max_scale())):
            if key in state_dict and state_dict[key] != mine:
                raise ValueError(f"fusedamp.GradScaler.load_state_dict: checkpoint has {key}="
                                 f"{state_dict[key]!r}, this scaler {mine!r}; construct the "
                                 "scaler with the checkpoint's value")
        self.set_growth_factor(state_dict["growth_factor"])
        self.set_backoff_factor(state_dict["backoff_factor"])
        self.set_growth_interval(state_dict["growth_interval"])
        self._engine.load_state(float(state_dict["scale"]), int(state_dict["_growth_tracker"]),
                                int(state_dict.get("_hysteresis_tracker",
                                                   self._engine.options_hysteresis())))
