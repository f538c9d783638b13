"""The optimizer half of a step under torch.compile: one graph, the engine's own eager step.

The scaler and the optimizers are the C++ engine behind pybind11, which dynamo cannot trace.
Under compilation their step entries (``scaler.step(opt)``, ``scaler.unscale_(opt)``,
``scaler.update()``, ``opt.step()``, and a fusedamp.lr_scheduler's ``step()``) therefore become calls of the operators below, whose
arguments are

- a ``StepTarget``: the fusedamp object itself, as an opaque reference (torch's opaque objects,
  torch >= 2.10): the graph takes it as an input and treats it as a black box that holds state;
- the tensors the graph can also see: the parameters and their gradients (declared mutated), the
  groups' tensor learning rates and a ``new_scale`` tensor (read), a schedule's lrs and count.

``scaler.scale(loss)`` is traced as the product of the loss and a copy of the scale
(``scaler_scale_factor``), so autograd and the compiler see it.

Each op runs the object's eager step at run time, so a compiled step is the eager one bit for
bit (same kernels, same decisions on the device, no host sync), and its state (masters, moments,
the loss scale) stays inside the engine: the compiled graph holds no copy of it. The ops are
ordered effects, so the graph keeps them in program order. The lists' lengths, the optimizer's
parameters, which of them have gradients and the ids of the objects are what the graph depends
on (dynamo guards them); the values in the device tensors are not, so a changing tensor lr, a
skipped step and the scale's growth and backoff never recompile.

A torch optimizer stepped by fusedamp.GradScaler goes through the same ``scaler_step_`` op, with
the target ``scaler.prepare_compiled_step(optimizer)`` made for it before compiling: dynamo can
neither make an opaque object inside a graph nor set the ``grad_scale`` / ``found_inf``
attributes of a torch optimizer it traces (it treats the optimizer as immutable).
"""
from __future__ import annotations

import weakref

import torch

from .fsdp import has_dtensors

try:  # torch >= 2.10
    from torch._library.effects import EffectType
    from torch._library.opaque_object import register_opaque_type
    from torch._opaque_base import OpaqueBase
except ImportError:  # older torch: the entries stay eager, and dynamo breaks the graph there
    OpaqueBase = None

__all__ = ["available", "StepTarget", "make_target"]

#: Whether this torch can take the step into a compiled graph.
available = OpaqueBase is not None


def make_target(obj):
    """The StepTarget of a fusedamp scaler or optimizer (None where this torch has none)."""
    return StepTarget(obj) if available else None


if available:
    class StepTarget(OpaqueBase):
        """A scaler or optimizer as an input of a compiled graph (held weakly: the object
        keeps its target, not the other way round)."""

        def __init__(self, obj):
            self._ref = weakref.ref(obj)
            self._name = type(obj).__name__

        @property
        def obj(self):
            obj = self._ref()
            if obj is None:
                raise RuntimeError(f"fusedamp: the {self._name} this compiled step was traced "
                                   "for no longer exists")
            return obj

        def __repr__(self):
            return f"StepTarget({self._name})"

        # Inductor pickles a graph's inputs into its cache key: the object's name and identity
        # (a weak reference does not pickle; an unpickled target steps nothing).
        def __getstate__(self):
            return {"name": self._name, "id": id(self._ref())}

        def __setstate__(self, state):
            self._ref = lambda: None
            self._name = state["name"]

    register_opaque_type(StepTarget, typ="reference")

    @torch.library.custom_op("fusedamp::optimizer_step_", mutates_args=("params", "grads"))
    def _optimizer_step(optimizer: StepTarget, params: list[torch.Tensor],
                        grads: list[torch.Tensor], lrs: list[torch.Tensor]) -> None:
        opt = optimizer.obj
        type(opt).step(opt)  # the class's eager step: `opt.step` may be the compiled one

    @torch.library.custom_op("fusedamp::scaler_step_", mutates_args=("params", "grads"))
    def _scaler_step(scaler: StepTarget, optimizer: StepTarget, params: list[torch.Tensor],
                     grads: list[torch.Tensor], lrs: list[torch.Tensor]) -> None:
        scaler = scaler.obj
        type(scaler).step(scaler, optimizer.obj)

    @torch.library.custom_op("fusedamp::scaler_unscale_", mutates_args=("grads",))
    def _scaler_unscale(scaler: StepTarget, optimizer: StepTarget,
                        grads: list[torch.Tensor]) -> None:
        scaler = scaler.obj
        type(scaler).unscale_(scaler, optimizer.obj)

    @torch.library.custom_op("fusedamp::scaler_update_", mutates_args=())
    def _scaler_update(scaler: StepTarget, new_scale: torch.Tensor | None,
                       new_value: float | None) -> None:
        scaler = scaler.obj
        type(scaler).update(scaler, new_scale if new_value is None else new_value)

    @torch.library.custom_op("fusedamp::scaler_scale_factor", mutates_args=())
    def _scaler_scale_factor(scaler: StepTarget, like: torch.Tensor) -> torch.Tensor:
        # The scale as a 0-dim FP32 tensor on like's device, made there by the first scale()
        # (torch's rule; the engine's scale() also holds it within what an FP16 output carries)
        # and copied: an op's output may not alias state it does not declare.
        engine = scaler.obj._engine
        engine.scale(like.new_empty(0))
        return engine.scale_tensor().reshape(()).to(like.device, copy=True)

    @torch.library.custom_op("fusedamp::schedule_step_", mutates_args=("lrs", "applied"))
    def _schedule_step(schedule: StepTarget, lrs: list[torch.Tensor],
                       applied: torch.Tensor) -> None:
        schedule = schedule.obj
        type(schedule).step(schedule)

    @_scaler_scale_factor.register_fake
    def _(scaler, like):
        return torch.empty((), dtype=torch.float32, device=like.device)

    @_schedule_step.register_fake
    def _(schedule, lrs, applied):
        return None

    @_optimizer_step.register_fake
    def _(optimizer, params, grads, lrs):
        return None

    @_scaler_step.register_fake
    def _(scaler, optimizer, params, grads, lrs):
        return None

    @_scaler_unscale.register_fake
    def _(scaler, optimizer, grads):
        return None

    @_scaler_update.register_fake
    def _(scaler, new_scale, new_value):
        return None

    for _op in (_optimizer_step, _scaler_step, _scaler_unscale, _scaler_update,
                _scaler_scale_factor, _schedule_step):
        _op.register_effect(EffectType.ORDERED)
