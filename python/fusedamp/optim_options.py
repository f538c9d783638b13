"""The options of fusedamp's optimizers: the table of those torch's optimizers do not have, and
what the Python side checks and reads of a param group's options.

The names and defaults of every optimizer's options are the C++ engine's option tables
(csrc/engine/shared_options.h, then each algorithm's rows), which ``engine_arguments`` reads;
the values are checked by the engine (ValueError), which reads them from the param groups by
these names. ``EXTRA_OPTIONS`` is the engine's options that torch's optimizers do not take,
each with its meaning (written here, for Python's users): the documentation of fusedamp.optim
and of each optimizer class is written from it. The constructors' signatures stay written out
in optim.py, so that editors and type checkers, which read the source, see real keyword
arguments; the tests hold each of them to its engine kind's table.
"""
from __future__ import annotations

import textwrap
import warnings
from typing import NamedTuple

import torch

from ._library import _C

__all__ = ["Option", "EXTRA_OPTIONS", "STORAGE_OPTIONS", "TORCH_ONLY_ARGUMENTS", "engine_kinds",
           "engine_arguments", "extra_options_doc", "check_group", "defaults_of", "dtype_named",
           "names_int8_state"]


class Option(NamedTuple):
    name: str
    default: object
    doc: str


def engine_kinds():
    """The engine's optimizer kinds: fusedamp._C's classes over its Optimizer."""
    return [kind for kind in vars(_C).values()
            if isinstance(kind, type) and issubclass(kind, _C.Optimizer)
            and kind is not _C.Optimizer]


def engine_arguments(kind):
    """The options of engine kind `kind` as constructor arguments, in the engine's order: name ->
    the default of the kind, beta1 and beta2 as torch's ``betas`` pair (what param groups hold;
    the engine's sync_options splits it)."""
    table = {name: default for name, default, _ in kind.option_table()}
    if "beta1" in table:
        betas = (table.pop("beta1"), table.pop("beta2"))
        table["betas"] = betas
    return table


# What each engine option torch's optimizers lack means, in the words of Python's spellings.
_MEANINGS = {
    "master_weights": """\
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
          False  none: round to nearest (updates below half an ulp are lost)""",
    "state_dtype": """\
        the moments / momentum buffers: float32, bfloat16, or torch.int8 (or "int8";
        Adam/AdamW without amsgrad, SGD): 8-bit codes in blocks of 32 elements with FP32
        block scales (2.25 bytes/param for Adam's two moments, 1.125 for SGD's buffer); on
        FSDP2 every shard of such a parameter must hold whole blocks of it""",
    "rounding_seed": """\
        the seed of master_weights="stochastic\"""",
    "max_grad_norm": """\
        fused global-norm clipping (clip_grad_norm_'s formula); None: no clipping""",
    "skip_nonfinite": """\
        skip the step on inf/NaN even without a loss scaler""",
    "adopt_param_edits": """\
        the model's weights are the truth: a weight that is no longer its master's rounding
        (a loaded snapshot, a clamp, a pruning mask) is taken into the master before the
        update (+2 bytes/param read at FP16)""",
    "write_back_grads": """\
        after a scaled or clipped step ``.grad`` holds the gradient the update used,
        unscaled and clipped, as torch's fused optimizers leave it (+2 bytes/param written
        at FP16; False keeps the scaled gradients)""",
}


def _shared_engine_options():
    """The options every engine kind has, with their defaults."""
    tables = [engine_arguments(kind) for kind in engine_kinds()]
    return {name: default for name, default in tables[0].items()
            if all(name in table for table in tables)}


# In the order of the constructors' signatures and documentation; a name the engine lacks
# fails here, at import.
_SHARED_DEFAULTS = _shared_engine_options()
EXTRA_OPTIONS = tuple(Option(name, _SHARED_DEFAULTS[name], doc)
                      for name, doc in _MEANINGS.items())

# torch.optim's arguments that fusedamp's constructors take and the engine has no option for:
# its step is always one fused, capturable pass (check_group).
TORCH_ONLY_ARGUMENTS = ("foreach", "fused", "capturable", "differentiable")

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
