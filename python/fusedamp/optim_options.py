"""What the Python side checks and reads of an optimizer's param-group options (the values
themselves are checked by the C++ engine, which reads them from the groups by name).
"""
from __future__ import annotations

import warnings

import torch

__all__ = ["STORAGE_OPTIONS", "check_group", "defaults_of", "dtype_named", "names_int8_state"]


# Group options that say how the state is stored, not what the algorithm does.
STORAGE_OPTIONS = ("master_weights", "state_dtype")


def check_group(group):
    """What only the Python side can see of a param group: torch.optim arguments fusedamp does
    not do, or accepts without them meaning anything (its step is always one fused,
    capturable pass). A state_dtype named by a string (as a state dict spells it) becomes the
    dtype."""
    if group.get("differentiable", False):
        raise ValueError("fusedamp: differentiable=True is not supported")
    if isinstance(group.get("state_dtype"), str):
        group["state_dtype"] = dtype_named(group["state_dtype"])
    for name in ("foreach", "fused", "capturable"):
        if group.get(name):
            warnings.warn(f"fusedamp: {name}={group[name]!r} has no effect: fusedamp's step is "
                          "always one fused pass that never syncs with the host",
                          stacklevel=5)


def defaults_of(arguments):
    """A constructor's keyword arguments (its ``locals()``) as the param-group defaults
    (torch.optim's layout)."""
    return {k: v for k, v in arguments.items() if k not in ("self", "params", "__class__")}


def names_int8_state(value):
    """Whether a state_dtype option -- a dtype, or its name as a state dict spells it -- is
    torch.int8 (the 8-bit moments)."""
    if isinstance(value, str):
        try:
            value = dtype_named(value)
        except ValueError:
            return False
    return value is torch.int8


def dtype_named(name):
    """torch.bfloat16 for "torch.bfloat16" (or "bfloat16"); an unknown name is refused."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"fusedamp: state_dtype {name!r} names no torch dtype")
    return dtype
