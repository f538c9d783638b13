"""torch.optim-style master-weight optimizers backed by the C++ engine.

``AdamW``, ``Adam``, ``SGD`` and ``Lion`` are ``torch.optim.Optimizer`` subclasses: param
groups, LR schedulers, ``zero_grad``, hooks and ``state_dict`` work as in torch. The step itself
is the engine's (fusedamp._C): one read-only ``grad_stats_`` pass per device (when clipping,
loss scaling or non-finite protection need it) and one fused step operator (``adam_step_``,
``sgd_step_``, ``lion_step_``) per (group, device, dtype) bucket. No host synchronisation; a step whose gradients hold inf/NaN
changes nothing. Hyper-parameters are validated by the engine, which raises ValueError.

They speak torch's AMP protocol (``_step_supports_amp_scaling``): a loss scaler — torch's or
fusedamp's — sets ``grad_scale`` and ``found_inf`` on the optimizer before ``step()``, and the
step unscales, checks and skips itself on the device. ``_step_checks_nonfinite`` tells a scaler
that the step checks the gradients itself (ORing its finding into ``found_inf``), so
fusedamp.GradScaler adds no pass of its own.
"""
from __future__ import annotations

import inspect
import warnings
from collections import defaultdict
from typing import Iterable

import torch
import torch.optim.optimizer as _torch_optimizer

from . import compiled_step, optim_state
from ._library import _C
from .fsdp import has_dtensors
from .optim_options import check_group, defaults_of, extra_options_doc
from .part_engine import PartitionEngine
from .shard_engine import ShardEngine

if __doc__:  # None under python -OO
    __doc__ += "\n" + extra_options_doc()

__all__ = ["AdamW", "Adam", "SGD", "Lion", "Adagrad", "SparseAdam", "RowWiseAdagrad",
           "FusedOptimizer", "StepResults"]

# torch.optim's registries of global step hooks (register_optimizer_step_pre_hook / _post_hook),
# read by the step to decide whether it needs torch's hook-running wrapper.
_GLOBAL_STEP_HOOKS = (_torch_optimizer._global_optimizer_pre_hooks,
                      _torch_optimizer._global_optimizer_post_hooks)


def make_engine(engine_cls, groups, partition_of=None):
    """The engine for these param groups: the C++ engine itself for plain tensors, a
    ShardEngine over the local shards for DTensor (FSDP2) parameters, a PartitionEngine where
    the groups are this rank's partition of parameters stepped across `partition_of` (a
    process group: ZeRO stage 1). The last two reduce the step's statistics over the ranks."""
    if has_dtensors(p for g in groups for p in g):
        return ShardEngine(engine_cls, groups)
    if partition_of is not None:
        return PartitionEngine(engine_cls(groups), partition_of)
    return engine_cls(groups)


class StepResults:
    """What an optimizer over the engine (``self._engine``) tells of its last step: device
    tensors, read on the host only when the caller chooses to."""

    @property
    def last_step_applied(self):
        """1.0 if the last step was applied (on every rank), 0.0 if skipped; None before."""
        return self._engine.last_step_applied()

    @property
    def skipped_steps(self):
        """Number of skipped steps (int64); None before the first step."""
        return self._engine.skipped_steps()

    @property
    def grad_sum_sq(self):
        """Sum of squares of the last step's (scaled) gradients, over all groups (and ranks)."""
        return self._engine.grad_sum_sq()


