"""The options of fusedamp's optimizers: the table of those torch's optimizers do not have, and
what the Python side checks and reads of a param group's options.

``EXTRA_OPTIONS`` is the one list of fusedamp's own keyword arguments (name, default, meaning):
the documentation of fusedamp.optim and of each optimizer class is written from it, and the
tests hold every optimizer's signature to it. The signatures themselves stay written out in
optim.py, so that editors and type checkers, which read the source, see real keyword
arguments. The values are checked by the C++ engine (ValueError), which reads them from the
param groups by these names.
"""
from __future__ import annotations

import textwrap
import warnings
from typing import NamedTuple

import torch

__all__ = ["Option", "EXTRA_OPTIONS", "STORAGE_OPTIONS", "extra_options_doc", "check_group",
           "defaults_of", "dtype_named", "names_int8_state"]


class Option(NamedTuple):
    name: str
    default: object
    doc: str


EXTRA_OPTIONS = (
    Option("master_weights", True, """\
        how FP16/BF16 weights keep the bits rounding drops:
          True  an FP32 master copy (+4 bytes/param)
          "split"  BF16 only: an int16 remainder (+2 bytes/param); weight + remainder is
                 exactly the FP32 master of True (the weight differs from True's only where
                 the master lies exactly halfway between two BF16 values)
          "split8"  BF16 only: an int8 remainder (+1 byte/param); weight + remainder is a
                 24-bit master (16 significant bits): each step's FP32 result rounded to
                 nearest 24 bits
          "kahan"  a compensation buffer of the weight's dtype (+2 bytes/param)
          "stochastic"  BF16 only: no state; the weight is rounded stochastically,
                 reproducibly from ``rounding_seed`` (and the step, the element)
          False  none: round to nearest (updates below half an ulp are lost)"""),
    Option("state_dtype", torch.float32, """\
        the moments / momentum buffers: float32, bfloat16, or torch.int8 (or "int8";
        Adam/AdamW without amsgrad, SGD): 8-bit codes in blocks of 32 elements with FP32
        block scales (2.25 bytes/param for Adam's two moments, 1.125 for SGD's buffer); on
        FSDP2 every shard of such a parameter must hold whole blocks of it"""),
    Option("rounding_seed", 0, """\
        the seed of master_weights="stochastic\""""),
    Option("max_grad_norm", None, """\
        fused global-norm clipping (clip_grad_norm_'s formula); None: no clipping"""),
    Option("skip_nonfinite", True, """\
        skip the step on inf/NaN even without a loss scaler"""),
    Option("adopt_param_edits", True, """\
        the model's weights are the truth: a weight that is no longer its master's rounding
        (a loaded snapshot, a clamp, a pruning mask) is taken into the master before the
        update (+2 bytes/param read at FP16)"""),
    Option("write_back_grads", True, """\
        after a scaled or clipped step ``.grad`` holds the gradient the update used,
        unscaled and clipped, as torch's fused optimizers leave it (+2 bytes/param written
        at FP16; False keeps the scaled gradients)"""),
)

# Group options that say how the state is stored, not what the algorithm does.
STORAGE_OPTIONS = ("master_weights", "state_dtype")


def extra_options_doc(indent="") -> str:
    """EXTRA_OPTIONS as the text of a docstring: each keyword with its default, then what it
    does."""
    lines = ["Extra keyword arguments over torch's (each also a param-group option):"]
    for option in EXTRA_OPTIONS:
        lines.append(f"  {option.name}={option.default!r}")
        lines.append(textwrap.indent(textwrap.dedent(option.doc), "      "))
    return textwrap.indent("\n".join(lines), indent)


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
