"""Diagnostics that stay on the device until asked for: why a run went wrong.

- ``nonfinite_grads(model)``: which named parameters hold inf/NaN gradients (call it after a
  skipped step, before ``zero_grad``): one fused read-only pass, one synchronisation.
- ``plot(telemetry, path)``: a PNG of a ``scaler.telemetry()`` record (loss, gradient norm, loss
  scale with skipped steps, amax against the dtype's range, underflow fraction); pass
  ``{label: telemetry, ...}`` to overlay runs; ``draw_panel(ax, telemetry, key)`` draws one of
  its panels on an Axes of your own figure. Needs matplotlib.
- ``write_tensorboard(telemetry, writer)``: the same record as TensorBoard scalars, through any
  object with ``add_scalar`` (e.g. ``torch.utils.tensorboard.SummaryWriter``).
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping

import torch

from . import ops

__all__ = ["nonfinite_grads", "plot", "draw_panel", "write_tensorboard", "PANELS"]


class History:
    """Not part of the API: kept only so that fusedamp.GradScaler objects pickled by earlier
    versions, which held one of these as their scale history (``_history``), still unpickle;
    GradScaler.__setstate__ drops it (the telemetry is the record now). Unpickling restores
    an instance's attributes without calling anything of the class, so it needs no body."""


def nonfinite_grads(model_or_named_parameters):
    """Names of the parameters whose gradient holds inf or NaN."""
    named = (model_or_named_parameters.named_parameters()
             if isinstance(model_or_named_parameters, torch.nn.Module)
             else model_or_named_parameters)
    by_device = defaultdict(list)
    for name, p in named:
        if p.grad is not None:
            by_device[p.grad.device].append((name, p.grad))
    bad = []
    for device, items in by_device.items():
        names, grads = zip(*items)
        found = torch.zeros(1, device=device)
        sum_sq = torch.zeros(1, device=device)
        flags = torch.zeros(len(grads), device=device)
        ops.grad_stats_(grads, found, sum_sq, flags)
        bad += [n for n, f in zip(names, flags.tolist()) if f]
    return bad


# Keys of a ``scaler.telemetry()`` record: one value per iteration, oldest first.
_REQUIRED_KEYS = ("scale", "found_inf", "skipped", "grad_norm", "amax", "underflow_fraction")
_PER_ITERATION_KEYS = ("step",) + _REQUIRED_KEYS + ("subnormal_fraction", "first_nonfinite")
_FP16_MAX = 65504.0
# Run colours leave out the tab10 red ("C3"), which marks skipped steps.
_RUN_COLORS = ("C0", "C1", "C2", "C4", "C5", "C6", "C7", "C8", "C9")


