"""fusedamp.release_gradients — each parameter's step inside backward (gradient release).

Each parameter of a fusedamp AdamW/Adam/SGD/Lion gets a post-accumulate-grad hook that runs the
engine's fused step over that parameter alone (``step_released``: unscale with the scaler's
current scale, non-finite check, update in the group's master mode and state format) and then
frees the gradient, so no whole set of gradients is ever held: a BF16 model with 8-bit moments
and ``"split8"`` masters keeps 5.25 bytes a parameter between steps instead of 7.25.

The loop stays torch's: ``scaler.scale(loss).backward(); scaler.update()``. The skip is per
parameter: one whose gradient holds inf/NaN is not stepped (weights, master, moments and step
count untouched), the others are, and the scaler's flag for the iteration (a device tensor,
read by ``update()``) counts the skipped ones, so the scale backs off as after any overflow.
See docs/release_gradients.md.
"""
from __future__ import annotations

import warnings
import weakref

import torch

from .grad_scaler import GradScaler
from .optim import FusedOptimizer, closure_loss

__all__ = ["release_gradients", "ReleaseHandle"]

_CLIPPING = (None, "per_parameter")


def release_gradients(model, optimizer, scaler=None, *, clipping=None):
    """Steps each parameter of `optimizer` inside backward, as soon as its gradient is
    accumulated, and frees the gradient.

    model      the torch.nn.Module that holds the optimizer's parameters (names in messages and
               in ``scaler.telemetry(model)``).
    optimizer  a fusedamp.optim.AdamW, Adam, SGD or Lion over plain tensors.
    scaler     a fusedamp.GradScaler or None. With one, each step unscales by the scale the loss
               was multiplied by, and ``scaler.update()`` closes the iteration.
    clipping   None: a group with ``max_grad_norm`` is refused (a global norm needs every
               gradient before the first step); ``"per_parameter"``: such a group clips each
               parameter's gradient by that gradient's own norm.

    Returns a handle whose ``remove()`` restores the normal mode (also a context manager).
    ``optimizer.step()`` and ``scaler.step(optimizer)`` do nothing while it is attached (a
    warning, once). Everything is checked before anything is attached."""
    handle = ReleaseHandle(model, optimizer, scaler, clipping)
    handle._attach()
    return handle


