"""Optimizers for embedding tables with sparse gradients (``nn.Embedding``/``nn.EmbeddingBag``
with ``sparse=True``): ``Adagrad``, ``SparseAdam``, ``RowWiseAdagrad``, and the sparse half of
``fusedamp.optim.SGD``.

A step is the C++ engine's (``fusedamp::optim::sparse_step``): it checks every table, checks
every table's lookups for inf/NaN before any table is written (under a loss scaler it unscales
them in place, as torch leaves ``.grad``), then runs one ``torch.ops.fusedamp.sparse_*_step_``
per table, each of which returns before writing anything when the flag is set: a step that
finds an inf/NaN changes nothing, without a host synchronisation. Each row's lookups are summed
in FP32, duplicates included, and only the rows looked up are read and written (CPU and CUDA
kernels, the same bits). FP16/BF16 tables keep an FP32 master (state ``"master_param"``) with
``master_weights=True``; the table holds its rounding. ``"split"`` / ``"split8"`` keep a BF16
table's int16 / int8 remainders (``"param_remainder"``) instead; ``"stochastic"`` keeps it
alone, rounded stochastically (``rounding_seed``). This module owns the state, as torch's
optimizers do, and relays it with the group's options.

The state keys are torch's (``"step"``, ``"sum"``, ``"exp_avg"``, ``"exp_avg_sq"``,
``"momentum_buffer"``), so torch.optim.Adagrad / SparseAdam state dicts load into these and
back.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, NamedTuple

import torch

from ._library import _C
from .optim_options import defaults_of

__all__ = ["Adagrad", "SparseAdam", "RowWiseAdagrad", "SparseRowOptimizer", "ALGORITHMS"]


class Algorithm(NamedTuple):
    """One row-wise sparse step: its operator's name (torch.ops.fusedamp, the engine's
    FUSEDAMP_SPARSE_ROW_OPS), its state (key, "table" for a tensor of the table's shape or
    "rows" for one value per row) in the operator's order, and the group options it takes."""
    op: str
    state: tuple
    options: tuple


ALGORITHMS = {
    "sgd": Algorithm("sparse_sgd_step_", (("momentum_buffer", "table"),),
                     ("lr", "momentum", "dampening", "nesterov", "maximize")),
    "adagrad": Algorithm("sparse_adagrad_step_", (("sum", "table"),),
                         ("lr", "lr_decay", "eps", "maximize")),
    "sparse_adam": Algorithm("sparse_adam_step_", (("exp_avg", "table"), ("exp_avg_sq", "table")),
                             ("lr", "betas", "eps", "maximize")),
    "rowwise_adagrad": Algorithm("sparse_rowwise_adagrad_step_", (("sum", "rows"),),
                                 ("lr", "eps", "maximize")),
}

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def check_master_option(group, who):
    """Raises ValueError where the sparse steps do not take the group's master_weights."""
    _C.check_sparse_master_weights(group.get("master_weights", True), who)


def table_options(algorithm, group, p, index):
    """The options of `group` that `algorithm` takes, by torch.optim's names, as numbers, and
    the table's own: its index among the optimizer's parameters and, where it is rounded
    stochastically, its group's seed (a float32 table is its own master in every mode)."""
    stochastic = group.get("master_weights", True) == "stochastic" and p.dtype in _LOW_PRECISION
    options = {"lr": float(group["lr"]), "maximize": bool(group.get("maximize", False)),
               "index": index,
               "rounding_seed": int(group.get("rounding_seed", 0)) if stochastic else None}
    for name in algorithm.options:
        if name == "betas":
            options["betas"] = tuple(float(b) for b in group["betas"])
        elif name not in options:
            options[name] = group[name]
    return options


