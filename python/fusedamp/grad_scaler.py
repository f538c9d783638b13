"""fusedamp.GradScaler — a drop-in for torch.amp.GradScaler, with the state on the device.

The scale state machine and the stages of an iteration (unscale_, step, update) are the C++
engine's (fusedamp._C.GradScaler); this class adapts torch's calling conventions and relays.

Scaler and optimizer speak torch's AMP protocol. An optimizer with
``_step_supports_amp_scaling`` (fusedamp's, torch's fused ones, fusedamp.distributed's)
receives ``grad_scale`` and ``found_inf`` as attributes for its step and unscales and skips
itself on the device: ``scale -> backward -> step -> update`` then never synchronises. One that
also sets ``_step_checks_nonfinite`` checks the gradients in its own step, so the scaler adds no
pass. Any other optimizer is unscaled with the fused check and, as torch.amp does, stepped
only after reading ``found_inf`` on the host. One scaler may drive any mix of optimizers in one
iteration.

Beyond torch's arguments: ``hysteresis`` (back off only after that many overflowing steps in
a row), ``min_scale`` and ``max_scale``. With hysteresis 1 and no bounds the scale sequence is
torch's.

Telemetry (``telemetry=True``, the default) is the record of a run: every iteration's scale,
overflow, gradient norm, largest finite |gradient| (amax) and underflow fraction, and the first
parameter whose gradient overflowed, gathered by the gradient passes the step makes anyway
(``unscale_`` adds one read-only pass) and kept on the device; ``telemetry()`` reads it with one
synchronisation. (Deprecated, for one release: ``scale_history()``, derived from it, and the
``history`` argument, which has no effect.)

``policy="amax"`` moves the scale straight to the largest power of two that keeps the measured
amax under ``amax_target`` (default 65504 / 256) instead of learning the ceiling by overflowing
and growing once per ``growth_interval`` clean steps; overflows back off as torch's rule does,
further when the overflowing step's finite gradients show the scale is far too high.
"""
from __future__ import annotations

import inspect
import warnings
import weakref

import torch

from . import compiled_step
from ._library import _C
from .fsdp import (check_plain_step, has_dtensors, local_grad_views, local_names,
                   unscale_shards)
from .optim import FusedOptimizer

__all__ = ["GradScaler"]


class _NotGiven:
    """The default of a deprecated argument, so that giving it at all can be warned about."""

    def __repr__(self):
        return "<deprecated>"


_NOT_GIVEN = _NotGiven()
# Pickles of earlier versions carry the engine's arguments as a tuple (_engine_args), in this
# order; some have a 14th, the scale-history flag, which __setstate__ drops.
_PICKLED_ENGINE_ARGS = ("device", "init_scale", "growth_factor", "backoff_factor",
                        "growth_interval", "enabled", "hysteresis", "min_scale", "max_scale",
                        "policy", "amax_target", "telemetry", "telemetry_capacity")


def _params_with_grads(optimizer):
    # DTensor (FSDP2) parameters: their local shards, carrying the local gradient shards.
    return local_grad_views([p for g in optimizer.param_groups for p in g["params"]
                             if p.grad is not None])


