"""The inputs of the fused ops, built in one place for the op tests and the benchmarks.

``op_inputs(device, ...)`` builds one problem: model params (FP32, FP16 or BF16), optional FP32
master weights, grads, the optimizer state lists (Adam moments, SGD momentum buffers, step
counts) and the device scalars a step uses (inv_scale, found_inf, grad_sum_sq, lr_tensor, the
loss-scale state, per-tensor flags, and what account_step_ records: step_applied,
skipped_steps, found_inf_out, grad_norm). ``OpInputs.args(op)`` turns it into the op's positional
arguments and keyword arguments, read from the op's registered schema: every argument named like
a field of OpInputs takes that field, so an op argument added later only needs its field here.

    inp = op_inputs("cpu", param_dtype=torch.float16, master_weights=True,
                    scalars=dict(inv_scale=2.0 ** -10, found_inf=0.0))
    inp.call("grad_stats_")                      # ops.grad_stats_(grads, found_inf, grad_sum_sq)
    args, kwargs = inp.args("adam_step_", lr=1e-2)
    torch.ops.fusedamp.adam_step_(*args, **kwargs)

The benchmarks import this module too (benchmarks/ puts tests/python on sys.path), so a benchmark
times the very inputs the tests check. It needs torch and the loaded fusedamp ops, not pytest.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from op_helpers import SIZES, randn_list

# Required hyper-parameters, where an op's schema has no default: torch.optim's defaults
# (adam_step_ with decoupled weight decay is AdamW) and torch.amp.GradScaler's.
HYPER_DEFAULTS = {
    "adam_step_": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
                       decoupled_weight_decay=True),
    "sgd_step_": dict(lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False),
    "lion_step_": dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.0),
    "update_scale_": dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=2000),
}

# Schema argument names that mean a field under another name.
FIELD_OF = {"sum_sq": "grad_sum_sq"}

INT32_SCALARS = ("growth_tracker", "hysteresis_tracker")
INT64_SCALARS = ("skipped_steps",)


@dataclass
class OpInputs:
    """Every tensor of one problem, named as in the ops' schemas. Lists the problem does not use
    are empty (as the ops take them); device tensors it was not given are None (not passed)."""
    params: list
    master_params: list
    grads: list
    exp_avgs: list = field(default_factory=list)
    exp_avg_sqs: list = field(default_factory=list)
    momentum_buffers: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    lr_tensor: torch.Tensor | None = None
    inv_scale: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None
    grad_sum_sq: torch.Tensor | None = None
    tensor_flags: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    growth_tracker: torch.Tensor | None = None
    hysteresis_tracker: torch.Tensor | None = None
    step_applied: torch.Tensor | None = None
    skipped_steps: torch.Tensor | None = None
    found_inf_out: torch.Tensor | None = None
    grad_norm: torch.Tensor | None = None

    def args(self, op, **overrides):
        """(positional args, kwargs) for ``torch.ops.fusedamp.<op>``. Each schema argument takes,
        in this order: an override, the field of that name (lists as fresh shallow copies, so a
        caller may edit them), HYPER_DEFAULTS. The schema's required positional arguments come
        back positional, the rest as kwargs; an override of None drops a keyword argument.
        grad_sum_sq goes to a step only with max_grad_norm: the step reads it only to clip, and
        to unscale_and_check_ (as sum_sq) only as an override: it asks for the statistics."""
        schema = getattr(torch.ops.fusedamp, op).default._schema
        names = {a.name for a in schema.arguments}
        unknown = set(overrides) - names
        if unknown:
            raise TypeError(f"{op} has no argument(s) {sorted(unknown)}")
        defaults = HYPER_DEFAULTS.get(op, {})
        args, kwargs = [], {}
        for a in schema.arguments:
            if a.name in overrides:
                value = overrides[a.name]
            elif FIELD_OF.get(a.name, a.name) in _FIELDS:
                value = getattr(self, FIELD_OF.get(a.name, a.name))
                value = list(value) if isinstance(value, list) else value
            elif a.name in defaults:
                value = defaults[a.name]
            elif a.has_default_value():
                continue
            else:
                raise TypeError(f"{op}: no value for {a.name!r} (add a field or a default)")
            if not (a.kwarg_only or a.has_default_value()):
                args.append(value)
            elif value is not None:
                kwargs[a.name] = value
        if (op in ("adam_step_", "sgd_step_") and kwargs.get("max_grad_norm") is None
                and "grad_sum_sq" not in overrides):
            kwargs.pop("grad_sum_sq", None)
        if op == "unscale_and_check_" and "sum_sq" not in overrides:
            kwargs.pop("sum_sq", None)  # the plain unscale unless statistics are asked for
        return tuple(args), kwargs

    def tensors(self, op):
        """The tensors and tensor lists `op` takes from these inputs, in schema order: what a
        test snapshots to show that a call changed nothing."""
        args, kwargs = self.args(op)
        return [v for v in (*args, *kwargs.values()) if isinstance(v, (list, torch.Tensor))]

    def call(self, op, **overrides):
        """Runs ``torch.ops.fusedamp.<op>`` on these inputs (see args)."""
        self.bind(op, **overrides)()

    def bind(self, op, *, entry=None, **overrides):
        """``torch.ops.fusedamp.<op>`` (or ``entry.<op>``, e.g. entry=fusedamp.ops) with its
        arguments resolved now (see args): a call of it costs what the op call costs, which is
        what a benchmark times. A field reassigned later is not seen; tensors changed in place
        are."""
        args, kwargs = self.args(op, **overrides)
        return functools.partial(getattr(entry or torch.ops.fusedamp, op), *args, **kwargs)

    def named_tensors(self):
        """(field name, tensor) for every tensor held, fields in order, list entries in order."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            for t in value if isinstance(value, list) else [] if value is None else [value]:
                yield f.name, t

    def map(self, fn):
        """A copy with every tensor t of field `name` replaced by fn(name, t): the same problem
        on another device, at another offset or in another layout."""
        changes = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                changes[f.name] = [fn(f.name, t) for t in value]
            elif value is not None:
                changes[f.name] = fn(f.name, value)
        return dataclasses.replace(self, **changes)