class ReleaseHandle:
    """What ``release_gradients`` attached; ``remove()`` detaches it."""

    def __init__(self, model, optimizer, scaler, clipping):
        who = "fusedamp.release_gradients"
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{who}: model must be a torch.nn.Module, got {type(model).__name__}")
        # The step runs over the one parameter whose gradient just arrived: only an optimizer's
        # own plain engine can (a sharded or partitioned one reduces its statistics over ranks,
        # once per step).
        if not isinstance(optimizer, FusedOptimizer) or \
                type(getattr(optimizer, "_engine", None)) is not optimizer._engine_cls:
            raise TypeError(f"{who}: the optimizer must be a fusedamp.optim.AdamW, Adam, SGD or "
                            f"Lion over plain tensors (its fused step runs inside backward), got "
                            f"{type(optimizer).__module__}.{type(optimizer).__name__}")
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError(f"{who}: the scaler must be a fusedamp.GradScaler or None (each "
                            f"parameter's step reads its scale and adds to its overflow flag on "
                            f"the device), got {type(scaler).__module__}.{type(scaler).__name__}")
        if clipping not in _CLIPPING:
            raise ValueError(f"{who}: clipping must be one of {_CLIPPING}, got {clipping!r}")
        if optimizer.__dict__.get("_fusedamp_release") is not None:
            raise RuntimeError(f"{who}: this optimizer already releases its gradients; remove() "
                               "that handle first")
        self._who = who
        self._clipping = clipping
        _check_clipping(optimizer.param_groups, clipping)
        in_model = {id(p) for p in model.parameters()}
        names = {id(p): n for n, p in model.named_parameters()}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            if id(p) not in in_model:
                raise ValueError(f"{who}: parameter {i} of the optimizer ({tuple(p.shape)}) is "
                                 "not a parameter of the model")
            if p.grad is not None:
                raise RuntimeError(f"{who}: parameter {names[id(p)]!r} holds a gradient, which "
                                   "the first step inside backward would take as its own; call "
                                   "optimizer.zero_grad(set_to_none=True) first")
        self._model_names = names
        self._optimizer = optimizer
        self._scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self._params = [p for p in params if p.requires_grad]
        self._hooks = []
        self._updates_seen = None  # the scaler's update count when this iteration began
        self._stepped = set()      # ids of the parameters stepped this iteration
        self._in_backward = False  # without a scaler: a hook of this backward ran
        self._grad_scale = self._found_inf = self._telemetry_of = None
        self._warned = False

    # ---- attaching -------------------------------------------------------------------------
    def _attach(self):
        self._optimizer._fusedamp_release = self
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]

    def remove(self):
        """Detaches every hook; the optimizer steps in ``step()`` again. Idempotent."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._optimizer.__dict__.get("_fusedamp_release") is self:
            del self._optimizer._fusedamp_release

    @property
    def skipped_parameters(self):
        """How many parameters the scaler's current (or, after update(), last) iteration
        skipped: a one-element FP32 device tensor, read without a sync; None without an
        enabled scaler or before the first iteration."""
        return self._found_inf

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    # ---- inside backward -------------------------------------------------------------------
    def _on_grad(self, p):
        if self._scaler is not None:
            self._open_iteration(p)
        elif not self._in_backward:
            self._begin_unscaled()
        self._optimizer._engine.step_released(p, self._grad_scale, self._found_inf,
                                              self._telemetry_of)
        p.grad = None

    def _sync_options(self):
        opt = self._optimizer
        _check_clipping(opt.param_groups, self._clipping)
        opt._engine.sync_changed_options(opt.param_groups, opt._synced_options)

    def _begin_unscaled(self):
        self._sync_options()
        # Without a scaler each backward is one step; the options reach the engine once in it.
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._in_backward = True

    def _end_backward(self):
        self._in_backward = False

    def _open_iteration(self, p):
        scaler = self._scaler
        if self._updates_seen != scaler._updates:
            # The first gradient since the scaler's last update(): a new iteration.
            if not scaler._engine.has_scale():
                raise AssertionError("fusedamp.release_gradients: the gradients arrived before "
                                     "scaler.scale(loss) made a scale; scale the loss first")
            self._sync_options()
            key = id(self._optimizer)
            self._grad_scale, self._found_inf = scaler._engine.begin_amp_step(key, [])
            scaler._engine.end_step(key)
            self._telemetry_of = scaler._engine if scaler._records_telemetry else None
            # For the optimizer's deprecated grad_norm_history(), which reads our telemetry.
            self._optimizer._fusedamp_scaler = weakref.ref(scaler)
            self._stepped.clear()
            self._updates_seen = scaler._updates
        if id(p) in self._stepped:
            name = self._model_names.get(id(p), tuple(p.shape))
            raise RuntimeError(
                f"{self._who}: the gradient of {name!r} arrived a second time before "
                "scaler.update(): gradient accumulation (several backward passes per step) "
                "cannot run in release mode, where each gradient is consumed by its step; call "
                "scaler.update() after each backward, or accumulate in the normal mode "
                "(handle.remove())")
        self._stepped.add(id(p))

    # ---- the step outside backward ----------------------------------------------------------
    def step_called(self, closure=None):
        """What ``optimizer.step()`` does while attached: nothing (the steps ran in backward),
        a warning the first time; a closure is run (its backward steps)."""
        if not self._warned:
            self._warned = True
            warnings.warn("fusedamp.release_gradients: optimizer.step() does nothing while the "
                          "gradients are released: each parameter was stepped inside backward",
                          UserWarning, stacklevel=3)
        return closure_loss(closure)


def _check_clipping(groups, clipping):
    if clipping is None:
        for i, g in enumerate(groups):
            if g.get("max_grad_norm") is not None:
                raise ValueError(
                    f"fusedamp.release_gradients: param group {i} clips by the global gradient "
                    f"norm (max_grad_norm={g['max_grad_norm']}), which needs every gradient "
                    "before the first step; pass clipping='per_parameter' to clip each "
                    "parameter's gradient by its own norm, or set max_grad_norm=None")
