"""An optimizer's state in torch.optim's shapes, over the state the C++ engine holds.

torch.optim keeps per-parameter state in ``optimizer.state`` (a defaultdict) and checkpoints
it as ``state_dict()``: per-parameter state by index, param groups packed. fusedamp's state
lives in the engine; this module gives it those shapes in both directions: ``EngineState`` (the
``state`` mapping), ``state_dict`` and ``load_state_dict`` (fusedamp's and torch.optim's
layout), and the conversions between torch's spelling of a state and the engine's.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from .fsdp import check_gatherable
from .optim_options import STORAGE_OPTIONS, check_group

__all__ = ["EngineState", "engine_state", "state_dict", "load_state_dict", "from_torch_state",
           "pack_param_groups"]


class EngineState(defaultdict):
    """``optimizer.state``: each parameter's state as the engine holds it (the tensors
    themselves). Assigning a parameter's entry, as torch.optim's dict takes it (torch's
    ZeroRedundancyOptimizer.load_state_dict loads its local optimizer that way), hands the
    state to the engine, which checks it and converts it to the group's master-weight mode and
    state dtype before anything changes. A copy is a plain dict."""

    def __init__(self, engine):
        super().__init__(dict)
        self._engine = engine

    def __setitem__(self, param, value):
        self._engine.set_param_state(param, from_torch_state(value))
        super().__setitem__(param, self._engine.param_state(param))

    def __missing__(self, param):
        # torch's state is a defaultdict(dict): reading a parameter without state (unused, or
        # before its first step) gives {}. Here that {} is not a state the engine could hold,
        # so it is handed out, not stored; assigning a whole valid state stores it.
        return {}

    def __reduce__(self):
        return defaultdict, (dict,), None, None, iter(self.items())


def engine_state(engine, param_groups):
    """The ``state`` mapping of an optimizer over `engine`: its parameters that have state."""
    out = EngineState(engine)
    for g in param_groups:
        for p in g["params"]:
            s = engine.param_state(p)
            if s:
                dict.__setitem__(out, p, s)
    return out


def state_dict(engine, param_groups):
    """torch.optim's layout (per-parameter state by index, packed param groups), plus the
    engine's skipped-step counter (torch.optim ignores the extra key)."""
    index, groups = pack_param_groups(param_groups)
    for g in groups:
        # By name: torch.distributed.checkpoint takes no torch.dtype values (its consolidated
        # and CPU-offloaded state dicts refuse them); a group given the name takes it back.
        if isinstance(g.get("state_dtype"), torch.dtype):
            g["state_dtype"] = str(g["state_dtype"])
    state = {}
    for g in param_groups:
        for p in g["params"]:
            s = engine.param_state(p)
            if s:
                state[index[id(p)]] = {k: v.clone() for k, v in s.items()}
    check_gatherable(state)
    skipped = engine.skipped_steps()
    return {"state": state, "param_groups": groups,
            "skipped_steps": None if skipped is None else skipped.clone()}


def load_state_dict(engine, engine_cls, param_groups, loaded):
    """Loads fusedamp's or torch.optim's state dict `loaded` (the same kind of optimizer) into
    `engine` and the optimizer's `param_groups` (replaced in place). Everything is checked
    before anything changes; parameters without an entry get no state."""
    groups = loaded["param_groups"]
    if len(groups) != len(param_groups):
        raise ValueError("fusedamp: loaded state dict has a different number of param groups")
    for mine, theirs in zip(param_groups, groups):
        if len(mine["params"]) != len(theirs["params"]):
            raise ValueError("fusedamp: loaded state dict contains a parameter group that "
                             "doesn't match the size of optimizer's group")
    # torch's rule (the checkpoint's hyper-parameters replace the group's) except for how
    # the state is stored: master_weights and state_dtype stay the ones this optimizer was
    # built with (the memory the user chose), and the loaded state is converted to them
    # (docs/master_weights.md).
    kept = ("params",) + STORAGE_OPTIONS
    merged = [dict(mine, **{k: v for k, v in theirs.items() if k not in kept})
              for mine, theirs in zip(param_groups, groups)]
    for group in merged:
        check_group(group)
    engine_cls.validate(merged)
    params = [p for g in param_groups for p in g["params"]]
    ids = [i for g in groups for i in g["params"]]
    entries = [(p, from_torch_state(loaded["state"][i])) for i, p in zip(ids, params)
               if i in loaded["state"]]
    # The engine checks every entry before it replaces anything.
    engine.load_param_states([p for p, _ in entries], [s for _, s in entries])
    param_groups[:] = merged
    engine.sync_options(param_groups)
    if loaded.get("skipped_steps") is not None:
        engine.set_skipped_steps(loaded["skipped_steps"])


def from_torch_state(state):
    """A parameter's state in torch.optim's spelling, in fusedamp's: torch's SGD keeps no step
    count (a momentum buffer exists once a step ran) and may hold a None buffer."""
    state = {k: v for k, v in state.items() if v is not None}
    if "step" not in state and "momentum_buffer" in state:
        state["step"] = torch.ones(())
    return state


def pack_param_groups(param_groups):
    """torch.optim's state_dict layout of param groups: each parameter replaced by its index
    in group order. Returns ({id(param): index}, packed groups)."""
    index, groups = {}, []
    for g in param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = []
        for p in g["params"]:
            index.setdefault(id(p), len(index))
            packed["params"].append(index[id(p)])
        groups.append(packed)
    return index, groups
