"""fusedamp.optim.SGD over a model with embedding tables that have sparse gradients: the
parameters with dense gradients step in the C++ engine as always, the tables through the
row-wise sparse op (sparse_optim.py), and one inf/NaN flag decides for both.

The C++ engine keeps a step all-or-nothing (fusedamp::optim::sparse_step): every table
gradient is checked (and, under a loss scaler, unscaled) first, its finding seeds the engine's
step over the dense parameters, which adds its own, and the tables' ops read the combined flag.
The tables' state (torch's keys: ``"momentum_buffer"``, dense FP32, and ``"step"``;
``"master_param"`` for FP16/BF16 tables) lives here, beside the engine's, and appears in
``state`` and ``state_dict`` under the same indices.
"""
from __future__ import annotations

import torch

from .sparse_optim import (ALGORITHMS, check_master_option, engine_step, loaded_value,
                           new_state)

__all__ = ["has_sparse_grads", "step", "step_without_tables", "table_states",
           "check_table_group", "with_table_states", "without_table_states"]

_WHO = "fusedamp.optim.SGD"


def has_sparse_grads(groups):
    return any(p.grad is not None and p.grad.is_sparse for g in groups for p in g["params"])


def table_states(optimizer):
    """The state of the params stepped as sparse tables, by param."""
    return optimizer.__dict__.setdefault("_table_state", {})


def check_table_group(group):
    """What a group holding a sparse table must not ask for (torch refuses weight decay with
    sparse gradients; the other storage modes have no row-wise kernels)."""
    if group.get("weight_decay", 0) != 0:
        raise RuntimeError(f"{_WHO}: weight_decay is not supported with sparse gradients "
                           "(torch.optim.SGD cannot add a dense decay to them either)")
    check_master_option(group, _WHO)
    if group.get("state_dtype", torch.float32) not in (torch.float32, "torch.float32"):
        raise RuntimeError(f"{_WHO}: a sparse table's momentum is float32 "
                           f"(state_dtype={group['state_dtype']!r})")


def step(optimizer, record_as, grad_scale, found_inf, telemetry):
    """One step of `optimizer` (a fusedamp.optim.SGD) whose params include sparse tables: the
    engine checks the tables, seeds its step over the dense parameters with their inf/NaN flag,
    then steps the tables with the combined one."""
    engine = optimizer._engine
    groups = optimizer.param_groups
    entries = [(p, g) for g in groups for p in g["params"]
               if p.grad is not None and p.grad.is_sparse]
    if entries and any(g.get("max_grad_norm") is not None for g in groups):
        # The fused norm is the engine's, over the dense gradients: the tables would step
        # unclipped and leave the norm. torch's clip_grad_norm_ refuses sparse gradients too.
        raise RuntimeError(f"{_WHO}: max_grad_norm is not supported with sparse gradients (the "
                           "fused norm covers dense gradients only); clip without the tables or "
                           "give them an optimizer of their own")
    for _, group in entries:
        check_table_group(group)
    step_without_tables(optimizer)
    if any(p.grad is not None and not p.grad.is_sparse for g in groups for p in g["params"]):
        engine.sync_changed_options(groups, optimizer._synced_options)
    engine_step(ALGORITHMS["sgd"], entries, table_states(optimizer),
                lambda p, group: new_state(p, group, ALGORITHMS["sgd"], _WHO), groups, grad_scale,
                found_inf, _WHO, engine, telemetry, record_as)


def step_without_tables(optimizer):
    """Refuses a step in which a table stepped as sparse has a dense gradient."""
    known = table_states(optimizer)
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p in known and p.grad is not None and not p.grad.is_sparse:
                raise RuntimeError(f"{_WHO}: a parameter of shape {tuple(p.shape)} had a "
                                   "sparse gradient in an earlier step and has a dense one now")


# A table's entry in a state dict carries this key, so that loading gives it back to the
# table path (torch.optim.SGD ignores it).
_TABLE_KEY = "sparse_table"


def _params(optimizer):
    return [p for g in optimizer.param_groups for p in g["params"]]


def with_table_states(optimizer, state_dict):
    known = table_states(optimizer)
    for i, p in enumerate(_params(optimizer)):
        if p in known:
            state_dict["state"][i] = dict(known[p], **{_TABLE_KEY: True})
    return state_dict


def without_table_states(optimizer, state_dict):
    """(state_dict less the tables' entries, the tables' state by param): the entries are ours
    or torch's sparse momentum buffers, converted (and checked) here, before anything loads."""
    params = _params(optimizer)
    tables, rest = {}, {}
    for i, entry in state_dict["state"].items():
        buf = entry.get("momentum_buffer")
        if entry.get(_TABLE_KEY) or (isinstance(buf, torch.Tensor) and buf.is_sparse):
            p = params[i]
            state = {k: loaded_value(p, k, v) for k, v in entry.items() if k != _TABLE_KEY}
            state.setdefault("step", torch.ones((), device=p.device))  # torch's: one step
            if "momentum_buffer" in state and state["momentum_buffer"].shape != p.shape:
                raise ValueError(f"{_WHO}: a table's momentum_buffer has shape "
                                 f"{tuple(state['momentum_buffer'].shape)}, the table "
                                 f"{tuple(p.shape)}")
            tables[p] = state
        else:
            rest[i] = entry
    return dict(state_dict, state=rest), tables