class FusedOptimizer(StepResults, torch.optim.Optimizer):
    """Common machinery; see AdamW, Adam, SGD and Lion."""

    _engine_cls = None  # set by subclasses
    # Engine options a class sets whatever its arguments (the rest of its kind's table are its
    # keyword arguments).
    _fixed_options = {}
    _step_supports_amp_scaling = True
    _step_checks_nonfinite = True

    def __init__(self, params, defaults):
        self._engine = None
        # A process group when this optimizer steps one rank's partition of the parameters
        # (fusedamp.distributed.ZeroRedundancyOptimizer sets it): its statistics are reduced.
        self._partition_of = None
        super().__init__(params, defaults)
        self._build_engine()
        self._step_target = compiled_step.make_target(self)  # in a compiled graph (its op)

    def _build_engine(self):
        for group in self.param_groups:
            check_group(group)
        engine = make_engine(self._engine_cls, [list(g["params"]) for g in self.param_groups],
                             self._partition_of)
        engine.sync_options(self.param_groups)
        engine.check_options()  # ValueError before anything is kept
        self._engine = engine
        # Snapshots of the group dicts the step last pushed (sync_changed_options): dropped
        # whenever options reach the engine another way.
        self._synced_options = []

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if self._engine is not None:  # during __init__ the engine is built once at the end
            old = self._engine
            state = [(p, old.param_state(p)) for g in self.param_groups[:-1] for p in g["params"]]
            try:
                self._build_engine()
            except Exception:
                self.param_groups.pop()
                self._engine = old
                raise
            state = [(p, s) for p, s in state if s]
            self._engine.load_param_states([p for p, _ in state], [s for _, s in state])
            if old.skipped_steps() is not None:
                self._engine.set_skipped_steps(old.skipped_steps())

    # ---- the step --------------------------------------------------------------------
    def step(self, *args, **kwargs):
        """step(closure=None): one fused step; under a loss scaler (torch's AMP protocol) a
        scaled one."""
        if compiled_step.available and torch.compiler.is_compiling():
            return compiled_step.optimizer_step(self, args, kwargs)
        release = self.__dict__.get("_fusedamp_release")
        if release is not None:  # fusedamp.release_gradients: stepped inside backward
            return release.step_called(*args, **kwargs)
        if args or kwargs or _step_hooks_of(self):
            # Hooks see the arguments exactly as given (torch's wrapper passes them on).
            return self._step_through_torch_wrapper(*args, **kwargs)
        # What torch's step wrapper does when no hook is registered, at a fraction of its host
        # cost: the profiler scope is opened by the engine's call (record_as), the profiler's
        # Python tracer still sees _optimizer_step_code.
        self._run_engine_step(f"Optimizer.step#{type(self).__name__}.step")
        self._optimizer_step_code()
        return None

    # torch.optim.Optimizer.__init__ wraps a class's step() in its profiling/hook wrapper unless
    # the step says it is already hooked: this one runs hooks itself (through the wrapper).
    step.hooked = True

    def _step_body(self, closure=None):
        loss = closure_loss(closure)
        self._run_engine_step(None)  # torch's wrapper opened the profiler scope
        return loss

    # The step with pre/post hooks or a closure: torch's own wrapper (record_function, the
    # hooks in torch's order with torch's argument rewriting, _optimizer_step_code).
    _step_through_torch_wrapper = torch.optim.Optimizer.profile_hook_step(_step_body)
    step.__signature__ = inspect.signature(_step_body)

    def _run_engine_step(self, record_as):
        # The engine runs its step without autograd (its own guard): no torch.no_grad here.
        engine = self._engine
        engine.sync_changed_options(self.param_groups, self._synced_options)
        grad_scale, found_inf = amp_handover(self)
        if grad_scale is None and found_inf is None:
            engine.step(record_as)
        else:
            # fusedamp.GradScaler's telemetry: this step's gradient pass records for it.
            engine.step_amp(grad_scale, found_inf,
                            getattr(self, "_fusedamp_telemetry_of", None), record_as)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # torch's zero_grad is kept out of dynamo's tracing (torch._disable_dynamo), which a
        # fullgraph compile of the optimizer half would break on: there, the same effect traced.
        if compiled_step.available and torch.compiler.is_compiling():
            compiled_step.zero_grad(self, set_to_none)
        else:
            super().zero_grad(set_to_none)

    zero_grad.__doc__ = torch.optim.Optimizer.zero_grad.__doc__

    def grad_norm_history(self):
        """Deprecated (removed in the next release): read ``scaler.telemetry()["grad_norm"]``
        of the fusedamp.GradScaler that steps this optimizer.

        Returns that column, as floats, oldest first, of the fusedamp.GradScaler that last
        stepped this optimizer (``scaler.step(opt)``); ``[]`` where there is none (the
        optimizer was never stepped by one, or that scaler no longer exists), or it records
        no telemetry (disabled, ``telemetry=False``). One synchronisation. The column has one
        entry per iteration of that scaler, not per step of this optimizer:

        - the global norm of the unscaled gradients of every pass the iteration made for the
          scaler (this optimizer's and, in the same iteration, any other optimizer's it
          stepped, and ``scaler.unscale_``'s), computed in FP64 from the scaled sum of squares
          (it may differ from the step's FP32 norm in the last bits);
        - on FSDP2 (DTensor) parameters, the global norm too (the passes are reduced over
          the mesh), the same on every rank;
        - at most the scaler's ``telemetry_capacity`` iterations; steps without the scaler
          (``opt.step()`` alone) are not in it.

        Emits a DeprecationWarning."""
        warnings.warn("fusedamp.optim: grad_norm_history() is deprecated: read "
                      "scaler.telemetry()['grad_norm'] of the fusedamp.GradScaler that steps "
                      "this optimizer", DeprecationWarning, stacklevel=2)
        ref = self.__dict__.get("_fusedamp_scaler")
        scaler = None if ref is None else ref()
        if scaler is None:
            return []
        return list(scaler.telemetry()["grad_norm"])

    # ---- state (optim_state.py: the engine's state in torch.optim's shapes) --------------
    @property
    def state(self):
        # torch.optim keeps per-parameter state in self.state (a defaultdict); here it lives in
        # the engine and is exposed as the tensors themselves (no copies).
        if getattr(self, "_engine", None) is None:
            return self.__dict__.setdefault("_pre_state", defaultdict(dict))
        return optim_state.engine_state(self._engine, self.param_groups)

    @state.setter
    def state(self, value):
        self.__dict__["_pre_state"] = value

    def state_dict(self):
        """torch.optim's layout (per-parameter state by index, packed param groups), plus the
        engine's skipped-step counter (torch.optim ignores the extra key)."""
        return optim_state.state_dict(self._engine, self.param_groups)

    def load_state_dict(self, state_dict):
        """Loads fusedamp's or torch.optim's state dict (the same kind of optimizer). Everything
        is checked before anything changes; parameters without an entry get no state."""
        optim_state.load_state_dict(self._engine, self._engine_cls, self.param_groups,
                                    state_dict)
        self._synced_options.clear()

    # ---- pickling (as torch.optim: the parameters travel with the optimizer) ------------
    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("_engine", "_pre_state", "_synced_options", "_fusedamp_scaler",
                              "_partition_of", "_step_target", "_fusedamp_release")}
        state["_engine_state"] = self.state_dict()
        return state

    def __setstate__(self, state):
        engine_state = state.pop("_engine_state")
        state["_partition_of"] = None  # a process group does not travel
        super().__setstate__(state)
        self._build_engine()
        self._step_target = compiled_step.make_target(self)
        self.load_state_dict(engine_state)


