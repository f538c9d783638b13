"""The optimizer half of a step under torch.compile: one graph, the engine's own eager step.

The scaler and the optimizers are the C++ engine behind pybind11, which dynamo cannot trace.
Under compilation their step entries (``scaler.step(opt)``, ``scaler.update()``, ``opt.step()``)
therefore become calls of the operators below, whose arguments are

- a ``StepTarget``: the fusedamp object itself, as an opaque reference (torch's opaque objects,
  torch >= 2.10): the graph takes it as an input and treats it as a black box that holds state;
- the tensors the graph can also see: the parameters and their gradients (declared mutated), the
  groups' tensor learning rates and a ``new_scale`` tensor (read).

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

    @torch.library.custom_op("fusedamp::scaler_update_", mutates_args=())
    def _scaler_update(scaler: StepTarget, new_scale: torch.Tensor | None,
                       new_value: float | None) -> None:
        scaler = scaler.obj
        type(scaler).update(scaler, new_scale if new_value is None else new_value)

    @_optimizer_step.register_fake
    def _(optimizer, params, grads, lrs):
        return None

    @_scaler_step.register_fake
    def _(scaler, optimizer, params, grads, lrs):
        return None

    @_scaler_update.register_fake
    def _(scaler, new_scale, new_value):
        return None

    for _op in (_optimizer_step, _scaler_step, _scaler_update):
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
    target = getattr(optimizer, "_step_target", None)
    if target is not None:
        torch.ops.fusedamp.scaler_step_(scaler._step_target, target, *_step_tensors(optimizer))
        return None
    target = scaler._torch_step_targets.get(id(optimizer))
    if target is None:
        raise RuntimeError(
            f"fusedamp: under torch.compile, scaler.step() of a torch optimizer "
            f"({type(optimizer).__name__}) needs scaler.prepare_compiled_step(optimizer) once "
            "before compiling: the compiled graph steps it through a handle made there (dynamo "
            "cannot make one, nor hand the scale to a torch optimizer's attributes)")
    torch.ops.fusedamp.scaler_step_(scaler._step_target, target, *_step_tensors(optimizer))
    return None


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