class GradScaler:
    def __init__(self, device="cuda", init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True, *, hysteresis=1, min_scale=None,
                 max_scale=None, history=_NOT_GIVEN, policy="torch", amax_target=None,
                 telemetry=True, telemetry_capacity=4096):
        if history is not _NOT_GIVEN:
            warnings.warn("fusedamp.GradScaler(history=...) is deprecated and has no effect: "
                          "the scale of every iteration is in scaler.telemetry()['scale']",
                          DeprecationWarning, stacklevel=2)
        if amax_target is not None and policy != "amax":
            raise ValueError(f"fusedamp.GradScaler: amax_target is the target of policy='amax'; "
                             f"with policy={policy!r} it would be ignored")
        device = torch.device(device)
        if enabled and device.type == "cuda" and not torch.cuda.is_available():
            warnings.warn("fusedamp.GradScaler is enabled, but CUDA is not available. "
                          "Disabling.")
            enabled = False
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        self._enabled = bool(enabled)
        self._engine_options = dict(
            device=str(device), init_scale=float(init_scale), growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor), growth_interval=int(growth_interval),
            enabled=self._enabled, hysteresis=int(hysteresis),
            min_scale=None if min_scale is None else float(min_scale),
            max_scale=None if max_scale is None else float(max_scale), policy=str(policy),
            amax_target=None if amax_target is None else float(amax_target),
            telemetry=bool(telemetry), telemetry_capacity=int(telemetry_capacity))
        self._engine = _C.GradScaler(**self._engine_options)
        self._records_telemetry = self._engine.has_telemetry()
        self._step_target = compiled_step.make_target(self)  # in a compiled graph (its ops)
        self._torch_step_targets = {}  # id(optimizer): its target (prepare_compiled_step)
        self._updates = 0  # update() calls: where release_gradients sees an iteration end

    # ---- the iteration -----------------------------------------------------------------
    def scale(self, outputs):
        """Multiplies a tensor (or a nest of tensors) by the scale factor."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if compiled_step.available and torch.compiler.is_compiling():
                return compiled_step.scale(self, outputs)
            return self._engine.scale(outputs)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, dict):
            return {k: self.scale(v) for k, v in outputs.items()}
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    def _require_scale(self, funcname):
        # torch.amp's check and words: the iteration starts with scale(), which creates the
        # scale on the loss's device (a loaded state_dict alone does not count in torch).
        if not self._engine.has_scale():
            raise AssertionError(f"Attempted {funcname} but _scale is None.  This may indicate "
                                 "your script did not use scaler.scale(loss or outputs) earlier "
                                 "in the iteration.")

    def unscale_(self, optimizer):
        """Divides the optimizer's gradients by the scale, in place (e.g. before manual
        clipping), recording inf/NaN. At most once per optimizer per iteration."""
        if self._enabled and compiled_step.available and torch.compiler.is_compiling():
            compiled_step.scaler_unscale(self, optimizer)
        elif self._enabled:
            if optimizer.__dict__.get("_fusedamp_release") is not None:
                raise RuntimeError("fusedamp.GradScaler.unscale_: release_gradients stepped and "
                                   "freed them in backward; clip with clipping='per_parameter'")
            self._require_scale("unscale_")
            params = [p for g in optimizer.param_groups for p in g["params"]
                      if p.grad is not None]
            if has_dtensors(params):
                unscale_shards(self._engine, id(optimizer), params,
                               self._engine if self._records_telemetry else None)
            else:
                self._engine.unscale_(id(optimizer), params)

    def step(self, optimizer, *args, **kwargs):
        """Steps the optimizer unless its gradients hold inf/NaN; returns what its step
        returns. Protocol optimizers decide that on the device (no sync); others after a
        host read of found_inf, like torch."""
        if not self._enabled:
            if isinstance(optimizer, FusedOptimizer):
                optimizer._fusedamp_scaler = weakref.ref(self)  # its grad_norm_history()
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if compiled_step.available and torch.compiler.is_compiling():
            return compiled_step.scaler_step(self, optimizer, args, kwargs)
        if optimizer.__dict__.get("_fusedamp_release") is not None:
            return optimizer.step(*args, **kwargs)  # stepped inside backward: a no-op
        self._require_scale("step")
        key = id(optimizer)
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            check_plain_step([p for g in optimizer.param_groups for p in g["params"]])
            result = None
            if self._engine.begin_plain_step(key, _params_with_grads(optimizer)):
                result = optimizer.step(*args, **kwargs)
            self._engine.end_step(key)
            return result
        checks_itself = getattr(optimizer, "_step_checks_nonfinite", False)
        if not checks_itself and "grad_scaler" in inspect.signature(optimizer.step).parameters:
            # torch's older contract, still honoured by torch.amp: the scaler itself is passed.
            warnings.warn("GradScaler is going to stop passing itself as a keyword argument to "
                          "the passed optimizer. In the near future GradScaler registers "
                          "`grad_scale: Tensor` and `found_inf: Tensor` to the passed optimizer "
                          "and let the optimizer use them directly.", FutureWarning, stacklevel=2)
            try:
                return optimizer.step(*args, **dict(kwargs, grad_scaler=self))
            finally:
                self._engine.end_step(key)
        grad_scale, found_inf = self._engine.begin_amp_step(
            key, [] if checks_itself else _params_with_grads(optimizer))
        # As torch: a scale the user already set on the optimizer multiplies ours.
        prior = getattr(optimizer, "grad_scale", None)
        if grad_scale is None:
            grad_scale = prior
        elif prior is not None:
            grad_scale = grad_scale * prior
        optimizer.grad_scale, optimizer.found_inf = grad_scale, found_inf
        if checks_itself:
            if self._records_telemetry:
                optimizer._fusedamp_telemetry_of = self._engine  # its pass records for us
            if isinstance(optimizer, FusedOptimizer):
                # For its deprecated grad_norm_history(), which reads our telemetry.
                optimizer._fusedamp_scaler = weakref.ref(self)
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf
            optimizer.__dict__.pop("_fusedamp_telemetry_of", None)
            self._engine.end_step(key)

    def prepare_compiled_step(self, optimizer):
        """Lets a compiled graph (torch.compile, fullgraph=True included) step a torch
        optimizer through this scaler: call it once, before compiling. fusedamp's optimizers
        need nothing. The compiled ``step`` runs this scaler's eager step of the optimizer (for
        torch's fused and capturable optimizers one without a host sync)."""
        if not compiled_step.available:
            raise RuntimeError("fusedamp: compiling the scaler's step needs torch's opaque "
                               f"objects (torch >= 2.10); this is torch {torch.__version__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"fusedamp: prepare_compiled_step takes a torch.optim.Optimizer, "
                            f"not {type(optimizer).__name__}")
        key = id(optimizer)
        if getattr(optimizer, "_step_target", None) is None and key not in self._torch_step_targets:
            self._torch_step_targets[key] = compiled_step.make_target(optimizer)
            # Dropped with the optimizer, so that no other object reusing its id finds it.
            weakref.finalize(optimizer, self._torch_step_targets.pop, key, None)

    def update(self, new_scale=None):
        """Updates the scale from this iteration's overflow checks (or sets it)."""
        if not self._enabled:
            return
        if compiled_step.available and torch.compiler.is_compiling():
            compiled_step.scaler_update(self, new_scale)
            return
        self._updates += 1
        if new_scale is None:
            self._engine.update()
        elif isinstance(new_scale, torch.Tensor):
            self._engine.update_to_tensor(new_scale)  # copied on the device, no sync
        else:
            self._engine.update_to(float(new_scale))

    # ---- reading the state (syncs only where it says so) ----------------------------------
    def get_scale(self):
        """The current scale as a Python float (synchronises with the device)."""
        return self._engine.get_scale() if self._enabled else 1.0

    def get_scale_tensor(self):
        """The scale as a 1-element device tensor (no sync)."""
        return self._engine.scale_tensor()

    def scale_history(self):
        """Deprecated (removed in the next release): read ``telemetry()["scale"]``, the scale
        each recorded iteration's gradients carried (the scale before its update()).

        Returns floats, oldest first, one per iteration the telemetry recorded: the scale after
        that iteration's update(), derived from the telemetry as the ``scale`` of the next
        recorded iteration, and, for the last one, the current scale (``get_scale()``). So:

        - ``[]`` when telemetry is off (``telemetry=False``), the scaler is disabled, or before
          the first update();
        - at most ``telemetry_capacity`` entries, the oldest dropped first;
        - an explicit ``update(new_scale)`` adds no entry (the telemetry records no iteration
          for it), and the entry of the update before it reads ``new_scale``, the scale the
          next iteration carried;
        - a pickled or deep-copied scaler starts with ``[]`` (its telemetry does not travel).

        Emits a DeprecationWarning. Two synchronisations (telemetry and current scale)."""
        warnings.warn("fusedamp.GradScaler.scale_history() is deprecated: read "
                      "scaler.telemetry()['scale'] (the scale each iteration's gradients "
                      "carried)", DeprecationWarning, stacklevel=2)
        if not self._enabled:
            return []
        carried = self._engine.telemetry()["scale"]
        if not carried:
            return []
        return carried[1:] + [self.get_scale()]

    def telemetry(self, model=None):
        """The recorded iterations (at most ``telemetry_capacity``, oldest first) as a dict of
        equal-length lists: ``step``, ``scale`` (what the gradients carried), ``found_inf``,
        ``skipped`` (the step was skipped: an overflow), ``grad_norm`` (unscaled),
        ``amax`` (largest finite |scaled gradient|), ``underflow_fraction`` (gradient
        elements that are zero or subnormal in their dtype), ``subnormal_fraction`` (the
        subnormal ones alone: zeros may be structural, e.g. unused embedding rows or dead
        units, subnormals have certainly lost precision), ``first_nonfinite`` (the name
        of the first parameter whose gradient held inf/NaN, from ``model``'s
        named_parameters(), else ``"param<k>"``; None where none did); and ``dtype_max`` (the
        largest finite value of the narrowest gradient dtype the recorded iterations walked,
        which the scaled gradients overflow above; None before any) and ``amax_target``.
        ``grad_norm`` of an iteration that overflowed is inf or NaN, as the gradients were.
        One synchronisation. Feed it to ``fusedamp.diagnostics.plot``."""
        log = self._engine.telemetry() if self._enabled else {
            k: [] for k in ("step", "scale", "found_inf", "grad_norm", "amax",
                            "underflow_fraction", "subnormal_fraction", "first_nonfinite")}
        names = {}
        if model is not None:
            named = list(model.named_parameters() if isinstance(model, torch.nn.Module)
                         else model)
            names = {id(p): n for n, p in named}
            names.update(local_names(named))  # FSDP2: the record holds the local shards
        first = []
        for p in log["first_nonfinite"]:
            if p is None:
                first.append(None)
            else:
                first.append(names.get(id(p), f"param<{tuple(p.shape)}>"))
        log["first_nonfinite"] = first
        log["skipped"] = list(log["found_inf"])
        # The limit the scaled gradients overflow above: the largest finite value of the
        # narrowest gradient dtype walked (65504 for FP16, ~3.4e38 for BF16); None if none was.
        walked = [m for m in log.pop("dtype_max", []) if m == m]
        log["dtype_max"] = min(walked) if walked else None
        log["amax_target"] = (self._engine.options_amax_target()
                              if self._engine.options_policy() == "amax" else None)
        return log

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

    # ---- pickling, deepcopy, torch.save (as torch.amp's: between iterations) -----------------
    def __getstate__(self):
        if self._enabled and self._engine.in_iteration():
            raise AssertionError("A GradScaler instance may only be pickled at the beginning of "
                                 "an iteration, or at the end after scaler.update().")
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("_engine", "_step_target", "_torch_step_targets")}
        state["_state_dict"] = self.state_dict()
        return state

    def __setstate__(self, state):
        state_dict = state.pop("_state_dict")
        # Earlier versions' scale histories, which the telemetry replaces: the engine's ring
        # (_scale_history, with a 14th engine argument turning it on) or, before it, a
        # fusedamp.diagnostics.History (_history). Dropped.
        state.pop("_scale_history", None)
        state.pop("_history", None)
        if "_engine_args" in state:
            state["_engine_options"] = dict(zip(_PICKLED_ENGINE_ARGS, state.pop("_engine_args")))
        self.__dict__.update(state)
        self._engine = _C.GradScaler(**self._engine_options)
        self._records_telemetry = self._engine.has_telemetry()
        self._step_target = compiled_step.make_target(self)
        self._torch_step_targets = {}
        self._updates = 0
        if state_dict:
            self.load_state_dict(state_dict)

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
            "policy": self._engine.options_policy(),
            "amax_target": self._engine.options_amax_target(),
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
                          ("max_scale", self._engine.options_max_scale()),
                          ("policy", self._engine.options_policy()),
                          ("amax_target", self._engine.options_amax_target())):
            if key in state_dict and state_dict[key] != mine:
                raise ValueError(f"fusedamp.GradScaler.load_state_dict: checkpoint has {key}="
                                 f"{state_dict[key]!r}, this scaler {mine!r}; construct the "
                                 "scaler with the checkpoint's value")
        # The engine checks every value before it replaces any.
        self._engine.load_state_dict(
            float(state_dict["growth_factor"]), float(state_dict["backoff_factor"]),
            int(state_dict["growth_interval"]), float(state_dict["scale"]),
            int(state_dict["_growth_tracker"]),
            int(state_dict.get("_hysteresis_tracker", self._engine.options_hysteresis())))
