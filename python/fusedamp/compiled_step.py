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
parameters, which of them have gradients, which groups hold a tensor lr and the ids of the
objects are what the graph depends on (dynamo guards them); the values in the device tensors
are not, so a changing tensor lr, a skipped step and the scale's growth and backoff never
recompile. Nor do the groups' float hyper-parameters (a float lr a torch scheduler sets every
step included): the graph reaches the param groups through the optimizer's target, never through
the optimizer, because dynamo specialises on every value of a torch optimizer's param groups
read through the optimizer itself (a guard on the float lr's value, so a recompile when it
changes); the engine reads them at run time.

A torch optimizer stepped by fusedamp.GradScaler goes through the same ``scaler_step_`` op, with
the target ``scaler.prepare_compiled_step(optimizer)`` made for it before compiling: dynamo can
neither make an opaque object inside a graph nor set the ``grad_scale`` / ``found_inf``
attributes of a torch optimizer it traces (it treats the optimizer as immutable).
"""
from __future__ import annotations

import operator
import weakref

import torch

from .fsdp import has_dtensors

try:  # torch >= 2.10
    from torch._library.effects import EffectType
    from torch._library.opaque_object import MemberType, register_opaque_type
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
        """A scaler, optimizer or schedule as an input of a compiled graph (held weakly: the
        object keeps its target, not the other way round). An optimizer's target also holds its
        ``param_groups`` list, the one the graph reads (see the module's docstring)."""

        def __init__(self, obj):
            self._ref = weakref.ref(obj)
            self._name = type(obj).__name__

        @property
        def param_groups(self):
            """The object's ``param_groups`` list as it is now (None for a scaler or a
            schedule): the graph reads it through this, one read per call, so a list that
            replaced the optimizer's (torch's load_state_dict) is the one read."""
            groups = getattr(self._ref(), "param_groups", None)
            return groups if isinstance(groups, list) else None

        @property
        def obj(self):
            obj = self._ref()
            if obj is None:
                raise RuntimeError(f"fusedamp: the {self._name} this compiled step was traced "
                                   "for no longer exists")
            return obj

        def tensor_lr_groups(self):
            """The indices of the groups whose lr is a tensor, read at trace time (the guard
            below holds the graph to them)."""
            return _tensor_lr_groups(self.param_groups)

        def __repr__(self):
            return f"StepTarget({self._name})"

        # A copy is the same handle: the fake object dynamo traces with holds a deep copy of
        # the target and calls tensor_lr_groups on it, which must see the live object.
        def __deepcopy__(self, memo):
            clone = object.__new__(type(self))
            clone.__dict__.update(self.__dict__)
            return clone

        # Inductor pickles a graph's inputs into its cache key: the object's name and identity
        # (a weak reference does not pickle; an unpickled target steps nothing).
        def __getstate__(self):
            return {"name": self._name, "id": id(self._ref())}

        def __setstate__(self, state):
            self._ref = lambda: None
            self._name = state["name"]

    _grad_of = operator.attrgetter("grad")

    def _tensor_lr_groups(groups):
        return tuple(i for i, g in enumerate(groups) if isinstance(g.get("lr"), torch.Tensor))

    def _guard_values(target):
        # What a graph traced through this target depends on beyond what dynamo guards itself:
        # which groups hold a tensor lr (a group's float lr is never read in the graph, so its
        # value is not guarded).
        groups = target.param_groups
        return [] if groups is None else [_tensor_lr_groups(groups)]

    register_opaque_type(StepTarget, typ="reference", guard_fn=_guard_values,
                         members={"param_groups": MemberType.INLINED,
                                  "tensor_lr_groups": MemberType.USE_REAL})

    def _through_arguments(args, live):
        # The op's effect goes through its declared arguments. The object's eager step wrote
        # the live tensors; inductor reinplaces and hands the op those very tensors, but a
        # functionalising backend (aot_eager) hands it copies and afterwards copies them back
        # over the live tensors, which would undo the step unless the copies hold its result.
        if len(args) != len(live):
            raise RuntimeError("fusedamp: the compiled step's tensors do not match the "
                               "optimizer's parameters and gradients")
        if all(map(operator.is_, args, live)):
            return
        for arg, tensor in zip(args, live):
            if arg is not tensor and arg.data_ptr() != tensor.data_ptr():
                arg.copy_(tensor)

    def _live_step_tensors(target, params, grads):
        live = [p for g in target.param_groups for p in g["params"]]
        if params is not None:
            _through_arguments(params, live)
        _through_arguments(grads, [g for g in map(_grad_of, live) if g is not None])

    @torch.library.custom_op("fusedamp::optimizer_step_", mutates_args=("params", "grads"))
    def _optimizer_step(optimizer: StepTarget, params: list[torch.Tensor],
                        grads: list[torch.Tensor], lrs: list[torch.Tensor]) -> None:
        opt = optimizer.obj
        type(opt).step(opt)  # the class's eager step: `opt.step` may be the compiled one
        _live_step_tensors(optimizer, params, grads)

    @torch.library.custom_op("fusedamp::scaler_step_", mutates_args=("params", "grads"))
    def _scaler_step(scaler: StepTarget, optimizer: StepTarget, params: list[torch.Tensor],
                     grads: list[torch.Tensor], lrs: list[torch.Tensor]) -> None:
        scaler = scaler.obj
        type(scaler).step(scaler, optimizer.obj)
        _live_step_tensors(optimizer, params, grads)

    @torch.library.custom_op("fusedamp::scaler_unscale_", mutates_args=("grads",))
    def _scaler_unscale(scaler: StepTarget, optimizer: StepTarget,
                        grads: list[torch.Tensor]) -> None:
        scaler = scaler.obj
        type(scaler).unscale_(scaler, optimizer.obj)
        _live_step_tensors(optimizer, None, grads)

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
        _through_arguments(lrs, _schedule_lrs(schedule))
        _through_arguments([applied], [schedule._applied])

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


def _step_tensors(target):
    """What the graph sees of an optimizer's step, read through its target: every parameter,
    the gradients present and the groups' tensor learning rates."""
    groups = target.param_groups
    params = [p for g in groups for p in g["params"]]
    if has_dtensors(params):
        raise RuntimeError(
            "fusedamp: under torch.compile, the step of DTensor (FSDP2) parameters is not taken "
            "into the graph (the step's operators have no sharding rule); compile the model "
            "and leave scaler.step / opt.step eager, where they are one fused pass per shard")
    grads = [p.grad for p in params if p.grad is not None]
    lrs = [groups[i]["lr"] for i in target.tensor_lr_groups()]
    return params, grads, lrs


def optimizer_step(optimizer, args, kwargs):
    """``optimizer.step()`` of a fusedamp optimizer, in a compiled graph."""
    _refuse_arguments("optimizer.step()", args, kwargs)
    target = optimizer._step_target
    torch.ops.fusedamp.optimizer_step_(target, *_step_tensors(target))


def scaler_step(scaler, optimizer, args, kwargs):
    """``scaler.step(optimizer)`` in a compiled graph: the scaler's eager step through the op,
    with the optimizer's own target (fusedamp's) or the one prepared for it (torch's)."""
    _refuse_arguments("scaler.step(optimizer)", args, kwargs)
    target = _target_of(scaler, optimizer, "step")
    torch.ops.fusedamp.scaler_step_(scaler._step_target, target, *_step_tensors(target))
    return None


def scaler_unscale(scaler, optimizer):
    """``scaler.unscale_(optimizer)`` in a compiled graph: the scaler's eager unscale_."""
    target = _target_of(scaler, optimizer, "unscale_")
    _, grads, _ = _step_tensors(target)
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
    torch.ops.fusedamp.schedule_step_(schedule._step_target, _schedule_lrs(schedule),
                                      schedule._applied)


def _schedule_lrs(schedule):
    # Through the optimizer's target, as the step reads them (a schedule's lrs are tensors).
    target = getattr(schedule.optimizer, "_step_target", None)
    groups = schedule.optimizer.param_groups if target is None else target.param_groups
    return [g["lr"] for g in groups]


def zero_grad(optimizer, set_to_none):
    """torch.optim.Optimizer.zero_grad's effect, in a form dynamo traces (torch's own is kept
    out of tracing): the gradients set to None, or detached and zeroed in place. The groups
    are read through the optimizer's target, as the step reads them."""
    for group in optimizer._step_target.param_groups:
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