def _checked_telemetry(telemetry, what="telemetry"):
    """``telemetry`` with its per-iteration values as lists, after checking keys and lengths."""
    if not isinstance(telemetry, Mapping):
        raise ValueError(f"{what} must be a dict of per-iteration lists (scaler.telemetry()), "
                         f"got {type(telemetry).__name__}")
    missing = [key for key in _REQUIRED_KEYS if key not in telemetry]
    if missing:
        raise ValueError(f"{what} is missing required key(s) {missing}; "
                         f"expected the dict returned by scaler.telemetry()")
    run = {}
    for key in _PER_ITERATION_KEYS:
        if key in telemetry:
            values = telemetry[key]
            if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
                raise ValueError(f"{what}[{key!r}] must be a list or tuple, "
                                 f"got {type(values).__name__}")
            run[key] = list(values)
    lengths = {key: len(values) for key, values in run.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{what}: per-iteration lists differ in length: {lengths}")
    for key, default in (("dtype_max", _FP16_MAX), ("amax_target", None)):
        value = telemetry.get(key, default)
        try:
            run[key] = None if value is None else float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{what}[{key!r}] must be a single number, got {value!r}") from None
    return run


def _checked_loss(loss, num_iterations, what):
    if isinstance(loss, (str, bytes, Mapping)) or not hasattr(loss, "__len__"):
        raise ValueError(f"{what} must be a list of floats, got {type(loss).__name__}")
    if len(loss) > num_iterations:
        raise ValueError(f"{what} has {len(loss)} values but the telemetry has only "
                         f"{num_iterations} iterations")
    return list(loss)


def _runs_and_losses(telemetry, loss):
    """({label: run}, {label: loss list}); the label is None for a single, unlabelled run."""
    is_overlay = isinstance(telemetry, Mapping) and any(
        isinstance(value, Mapping) for value in telemetry.values())
    if not is_overlay:
        run = _checked_telemetry(telemetry)
        losses = {} if loss is None else {None: _checked_loss(loss, len(run["scale"]), "loss")}
        return {None: run}, losses
    if not all(isinstance(value, Mapping) for value in telemetry.values()):
        raise ValueError("telemetry mixes runs ({label: telemetry}) with per-iteration lists")
    runs = {label: _checked_telemetry(run, f"telemetry[{label!r}]")
            for label, run in telemetry.items()}
    if loss is None:
        return runs, {}
    if not isinstance(loss, Mapping):
        raise ValueError("with several runs, loss must be a dict {label: list of floats}")
    unknown = [label for label in loss if label not in runs]
    if unknown:
        raise ValueError(f"loss has labels {unknown} that are not runs in telemetry")
    return runs, {label: _checked_loss(values, len(runs[label]["scale"]), f"loss[{label!r}]")
                  for label, values in loss.items()}


def _as_array(values, positive=False):
    """Floats with None, non-finite and (for log axes) non-positive values as NaN gaps."""
    import numpy as np

    array = np.asarray(values, dtype=float)
    keep = np.isfinite(array) & ((array > 0) if positive else True)
    return np.where(keep, array, np.nan)


def _is_positive_number(value):
    return value is not None and math.isfinite(value) and value > 0


_LOG_BASE = {"grad_norm": 10, "scale": 2, "amax": 10}
_YLABEL = {"loss": "loss", "grad_norm": "grad norm", "scale": "loss scale",
           "amax": "amax (scaled grads)", "underflow_fraction": "underflow fraction"}
PANELS = tuple(_YLABEL)


def _draw(ax, runs, losses, key):
    """One panel (`key` of PANELS) of every run on a matplotlib Axes."""
    import numpy as np

    largest_underflow = 0.0
    dtype_maxes = set()
    skips_labelled = False
    for index, (label, run) in enumerate(runs.items()):
        color = _RUN_COLORS[index % len(_RUN_COLORS)]
        name = None if label is None else str(label)
        x = np.asarray(run.get("step") or range(len(run["scale"])), dtype=float)
        if key == "loss":
            if losses.get(label):
                ax.plot(x[:len(losses[label])], _as_array(losses[label]), color=color,
                        label=name)
        elif key == "scale":
            scale = _as_array(run["scale"], positive=True)
            ax.plot(x, scale, color=color, label=name, drawstyle="steps-post")
            skipped = np.asarray(run["skipped"], dtype=bool)
            if skipped.any():
                ax.plot(x[skipped], scale[skipped], "x", color="red", markersize=7,
                        label="_nolegend_" if skips_labelled else "skipped step")
                skips_labelled = True
        elif key == "underflow_fraction":
            underflow = _as_array(run["underflow_fraction"])
            ax.plot(x, underflow, color=color, label=name)
            if run.get("subnormal_fraction"):  # the part that is certainly precision lost
                ax.plot(x, _as_array(run["subnormal_fraction"]), color=color, linestyle=":",
                        label="subnormal" + (f" ({name})" if name else ""))
            if np.isfinite(underflow).any():
                largest_underflow = max(largest_underflow, float(np.nanmax(underflow)))
        else:
            ax.plot(x, _as_array(run[key], positive=True), color=color, label=name)
            if key == "amax":
                if _is_positive_number(run["amax_target"]):
                    ax.axhline(run["amax_target"], color=color, linestyle="--",
                               label="amax target" + (f" ({name})" if name else ""))
                dtype_maxes.add(run["dtype_max"])
    for dtype_max in sorted(filter(_is_positive_number, dtype_maxes)):
        ax.axhline(dtype_max, color="black", linestyle=":", label=f"dtype max ({dtype_max:g})")
    ax.set_ylabel(_YLABEL[key])
    if key in _LOG_BASE:
        # A log axis without one positive value makes matplotlib raise on drawing.
        if any(np.isfinite(line.get_ydata()).any() for line in ax.get_lines()):
            ax.set_yscale("log", base=_LOG_BASE[key])
        else:
            ax.set_yticks([])
            ax.text(0.5, 0.5, "no finite positive values", transform=ax.transAxes,
                    ha="center", va="center", color="gray")
    if key == "underflow_fraction":
        # Zoom in on small fractions (linear stays readable) but never past the 0..1 range.
        ax.set_ylim(0, min(1.0, 1.1 * largest_underflow) if largest_underflow else 1.0)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize="small")


