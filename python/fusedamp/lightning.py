"""fusedamp as a Lightning precision plugin: ``Trainer(plugins=[FusedAmpPrecision("16-mixed")])``.

What the plugin does, at the points Lightning calls it:
  convert_module   the LightningModule is cast to FP16/BF16, normalisation layers stay FP32
                   (fusedamp.convert_module; its forward takes any floating input and
                   returns FP32 outputs)
  connect          the optimizers configure_optimizers returned (torch.optim AdamW/Adam/SGD)
                   are rebuilt as fusedamp's master-weight ones with the same param groups and
                   hyper-parameters; the LR schedulers are moved onto them; the loss scaler
                   (fusedamp.GradScaler, enabled for "16-mixed") is made on the model's device
  forward_context  torch.autocast(dtype) around the steps (autocast=True): FP32 tensors a step
                   creates meet the FP16/BF16 layers, and losses run in FP32 as under torch.amp;
                   the weights are already FP16/BF16, so autocast casts no weight
  pre_backward     the loss is scaled
  optimizer_step   closure (forward + backward), Lightning's before-step hooks and clipping,
                   then scaler.step(opt) + scaler.update(): the fused step unscales, clips and
                   skips inf/NaN steps on the device, with no host sync
  clip_gradients   Trainer(gradient_clip_val=v) (norm clipping) becomes the optimizer's
                   max_grad_norm, applied inside the fused step; value clipping is refused
  state_dict       the scaler's state goes into Lightning's checkpoints (the optimizer's,
                   master weights included, goes in through Lightning's own optimizer state)

With Fabric (``Fabric(plugins=[FusedAmpPrecision(...)])``) the plugin converts the module,
scales the loss in ``fabric.backward`` and steps through the scaler; Fabric has no hook to
replace optimizers, so create fusedamp's optimizer yourself (before or after
``fabric.setup``).

Lightning is imported from ``pytorch_lightning`` (``pip install fusedamp[lightning]``) or, if
only the unified package is installed, from ``lightning.pytorch``.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Optional

import torch

try:
    import pytorch_lightning as _pl
    from pytorch_lightning.plugins.precision import Precision
    from pytorch_lightning.utilities import GradClipAlgorithmType
except ImportError:  # the unified `lightning` package
    import lightning.pytorch as _pl
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities import GradClipAlgorithmType

from . import lr_scheduler
from ._library import _C
from .convert import convert_module as _convert_module
from .grad_scaler import GradScaler
from .initialize import _fused_arguments, _fused_class
from .optim import FusedOptimizer

__all__ = ["FusedAmpPrecision"]

_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


class FusedAmpPrecision(Precision):
    """Mixed precision with FP16/BF16 weights, FP32 master weights and fused, sync-free
    loss scaling, clipping and skipping.

    Args:
        precision: ``"16-mixed"`` (FP16, loss scaling) or ``"bf16-mixed"`` (BF16; no scaling
            unless ``loss_scaling=True``).
        max_grad_norm: global-norm clipping in the fused step; ``Trainer(gradient_clip_val=)``
            overrides it while set.
        master_weights: what keeps the bits below the FP16/BF16 weights (fusedamp.optim):
            True (FP32 masters), "split" / "split8" / "stochastic" (bf16-mixed only), "kahan",
            False.
        state_dtype: the moments' dtype, ``torch.float32`` or ``torch.bfloat16``, or
            ``torch.int8`` (AdamW/Adam/SGD: 8-bit moments or momentum buffers with block scales,
            see fusedamp.optim).
        rounding_seed: the seed of ``master_weights="stochastic"``.
        autocast: run the steps under ``torch.autocast`` (see the module doc).
        scaler: a ``fusedamp.GradScaler`` to use instead of the one built from ``init_scale``,
            ``growth_interval``, ``hysteresis``, ``min_scale``, ``max_scale``.
        skip_nonfinite: skip a step whose gradients hold inf/NaN even without a scaler.
        skip_aware_lr: replace the LR schedulers ``configure_optimizers`` returns by their
            ``fusedamp.lr_scheduler`` counterparts (``from_torch``), which count only the
            applied steps: a skipped step no longer advances the schedule.
    """

    def __init__(self, precision: str = "16-mixed", max_grad_norm: Optional[float] = None,
                 master_weights=True, *, autocast: bool = True,
                 scaler: Optional[GradScaler] = None, loss_scaling: Optional[bool] = None,
                 init_scale: float = 2.0 ** 16, growth_interval: int = 2000, hysteresis: int = 1,
                 min_scale: Optional[float] = None, max_scale: Optional[float] = None,
                 skip_nonfinite: bool = True, state_dtype: torch.dtype = torch.float32,
                 rounding_seed: int = 0, skip_aware_lr: bool = False) -> None:
        if precision not in _DTYPES:
            raise ValueError(f"FusedAmpPrecision(precision={precision!r}): precision must be "
                             "'16-mixed' or 'bf16-mixed'")
        if not _C.master_weights_fit(master_weights, _DTYPES[precision]):
            raise ValueError(f"FusedAmpPrecision: master_weights={master_weights!r} keeps "
                             f"bfloat16 weights; use precision='bf16-mixed' (or "
                             "master_weights=True or 'kahan')")
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise TypeError("FusedAmpPrecision: scaler must be a fusedamp.GradScaler, got "
                            f"{type(scaler).__name__}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"FusedAmpPrecision: max_grad_norm must be > 0, got {max_grad_norm}")
        self.precision = precision
        self.dtype = _DTYPES[precision]
        self.max_grad_norm = max_grad_norm
        self.master_weights = master_weights
        self.state_dtype = state_dtype
        self.rounding_seed = rounding_seed
        self.autocast = autocast
        self.skip_nonfinite = skip_nonfinite
        self.skip_aware_lr = bool(skip_aware_lr)
        self.scaler = scaler
        self._scaler_args = dict(init_scale=init_scale, growth_interval=growth_interval,
                                 hysteresis=hysteresis, min_scale=min_scale, max_scale=max_scale,
                                 enabled=(self.dtype == torch.float16 if loss_scaling is None
                                          else bool(loss_scaling)))
        self._device = None
        self._module = None  # weakref to the converted module
        self._pending_state = None  # a checkpoint's scaler state loaded before connect
        self._base_norms = {}  # id(optimizer) -> its groups' own max_grad_norm

    # ---- the model ---------------------------------------------------------------------
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        done = getattr(module, "_fusedamp_dtype", None)
        if done is None:
            _convert_module(module, self.dtype)
        elif done != self.dtype:
            raise RuntimeError(f"FusedAmpPrecision({self.precision!r}): the module was already "
                               f"converted to {done} by fusedamp")
        self._module = weakref.ref(module)
        return module

    def _current_device(self):
        # Where the converted module is now (Trainer and Fabric move it after converting it).
        module = self._module() if self._module is not None else None
        device = _device_of(module) if module is not None else None
        return device or self._device or torch.device("cpu")

    def forward_context(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self._current_device().type, dtype=self.dtype, cache_enabled=False)

    # ---- optimizers, schedulers, scaler (Trainer) --------------------------------------------
    def connect(self, model, optimizers, lr_schedulers):
        self._device = _device_of(model) or self._device or torch.device("cpu")
        lightning_module = _lightning_module(model)
        trainer = getattr(lightning_module, "_trainer", None)
        if trainer is not None:
            self._check_clipping(trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        if self.skip_aware_lr:  # every scheduler checked before anything is converted
            for config in lr_schedulers:
                lr_scheduler.check_convertible(getattr(config, "scheduler", config))
        fused = [self._fuse(opt) for opt in optimizers]
        for old, new in zip(optimizers, fused):
            if new is not old:
                for config in lr_schedulers:
                    _move_scheduler(getattr(config, "scheduler", config), old, new)
        if self.skip_aware_lr:
            for config in lr_schedulers:
                config.scheduler = lr_scheduler.from_torch(config.scheduler,
                                                           config.scheduler.optimizer)
        self._ensure_scaler()
        return model, fused, lr_schedulers

    def _ensure_scaler(self):
        if self.scaler is None:
            self.scaler = GradScaler(self._current_device(), **self._scaler_args)
        if self._pending_state is not None:
            self.scaler.load_state_dict(self._pending_state)
            self._pending_state = None
        return self.scaler

    def _engine_args(self):
        return dict(max_grad_norm=self.max_grad_norm, skip_nonfinite=self.skip_nonfinite,
                    master_weights=self.master_weights, state_dtype=self.state_dtype,
                    rounding_seed=self.rounding_seed)

    def _fuse(self, optimizer):
        """fusedamp's optimizer of the same kind, param groups and hyper-parameters."""
        if isinstance(optimizer, FusedOptimizer):
            for group in optimizer.param_groups:
                if group.get("max_grad_norm") is None:
                    group["max_grad_norm"] = self.max_grad_norm
            return optimizer
        fused_cls = _fused_class(optimizer)  # TypeError naming the supported ones
        if any(len(s) for s in optimizer.state.values()):
            raise ValueError("FusedAmpPrecision: the optimizer already holds state; the plugin "
                             "rebuilds it before the first step")
        engine_args = self._engine_args()
        kwargs = _fused_arguments(optimizer, fused_cls, engine_args)
        fused = fused_cls([dict(g, **engine_args) for g in optimizer.param_groups], **kwargs)
        _track_step_calls(fused, optimizer)
        return fused

    # ---- backward and step ---------------------------------------------------------------
    # The Trainer backpropagates what pre_backward returns; Fabric ignores that and calls
    # backward with the loss itself: each is scaled where its caller uses it.
    def pre_backward(self, tensor, module):
        if _trainer_of(module) is not None:
            return super().pre_backward(self._ensure_scaler().scale(tensor), module)
        return tensor

    def backward(self, tensor, model, *args, **kwargs):
        if _trainer_of(model) is not None:
            return super().backward(tensor, model, *args, **kwargs)
        self._ensure_scaler().scale(tensor).backward(*args, **kwargs)

    def post_backward(self, tensor, module):
        if _trainer_of(module) is not None:
            return super().post_backward(tensor, module)
        return tensor

    def optimizer_step(self, optimizer, model=None, closure: Optional[Callable[[], Any]] = None,
                       **kwargs):
        scaler = self._ensure_scaler()
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("FusedAmpPrecision: LBFGS (a closure-driven optimizer) cannot be "
                            "stepped under a loss scaler")
        if closure is None:  # Fabric: the backward has run already
            out = scaler.step(optimizer, **kwargs)
            scaler.update()
            return out
        closure_result = closure()
        # As Lightning's MixedPrecision: in automatic optimization a closure that returned
        # None skipped backward, so there is nothing to step.
        skip = closure_result is None and model.automatic_optimization
        self._after_closure(model, optimizer)  # on_before_optimizer_step, clip_gradients
        if skip:
            return closure_result
        out = scaler.step(optimizer, **kwargs)
        scaler.update()
        return out

    def clip_gradients(self, optimizer, clip_val=0.0,
                       gradient_clip_algorithm=GradClipAlgorithmType.NORM) -> None:
        """Norm clipping becomes the fused step's max_grad_norm (the gradients are still
        scaled here; the step clips by the unscaled global norm)."""
        self._check_clipping(clip_val, gradient_clip_algorithm)
        # Without a clip value this step, each group has the max_grad_norm it was given.
        base = self._base_norms.setdefault(
            id(optimizer), [g.get("max_grad_norm") for g in optimizer.param_groups])
        for group, norm in zip(optimizer.param_groups, base):
            group["max_grad_norm"] = clip_val if clip_val and clip_val > 0 else norm

    @staticmethod
    def _check_clipping(clip_val, algorithm):
        if clip_val and clip_val > 0 and algorithm is not None and (
                GradClipAlgorithmType(algorithm) == GradClipAlgorithmType.VALUE):
            raise ValueError(
                "FusedAmpPrecision: gradient_clip_algorithm='value' is not supported: the fused "
                "step clips by the global gradient norm (gradient_clip_algorithm='norm' or "
                "FusedAmpPrecision(max_grad_norm=...)); clipping by value would need the "
                "unscaled gradients on the host side of the step")

    def unscale_gradients(self, optimizer) -> None:
        self._ensure_scaler().unscale_(optimizer)

    # ---- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self.scaler is None:
            return dict(self._pending_state or {})
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        if self.scaler is None:
            self._pending_state = dict(state_dict) if state_dict else None
        elif state_dict or self.scaler.is_enabled():
            self.scaler.load_state_dict(state_dict)


