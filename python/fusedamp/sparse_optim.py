"""Optimizers for embedding tables with sparse gradients (``nn.Embedding``/``nn.EmbeddingBag``
with ``sparse=True``): ``Adagrad``, ``SparseAdam``, ``RowWiseAdagrad``, and the sparse half of
``fusedamp.optim.SGD``.

Each step is one ``torch.ops.fusedamp.sparse_*_step_`` per table (CPU and CUDA kernels, the
same bits): the gradient's indices and values go in as autograd produced them, duplicates
included; the op sums each row's lookups in FP32 and reads and writes only the rows looked
up. FP16/BF16 tables keep an FP32 master (state ``"master_param"``) with
``master_weights=True``; the table holds its rounding. Before any table is written, one pass over every gradient's values checks for inf/NaN
(and, under a loss scaler, unscales them in place, as torch leaves ``.grad``); a step that finds
one changes nothing, on the device, without a host synchronisation.

The state keys are torch's (``"step"``, ``"sum"``, ``"exp_avg"``, ``"exp_avg_sq"``,
``"momentum_buffer"``), so torch.optim.Adagrad / SparseAdam state dicts load into these and
back. These optimizers run their per-table loop in Python rather than in the C++ engine: a model
has a handful of tables, so that loop is a few op calls per step.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, NamedTuple

import torch

from . import ops
from .optim_options import defaults_of

__all__ = ["Adagrad", "SparseAdam", "RowWiseAdagrad", "SparseRowOptimizer", "ALGORITHMS"]


class Algorithm(NamedTuple):
    """One row-wise sparse step: its operator, its state (key, "table" for a tensor of the
    table's shape or "rows" for one value per row) and the group options it takes."""
    name: str
    op: str
    state: tuple
    options: tuple


ALGORITHMS = {
    "sgd": Algorithm("sgd", "sparse_sgd_step_", (("momentum_buffer", "table"),),
                     ("lr", "momentum", "dampening", "nesterov", "maximize")),
    "adagrad": Algorithm("adagrad", "sparse_adagrad_step_", (("sum", "table"),),
                         ("lr", "lr_decay", "eps", "maximize")),
    "sparse_adam": Algorithm("sparse_adam", "sparse_adam_step_",
                             (("exp_avg", "table"), ("exp_avg_sq", "table")),
                             ("lr", "betas", "eps", "maximize")),
    "rowwise_adagrad": Algorithm("rowwise_adagrad", "sparse_rowwise_adagrad_step_",
                                 (("sum", "rows"),), ("lr", "eps", "maximize")),
}

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def row_sparse_grad(p, who):
    """p.grad as (indices, values) of a row-wise sparse gradient, or a clear error."""
    g = p.grad
    if not g.is_sparse:
        raise RuntimeError(f"{who} takes sparse gradients (nn.Embedding/EmbeddingBag with "
                           f"sparse=True); a parameter of shape {tuple(p.shape)} has a dense "
                           "one (a parameter's gradient must stay sparse from step to step)")
    if p.dim() != 2 or g.sparse_dim() != 1 or g.dense_dim() != 1:
        raise RuntimeError(f"{who}: only row-wise sparse gradients of 2-D tables are supported "
                           f"(sparse_dim 1, dense_dim 1, as nn.Embedding's); got a gradient with "
                           f"sparse_dim {g.sparse_dim()}, dense_dim {g.dense_dim()} for a "
                           f"parameter of shape {tuple(p.shape)}")
    if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
        raise RuntimeError(f"{who}: the gradient ({g.dtype}, {tuple(g.shape)}, {g.device}) does "
                           f"not match its parameter ({p.dtype}, {tuple(p.shape)}, {p.device})")
    indices, values = g._indices(), g._values()
    if indices.numel() and indices.device.type == "cpu":
        # Checked for every table before any is written (the op checks its own table only). On
        # CUDA the indices are data on the device: the op asserts there, as torch's indexing
        # does, where a check here would synchronise the host.
        low, high = torch.aminmax(indices)
        if low < 0 or high >= p.shape[0]:
            raise RuntimeError(f"{who}: gradient index {int(low if low < 0 else high)} is out "
                               f"of range for a table of {p.shape[0]} rows; nothing was modified")
    return indices, values


def check_master_option(group, who):
    mode = group.get("master_weights", True)
    if mode not in (True, False):
        raise ValueError(f"{who}: master_weights={mode!r} is not supported for sparse tables "
                         "(True: an FP32 master; False: the table stepped in its own dtype)")


def sparse_work(groups, who):
    """(param, group, (indices, values)) for each param of `groups` with a gradient, every
    one checked before anything is written."""
    work = []
    for group in groups:
        if group["lr"] < 0:
            raise ValueError(f"{who}: invalid learning rate {group['lr']}")
        for p in group["params"]:
            if p.grad is not None:
                work.append((p, group, row_sparse_grad(p, who)))
    return work


def check_values(work, groups, grad_scale, found_inf):
    """One pass over every table's gradient values, before any table is written: inf/NaN
    recorded in the returned flag (found_inf where a scaler gave one), the values unscaled in
    place under a scaler. Each lookup is checked on its own; the op sums duplicates in FP32,
    where finite FP16/BF16 values cannot overflow."""
    device = work[0][0].device
    values = [w[2][1] for w in work]
    flag = found_inf
    if flag is None and (grad_scale is not None or
                         any(group.get("skip_nonfinite", True) for group in groups)):
        flag = torch.zeros((), dtype=torch.float32, device=device)
    if grad_scale is not None:
        inv_scale = grad_scale.double().reciprocal().float()
        ops.unscale_and_check_(values, flag, inv_scale)  # .grad unscaled, as torch leaves it
    elif flag is not None:
        ops.grad_stats_(values, flag, torch.zeros(1, device=device))
    return flag


def apply_steps(work, algorithm, state_of, flag):
    """The op of `algorithm` on each table; all skip on the device if flag is set."""
    op = getattr(torch.ops.fusedamp, algorithm.op)
    for p, group, (indices, values) in work:
        state = state_of(p, group)
        kwargs = {"lr": float(group["lr"]), "maximize": bool(group.get("maximize", False)),
                  "found_inf": flag}
        for name in algorithm.options:
            if name == "betas":
                kwargs["beta1"], kwargs["beta2"] = (float(b) for b in group["betas"])
            elif name not in kwargs:
                kwargs[name] = group[name]
        state_args = [state.get(key) for key, _ in algorithm.state]
        op(p.data, state.get("master_param"), indices, values, *state_args, state["step"],
           **kwargs)


def sparse_step(groups, algorithm, state_of, grad_scale, found_inf, who):
    """One step of `algorithm` over the params of `groups` that have gradients. state_of(p,
    group) gives p's state dict, created on first use."""
    work = sparse_work(groups, who)
    if work:
        apply_steps(work, algorithm, state_of, check_values(work, groups, grad_scale,
                                                            found_inf))


def new_state(p, group, algorithm, initial=0.0):
    """A table's state as the op takes it: FP32 tensors, the step count, the master."""
    state = {"step": torch.zeros((), dtype=torch.float32, device=p.device)}
    for key, shape in algorithm.state:
        if key == "momentum_buffer" and group.get("momentum", 0) == 0:
            continue
        size = p.shape if shape == "table" else p.shape[:1]
        state[key] = torch.full(size, initial, dtype=torch.float32, device=p.device)
    if p.dtype in _LOW_PRECISION and group.get("master_weights", True):
        state["master_param"] = p.detach().float()
    return state


def loaded_value(p, key, value):
    """A state entry from a state dict (torch's or ours) in the layout the op takes."""
    if key == "step":
        return torch.tensor(float(value), dtype=torch.float32, device=p.device)
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_sparse:  # torch.optim.SGD's momentum buffer
        value = value.to_dense()
    return value.to(device=p.device, dtype=torch.float32).contiguous().clone()


class SparseRowOptimizer(torch.optim.Optimizer):
    """Common machinery of the row-wise sparse optimizers; see the module doc."""

    _algorithm: Algorithm = None  # set by subclasses
    _step_supports_amp_scaling = True
    _step_checks_nonfinite = True
    _initial_accumulator = "initial_accumulator_value"

    def __init__(self, params, defaults):
        super().__init__(params, defaults)
        for group in self.param_groups:
            check_master_option(group, type(self).__name__)

    def _state_of(self, p, group):
        state = self.state[p]
        if not state:
            state.update(new_state(p, group, self._algorithm,
                                   group.get(self._initial_accumulator, 0.0)))
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sparse_step(self.param_groups, self._algorithm, self._state_of,
                    getattr(self, "grad_scale", None), getattr(self, "found_inf", None),
                    f"fusedamp.optim.{type(self).__name__}")
        return loss

    def load_state_dict(self, state_dict):
        """Loads this optimizer's or torch's state dict of the same algorithm (torch's
        Adagrad / SparseAdam); the state keeps FP32 whatever the table's dtype. Everything is
        converted and checked before anything changes."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"])
                for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError("loaded state dict has a different number of parameter groups or "
                             "parameters per group")
        id_map = {i: p for s, g in zip(saved_groups, self.param_groups)
                  for i, p in zip(s["params"], g["params"])}
        converted = {}
        for i, entry in state_dict["state"].items():
            p = id_map[i]
            converted[p] = {k: loaded_value(p, k, v) for k, v in entry.items()}
            for key, shape in self._algorithm.state:
                if key in converted[p]:
                    want = p.shape if shape == "table" else p.shape[:1]
                    if converted[p][key].shape != want:
                        raise ValueError(f"fusedamp.optim.{type(self).__name__}: state "
                                         f"{key!r} has shape {tuple(converted[p][key].shape)}"
                                         f", expected {tuple(want)}")
        super().load_state_dict(dict(state_dict, state={}))
        self.state = defaultdict(dict, converted)


class Adagrad(SparseRowOptimizer):
    """torch.optim.Adagrad for embedding tables with sparse gradients (torch's update, lr_decay
    and initial_accumulator_value; weight_decay is refused with sparse gradients, as torch
    does), with FP32 master rows for FP16/BF16 tables; see the module doc."""

    _algorithm = ALGORITHMS["adagrad"]

    def __init__(self, params: Iterable, lr=1e-2, lr_decay=0.0, weight_decay=0.0,
                 initial_accumulator_value=0.0, eps=1e-10, foreach=None, *, maximize=False,
                 differentiable=False, fused=None, master_weights=True, skip_nonfinite=True):
        if weight_decay != 0:
            raise ValueError("fusedamp.optim.Adagrad: weight_decay is not compatible with sparse "
                             "gradients (as torch.optim.Adagrad)")
        if initial_accumulator_value < 0:
            raise ValueError(f"Invalid initial_accumulator_value value: "
                             f"{initial_accumulator_value}")
        super().__init__(params, defaults_of(locals()))
        for group in self.param_groups:  # torch creates the state here
            for p in group["params"]:
                self._state_of(p, group)


class SparseAdam(SparseRowOptimizer):
    """torch.optim.SparseAdam (lazy Adam: the moments of the rows looked up are updated, the
    bias corrections use the table's step count), with FP32 master rows for FP16/BF16 tables;
    see the module doc."""

    _algorithm = ALGORITHMS["sparse_adam"]

    def __init__(self, params: Iterable, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 maximize=False, *, master_weights=True, skip_nonfinite=True):
        super().__init__(params, defaults_of(locals()))


class RowWiseAdagrad(SparseRowOptimizer):
    """Adagrad with one FP32 accumulator per row (FBGEMM's EXACT_ROWWISE_ADAGRAD): each step a
    looked-up row's accumulator grows by the mean of its squared gradient, and the row moves by
    -lr / (sqrt(accumulator) + eps) times its gradient. State: 4 bytes per row."""

    _algorithm = ALGORITHMS["rowwise_adagrad"]

    def __init__(self, params: Iterable, lr=1e-2, eps=1e-10, initial_accumulator_value=0.0,
                 *, maximize=False, master_weights=True, skip_nonfinite=True):
        super().__init__(params, defaults_of(locals()))