def _step_hooks_of(optimizer):
    """Whether any step pre/post hook applies to `optimizer` (its own or torch's global ones)."""
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or _GLOBAL_STEP_HOOKS[0] or _GLOBAL_STEP_HOOKS[1])


def closure_loss(closure):
    """torch.optim's convention: a step's closure recomputes the loss, with grad enabled."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def amp_handover(optimizer):
    """What a loss scaler handed to `optimizer` under torch's AMP protocol (grad_scale and
    found_inf attributes, set for the duration of one step), or (None, None)."""
    return getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)


# Each class's documentation ends with fusedamp's own arguments, written from their table.
_EXTRAS_DOC = "\n\n" + extra_options_doc(indent="    ")


class Adam(FusedOptimizer):
    __doc__ = """torch.optim.Adam (L2 weight decay, or decoupled as AdamW's with
    decoupled_weight_decay=True) with FP32 master weights; see the module doc.""" + _EXTRAS_DOC

    _engine_cls = _C.Adam

    def __init__(self, params: Iterable, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False,
                 master_weights=True, state_dtype=torch.float32, rounding_seed=0,
                 max_grad_norm=None, skip_nonfinite=True, adopt_param_edits=True,
                 write_back_grads=True):
        super().__init__(params, defaults_of(locals()))


class AdamW(Adam):
    __doc__ = """torch.optim.AdamW (decoupled weight decay) with FP32 master weights; see the
    module doc.""" + _EXTRAS_DOC

    _engine_cls = _C.AdamW
    # Adam's decoupled weight decay, recorded in the defaults as torch's AdamW records it.
    _fixed_options = {"decoupled_weight_decay": True}

    def __init__(self, params: Iterable, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, amsgrad=False, *, maximize=False, foreach=None,
                 capturable=False, differentiable=False, fused=None, master_weights=True,
                 state_dtype=torch.float32, rounding_seed=0, max_grad_norm=None,
                 skip_nonfinite=True, adopt_param_edits=True, write_back_grads=True):
        FusedOptimizer.__init__(self, params,
                                dict(defaults_of(locals()), **self._fixed_options))


class SGD(FusedOptimizer):
    __doc__ = """torch.optim.SGD with FP32 master weights; see the module doc. Embedding
    tables with sparse gradients step row by row (fusedamp.sparse_sgd), their momentum a dense
    FP32 buffer.""" + _EXTRAS_DOC

    _engine_cls = _C.SGD

    def __init__(self, params: Iterable, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, foreach=None, differentiable=False,
                 fused=None, master_weights=True, state_dtype=torch.float32, rounding_seed=0,
                 max_grad_norm=None, skip_nonfinite=True, adopt_param_edits=True,
                 write_back_grads=True):
        super().__init__(params, defaults_of(locals()))

    def _run_engine_step(self, record_as):
        if not sparse_sgd.has_sparse_grads(self.param_groups) and not self.__dict__.get(
                "_table_state"):
            return super()._run_engine_step(record_as)
        if sparse_sgd.has_sparse_grads(self.param_groups):
            grad_scale, found_inf = amp_handover(self)
            return sparse_sgd.step(self, record_as, grad_scale, found_inf,
                                   getattr(self, "_fusedamp_telemetry_of", None))
        sparse_sgd.step_without_tables(self)  # refuses a table whose gradient turned dense
        return super()._run_engine_step(record_as)

    @property
    def state(self):
        state = FusedOptimizer.state.fget(self)
        for p, s in sparse_sgd.table_states(self).items():
            dict.__setitem__(state, p, s)
        return state

    @state.setter
    def state(self, value):
        FusedOptimizer.state.fset(self, value)

    def state_dict(self):
        return sparse_sgd.with_table_states(self, super().state_dict())

    def load_state_dict(self, state_dict):
        rest, tables = sparse_sgd.without_table_states(self, state_dict)
        super().load_state_dict(rest)  # checks everything of its own before it changes
        sparse_sgd.table_states(self).clear()
        sparse_sgd.table_states(self).update(tables)


class Lion(FusedOptimizer):
    __doc__ = """Lion (Chen et al. 2023: the sign of an interpolation of momentum and gradient,
    decoupled weight decay) with FP32 master weights; see the module doc. torch.optim has no
    Lion: the update and the state (``exp_avg``) are those of lucidrains/lion-pytorch, step for
    step (p *= 1 - lr * wd first). state_dtype is float32 or bfloat16.""" + _EXTRAS_DOC

    _engine_cls = _C.Lion

    def __init__(self, params: Iterable, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 maximize=False, foreach=None, differentiable=False, fused=None,
                 master_weights=True, state_dtype=torch.float32, rounding_seed=0,
                 max_grad_norm=None, skip_nonfinite=True, adopt_param_edits=True,
                 write_back_grads=True):
        super().__init__(params, defaults_of(locals()))


# Embedding tables with sparse gradients (fusedamp.sparse_optim): imported last, as they use
# this module's AMP handover.
from . import sparse_sgd  # noqa: E402
from .sparse_optim import Adagrad, RowWiseAdagrad, SparseAdam  # noqa: E402,F401