# ---- helpers -------------------------------------------------------------------------------
def _device_of(module):
    p = next(iter(module.parameters()), None)
    return None if p is None else p.device


def _lightning_module(model):
    # Strategies may have wrapped it (DDP) before connect.
    while not isinstance(model, _pl.LightningModule) and hasattr(model, "module"):
        model = model.module
    return model


def _trainer_of(module):
    return getattr(module, "_trainer", None) if isinstance(module, _pl.LightningModule) else None


def _move_scheduler(scheduler, old, new):
    """Points an LR scheduler (and those a SequentialLR/ChainedScheduler holds) that drives
    `old` at `new`, whose param groups carry the same values (initial_lr included)."""
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
    for inner in getattr(scheduler, "_schedulers", ()) or ():
        _move_scheduler(inner, old, new)


def _track_step_calls(new, old):
    """torch's LR schedulers wrap optimizer.step when created, to warn when scheduler.step()
    runs before any optimizer step; give the rebuilt optimizer the same marking."""
    if not hasattr(old.step, "_wrapped_by_lr_sched") or hasattr(new.step, "_wrapped_by_lr_sched"):
        return
    ref = weakref.ref(new)
    step = type(new).step

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        opt = ref()
        opt._opt_called = True
        return step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    new.step = wrapper