def draw_panel(ax, telemetry, key, *, loss=None):
    """Draw one panel of ``plot`` (``key``: one of PANELS) on a matplotlib Axes, for a
    ``scaler.telemetry()`` record or ``{label: record}`` (overlaid): for figures of your own."""
    if key not in PANELS:
        raise ValueError(f"key must be one of {PANELS}, got {key!r}")
    runs, losses = _runs_and_losses(telemetry, loss)
    _draw(ax, runs, losses, key)


def plot(telemetry, path, *, loss=None, title=None):
    """Write a PNG of a ``scaler.telemetry()`` record to ``path``; return ``path``.

    Panels share the iteration axis: loss (if given), gradient norm, loss scale (skipped steps
    marked red), amax of the scaled gradients against ``dtype_max`` and ``amax_target``, and the
    underflow fraction. ``telemetry`` may instead be ``{label: telemetry}`` to overlay runs; then
    ``loss``, if given, is ``{label: list}``. Raises ValueError, writing nothing, on bad input.
    """
    runs, losses = _runs_and_losses(telemetry, loss)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("fusedamp.diagnostics.plot needs matplotlib: "
                          "pip install matplotlib") from e

    if all(len(run["scale"]) == 0 for run in runs.values()):
        fig = Figure(figsize=(8, 3))
        fig.text(0.5, 0.5, "no telemetry", ha="center", va="center", fontsize=16)
    else:
        keys = [k for k in PANELS if k != "loss" or any(len(v) for v in losses.values())]
        fig = Figure(figsize=(10, 1.2 + 2.2 * len(keys)), layout="constrained")
        axes = fig.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0]
        for ax, key in zip(axes, keys):
            _draw(ax, runs, losses, key)
        axes[-1].set_xlabel("iteration")
    fig.suptitle(title or "fusedamp telemetry")
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", dpi=100)
    return path


def write_tensorboard(telemetry, writer, *, start=0, prefix="fusedamp"):
    """Log a ``scaler.telemetry()`` record as ``{prefix}/{key}`` scalars; return how many.

    ``writer`` is anything with ``add_scalar(tag, value, step)``. The step is
    ``telemetry["step"][i]`` when present, else ``start + i``. NaN values are skipped;
    ``found_inf`` and ``skipped`` are written as 0/1.
    """
    run = _checked_telemetry(telemetry)
    if not callable(getattr(writer, "add_scalar", None)):
        raise TypeError(f"writer must have an add_scalar method, got {type(writer).__name__}")
    steps = run.get("step") or range(start, start + len(run["scale"]))
    written = 0
    for i, step in enumerate(steps):
        for key in ("scale", "grad_norm", "amax", "underflow_fraction", "subnormal_fraction",
                    "found_inf", "skipped"):
            if key not in run:  # subnormal_fraction: optional in a record made by hand
                continue
            value = run[key][i]
            if key in ("found_inf", "skipped"):
                value = int(bool(value))
            elif value is None or math.isnan(float(value)):
                continue
            else:
                value = float(value)
            writer.add_scalar(f"{prefix}/{key}", value, int(step))
            written += 1
    return written