def engine_step(algorithm, entries, known, make_state, groups, grad_scale, found_inf, who,
                dense=None, telemetry=None, record_as=None):
    """Relays one step of the tables in `entries` ((param, group) pairs, each with a gradient)
    to the C++ engine (fusedamp::optim::sparse_step: every table checked, one inf/NaN flag,
    `dense`'s step seeded with it, then the tables). `known` maps a param to its state dict; a
    table without one gets make_state(p, group), kept in `known` once the engine took the step
    (or skipped it), so that a refused step leaves no state behind. Returns the flag (None where
    nothing was checked)."""
    index = {p: i for i, p in enumerate(p for g in groups for p in g["params"])}
    fresh, states = {}, []
    for p, group in entries:
        state = known.get(p)
        if not state:
            state = fresh[p] = make_state(p, group)
        states.append(state)
    flag = _C.sparse_step(
        algorithm.op, [p for p, _ in entries],
        [s.get("master_param", s.get("param_remainder")) for s in states],
        [[s[key] for key, _ in algorithm.state if key in s] for s in states],
        [s["step"] for s in states],
        [table_options(algorithm, group, p, index[p]) for p, group in entries],
        grad_scale, found_inf, any(group.get("skip_nonfinite", True) for group in groups), who,
        dense, telemetry, record_as)
    known.update(fresh)
    return flag


def new_state(p, group, algorithm, who, initial=0.0):
    """A table's state as the op takes it: FP32 tensors, the step count, the master (the
    engine's, by the group's master_weights)."""
    state = {"step": torch.zeros((), dtype=torch.float32, device=p.device)}
    for key, shape in algorithm.state:
        if key == "momentum_buffer" and group.get("momentum", 0) == 0:
            continue
        size = p.shape if shape == "table" else p.shape[:1]
        state[key] = torch.full(size, initial, dtype=torch.float32, device=p.device)
    master = _C.new_sparse_master(p, group.get("master_weights", True), who)
    if master is not None:
        key, tensor = master
        state[key] = tensor
    return state


def loaded_value(p, key, value):
    """A state entry from a state dict (torch's or ours) in the layout the op takes."""
    if key == "step":
        return torch.tensor(float(value), dtype=torch.float32, device=p.device)
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_sparse:  # torch.optim.SGD's momentum buffer
        value = value.to_dense()
    dtype = value.dtype if key == "param_remainder" else torch.float32  # bits, not a value
    return value.to(device=p.device, dtype=dtype).contiguous().clone()


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

    def _new_state(self, p, group):
        return new_state(p, group, self._algorithm, type(self).__name__,
                         group.get(self._initial_accumulator, 0.0))

    def _state_of(self, p, group):
        state = self.state[p]
        if not state:
            state.update(self._new_state(p, group))
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = [(p, group) for group in self.param_groups for p in group["params"]
                   if p.grad is not None]
        if entries:
            engine_step(self._algorithm, entries, self.state, self._new_state, self.param_groups,
                        getattr(self, "grad_scale", None), getattr(self, "found_inf", None),
                        f"fusedamp.optim.{type(self).__name__}",
                        telemetry=getattr(self, "_fusedamp_telemetry_of", None))
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
                 differentiable=False, fused=None, master_weights=True, rounding_seed=0,
                 skip_nonfinite=True):
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
                 maximize=False, *, master_weights=True, rounding_seed=0,
                 skip_nonfinite=True):
        super().__init__(params, defaults_of(locals()))


class RowWiseAdagrad(SparseRowOptimizer):
    """Adagrad with one FP32 accumulator per row (FBGEMM's EXACT_ROWWISE_ADAGRAD): each step a
    looked-up row's accumulator grows by the mean of its squared gradient, and the row moves by
    -lr / (sqrt(accumulator) + eps) times its gradient. State: 4 bytes per row."""

    _algorithm = ALGORITHMS["rowwise_adagrad"]

    def __init__(self, params: Iterable, lr=1e-2, eps=1e-10, initial_accumulator_value=0.0,
                 *, maximize=False, master_weights=True, rounding_seed=0,
                 skip_nonfinite=True):
        super().__init__(params, defaults_of(locals()))