_FIELDS = {f.name for f in dataclasses.fields(OpInputs)}


def op_inputs(device, sizes=SIZES, *, param_dtype=torch.float32, grad_dtype=None,
              master_weights=False, moments=True, momentum=False, seed=0, weights=None,
              grads=None, scalars=None, loss_scale=None, hysteresis=1) -> OpInputs:
    """One problem on `device`.

    weights: the parameters' FP32 start values (copied); default: randn_list(seed=seed) over
      `sizes`, or over the grads' shapes where grads are given. They are the master weights
      when master_weights, and params are their rounding to param_dtype.
    grads: copied as given; default: randn_list(seed=seed + 1) in grad_dtype (default:
      param_dtype) over the weights' shapes.
    moments: Adam's exp_avgs and exp_avg_sqs; momentum: SGD's momentum_buffers. State starts
      at zero in FP32, laid out like the weights; steps are 0-dim zeros, one per tensor.
    scalars: {field name: start value} for the device tensors the problem uses (one element
      each, int32 for the trackers, int64 for skipped_steps; tensor_flags gets one element per
      tensor). Only these are passed to the ops.
    loss_scale: also the loss-scale state update_scale_ keeps: scale = loss_scale, a growth
      tracker at 0 and a hysteresis tracker at `hysteresis` (where it starts).
    """
    if weights is None:
        shapes = sizes if grads is None else [g.shape for g in grads]
        weights = randn_list(device, torch.float32, shapes, seed=seed)
    else:
        weights = [w.to(device, torch.float32, copy=True) for w in weights]
    if grads is None:
        grads = randn_list(device, grad_dtype or param_dtype, [w.shape for w in weights],
                           seed=seed + 1)
    else:
        grads = [g.to(device, copy=True) for g in grads]

    def zeros():
        return [torch.zeros_like(w) for w in weights]

    n = len(weights)
    scalars = dict(scalars or {})
    if loss_scale is not None:
        scalars.update(scale=loss_scale, growth_tracker=0, hysteresis_tracker=hysteresis)
    device_tensors = {}
    for name, value in scalars.items():
        shape = (n,) if name == "tensor_flags" else (1,)
        dtype = (torch.int32 if name in INT32_SCALARS else
                 torch.int64 if name in INT64_SCALARS else torch.float32)
        device_tensors[name] = torch.full(shape, value, dtype=dtype, device=device)
    return OpInputs(
        params=[w.to(param_dtype, copy=master_weights) for w in weights],
        master_params=weights if master_weights else [],
        grads=grads,
        exp_avgs=zeros() if moments else [],
        exp_avg_sqs=zeros() if moments else [],
        momentum_buffers=zeros() if momentum else [],
        steps=[torch.zeros((), device=device) for _ in weights],
        **device_tensors)