else:
    StepTarget = None


def _refuse_arguments(what, args, kwargs):
    if args or kwargs:
        raise RuntimeError(f"fusedamp: under torch.compile, {what} takes no arguments (a "
                           "closure re-enters autograd, which the compiled step cannot do); "
                           "call it without them, or leave the step eager")


def _step_tensors(optimizer):
    """What the graph sees of an optimizer's step: every parameter, the gradients present and
    the groups' tensor learning rates."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if has_dtensors(params):
        raise RuntimeError(
            "fusedamp: under torch.compile, the step of DTensor (FSDP2) parameters is not taken "
            "into the graph (the step's operators have no sharding rule); compile the model "
            "and leave scaler.step / opt.step eager, where they are one fused pass per shard")
    grads = [p.grad for p in params if p.grad is not None]
    lrs = [g["lr"] for g in optimizer.param_groups if isinstance(g["lr"], torch.Tensor)]
    return params, grads, lrs


def optimizer_step(optimizer, args, kwargs):
    """``optimizer.step()`` of a fusedamp optimizer, in a compiled graph."""
    _refuse_arguments("optimizer.step()", args, kwargs)
    torch.ops.fusedamp.optimizer_step_(optimizer._step_target, *_step_tensors(optimizer))


def scaler_step(scaler, optimizer, args, kwargs):
    """``scaler.step(optimizer)`` in a compiled graph: the scaler's eager step through the op,
    with the optimizer's own target (fusedamp's) or the one prepared for it (torch's)."""
    _refuse_arguments("scaler.step(optimizer)", args, kwargs)
    torch.ops.fusedamp.scaler_step_(scaler._step_target, _target_of(scaler, optimizer, "step"),
                                    *_step_tensors(optimizer))
    return None


def scaler_unscale(scaler, optimizer):
    """``scaler.unscale_(optimizer)`` in a compiled graph: the scaler's eager unscale_."""
    target = _target_of(scaler, optimizer, "unscale_")
    _, grads, _ = _step_tensors(optimizer)
    torch.ops.fusedamp.scaler_unscale_(scaler._step_target, target, grads)


def _target_of(scaler, optimizer, what):
    """The optimizer's own target (fusedamp's) or the one the scaler prepared for it."""
    target = getattr(optimizer, "_step_target", None)
    if target is None:
        target = scaler._torch_step_targets.get(id(optimizer))
    if target is None:
        raise RuntimeError(
            f"fusedamp: under torch.compile, scaler.{what}() of a torch optimizer "
            f"({type(optimizer).__name__}) needs scaler.prepare_compiled_step(optimizer) once "
            "before compiling: the compiled graph reaches it through a handle made there "
            "(dynamo cannot make one, nor hand the scale to a torch optimizer's attributes)")
    return target


def scale(scaler, outputs):
    """``scaler.scale(tensor)`` in a compiled graph: the product traced (autograd and the
    compiler see it), the scale from the engine."""
    if not outputs.is_floating_point():
        raise RuntimeError(f"fusedamp.GradScaler::scale: the tensor must be floating point, "
                           f"got {outputs.dtype}")
    # like: the loss without its graph (only its device and dtype are read).
    factor = torch.ops.fusedamp.scaler_scale_factor(scaler._step_target, outputs.detach())
    return outputs * factor


def schedule_step(schedule):
    """``scheduler.step()`` of a fusedamp.lr_scheduler schedule, in a compiled graph: its eager
    step (the same lr bits), after the optimizer's step in the graph's order."""
    lrs = [g["lr"] for g in schedule.optimizer.param_groups]
    torch.ops.fusedamp.schedule_step_(schedule._step_target, lrs, schedule._applied)


def zero_grad(optimizer, set_to_none):
    """torch.optim.Optimizer.zero_grad's effect, in a form dynamo traces (torch's own is kept
    out of tracing): the gradients set to None, or detached and zeroed in place."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()


def scaler_update(scaler, new_scale):
    """``scaler.update(new_scale)`` in a compiled graph."""
    tensor = new_scale if isinstance(new_scale, torch.Tensor) else None
    value = None if new_scale is None or tensor is not None else float(new_scale)
    torch.ops.fusedamp.scaler_update_(scaler._step_target, tensor, value)
