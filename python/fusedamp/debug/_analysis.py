"""Reading a watch's record: the producer of the first inf/NaN, per-module summaries, heat maps.
Everything here runs after the fact and may synchronise (one copy of the ring to the host)."""
from __future__ import annotations

import math
import os

import torch

from ._record import KINDS, OUT, PROD, RECV, Stats, headroom_bits, producer

__all__ = ["first_nonfinite", "first_underflow", "report", "history", "plot",
           "write_tensorboard"]


def first_nonfinite(watch, source=False):
    """None, or {"iteration", "phase", "module"} of the earliest retained iteration with a
    non-finite value: forward first, then backward. With source=True, also "source": "module"
    where the named module made it from finite values, "outside" where it came from outside
    every module (the data for the forward, the loss for the backward) and the module is the
    first that got it."""
    for it, row in watch._read():
        for phase in ("forward", "backward"):
            found = producer(row, it, phase, watch.names)
            if found is not None:
                module, made = found
                out = {"iteration": it.index, "phase": phase, "module": watch.names[module]}
                if source:
                    out["source"] = "module" if made else "outside"
                return out
    return None


def _underflow(stats, dtype):
    """Share of a gradient's elements zero or subnormal in its dtype; with `dtype` (narrower
    than the gradient's), 1.0 where even its amax lies below dtype's smallest normal."""
    fraction = stats.underflow_fraction
    if fraction is None:
        return None
    if dtype is not None and stats.amax < torch.finfo(dtype).tiny:
        return 1.0
    return fraction


def first_underflow(watch, threshold=0.9, dtype=None):
    """None, or {"iteration", "phase": "backward", "module"}: the first module in backward order
    whose produced gradient has more than `threshold` of its elements zero or subnormal while
    the gradient it received had not (see _underflow for `dtype`)."""
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"first_underflow: threshold must be in [0, 1), got {threshold!r}")
    for it, row in watch._read():
        for m in it.backward_order:
            made = _underflow(Stats(row, it, m * KINDS + PROD), dtype)
            got = _underflow(Stats(row, it, m * KINDS + RECV), dtype)
            if made is not None and made > threshold and (got is None or got <= threshold):
                return {"iteration": it.index, "phase": "backward", "module": watch.names[m]}
    return None


def _per_iteration(watch, dtype):
    """[(iteration, [(out Stats, produced Stats) per module])] oldest first."""
    rows = []
    for it, row in watch._read():
        rows.append((it, [(Stats(row, it, m * KINDS + OUT), Stats(row, it, m * KINDS + PROD))
                          for m in range(len(watch.names))]))
    return rows


def _headroom(stats, dtype):
    return headroom_bits(stats.amax if stats.measured else None, dtype or stats.dtype)


def report(watch, dtype=None):
    """One dict per module (the model's named_modules() order) over the retained iterations:
    forward_amax / backward_amax (largest finite |output| / |produced gradient|), headroom_bits
    (log2 of the dtype's max over the larger of the two; the dtype measured, or `dtype`),
    underflow_fraction (of the produced gradients, zero or subnormal), nonfinite_iterations."""
    rows = _per_iteration(watch, dtype)
    out = []
    for m, name in enumerate(watch.names):
        fwd = [s[m][0] for _, s in rows if s[m][0].measured]
        bwd = [s[m][1] for _, s in rows if s[m][1].measured]
        forward_amax = max((s.amax for s in fwd), default=None)
        backward_amax = max((s.amax for s in bwd), default=None)
        rooms = [r for r in (_headroom(s, dtype) for s in fwd + bwd) if r is not None]
        numel = sum(s.numel for s in bwd)
        small = sum(s.small for s in bwd)
        out.append({
            "module": name,
            "forward_amax": forward_amax,
            "backward_amax": backward_amax,
            "headroom_bits": min(rooms) if rooms else None,
            "underflow_fraction": small / numel if numel else None,
            "nonfinite_iterations": [it.index for it, s in rows
                                     if s[m][0].nonfinite or s[m][1].nonfinite],
        })
    return out


def history(watch, dtype=None):
    """Per module x iteration lists (None where not measured): forward_headroom,
    backward_headroom (bits; -inf where non-finite), underflow_fraction; plus iterations,
    modules and first_nonfinite."""
    rows = _per_iteration(watch, dtype)

    def room(stats):
        return -math.inf if stats.nonfinite else _headroom(stats, dtype)

    return {
        "modules": list(watch.names),
        "iterations": [it.index for it, _ in rows],
        "forward_headroom": [[room(s[m][0]) for _, s in rows] for m in range(len(watch.names))],
        "backward_headroom": [[room(s[m][1]) for _, s in rows] for m in range(len(watch.names))],
        "underflow_fraction": [[_underflow(s[m][1], dtype) for _, s in rows]
                               for m in range(len(watch.names))],
        "first_nonfinite": first_nonfinite(watch),
    }


def plot(watch, path, dtype=None):
    """A PNG heat map, module x iteration: forward and backward headroom (bits; black where
    non-finite), underflow fraction of the produced gradient; the first non-finite circled."""
    import matplotlib.pyplot as plt

    fig = _figure(history(watch, dtype))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _figure(h):
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np

    names = [n or "(root)" for n in h["modules"]]
    cols = len(h["iterations"])
    fig, axes = plt.subplots(1, 3, figsize=(4 + 1.2 * max(cols, 4), 1.5 + 0.22 * len(names)),
                             sharey=True, squeeze=False)
    panels = (("forward_headroom", "forward headroom (bits)", "viridis"),
              ("backward_headroom", "backward headroom (bits)", "viridis"),
              ("underflow_fraction", "gradient underflow fraction", "magma_r"))
    first = h["first_nonfinite"]
    for ax, (key, title, cmap) in zip(axes[0], panels):
        data = np.array([[np.nan if v is None else v for v in r] for r in h[key]], dtype=float)
        data = data.reshape(len(names), cols)
        bad = np.isneginf(data)
        shown = np.ma.masked_invalid(np.where(bad, np.nan, data))
        colormap = matplotlib.colormaps[cmap].copy()
        colormap.set_bad("lightgrey")
        image = ax.imshow(shown, aspect="auto", cmap=colormap, interpolation="nearest",
                          vmin=0.0 if key == "underflow_fraction" else None,
                          vmax=1.0 if key == "underflow_fraction" else None)
        ys, xs = np.nonzero(bad)
        ax.scatter(xs, ys, marker="s", s=30, color="black", label="non-finite")
        if first is not None and first["iteration"] in h["iterations"] and \
                key.startswith(first["phase"]):
            x = h["iterations"].index(first["iteration"])
            y = h["modules"].index(first["module"])
            ax.scatter([x], [y], s=200, facecolors="none", edgecolors="red", linewidths=2,
                       label="first non-finite")
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(cols))
        ax.set_xticklabels([str(i) for i in h["iterations"]], fontsize=6, rotation=90)
        ax.set_xlabel("iteration")
        fig.colorbar(image, ax=ax, fraction=0.05)
    axes[0][0].set_yticks(range(len(names)))
    axes[0][0].set_yticklabels(names, fontsize=6)
    if first is not None:
        fig.suptitle(f"first non-finite: {first['phase']} of {first['module'] or '(root)'} "
                     f"at iteration {first['iteration']}", fontsize=10, color="red")
    fig.tight_layout()
    return fig


def _describe(first):
    if first is None:
        return "no non-finite value in the retained iterations"
    return (f"iteration {first['iteration']}: {first['phase']} of "
            f"`{first['module'] or '(root)'}` made the first non-finite value")


def write_tensorboard(watch, writer_or_logdir, dtype=None, tag="fusedamp.debug"):
    """Per module, one scalar per retained iteration (global step = iteration):
    {tag}/forward_amax/<module>, backward_amax, forward_headroom_bits, backward_headroom_bits
    (non-finite cells left out) and underflow_fraction; {tag}/first_nonfinite as text; with
    matplotlib and a writer that has add_figure, plot()'s heat map as {tag}/heat_map.
    writer_or_logdir: a torch.utils.tensorboard.SummaryWriter (or any object with its
    add_scalar and add_text), or a log directory to open one in (flushed and closed here)."""
    owned = isinstance(writer_or_logdir, (str, os.PathLike))
    if owned:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("fusedamp.debug write_tensorboard: writing to a log directory "
                              "needs the tensorboard package (pip install tensorboard)") from e
        writer = SummaryWriter(os.fspath(writer_or_logdir))
    else:
        writer = writer_or_logdir
        missing = [m for m in ("add_scalar", "add_text") if not callable(getattr(writer, m, None))]
        if missing:
            raise TypeError(f"fusedamp.debug write_tensorboard: expected a SummaryWriter or a "
                            f"log directory, got {type(writer).__name__} (no {', '.join(missing)})")
    try:
        rows = _per_iteration(watch, dtype)
        h = history(watch, dtype)
        for m, name in enumerate(h["modules"]):
            name = name or "(root)"
            for col, (it, stats) in enumerate(rows):
                out, made = stats[m]
                values = {"forward_amax": out.amax if out.measured else None,
                          "backward_amax": made.amax if made.measured else None,
                          "forward_headroom_bits": h["forward_headroom"][m][col],
                          "backward_headroom_bits": h["backward_headroom"][m][col],
                          "underflow_fraction": h["underflow_fraction"][m][col]}
                for key, value in values.items():
                    if value is not None and math.isfinite(value):
                        writer.add_scalar(f"{tag}/{key}/{name}", value, it.index)
        last = h["iterations"][-1] if h["iterations"] else 0
        first = h["first_nonfinite"]
        writer.add_text(f"{tag}/first_nonfinite", _describe(first),
                        first["iteration"] if first is not None else last)
        if callable(getattr(writer, "add_figure", None)) and h["iterations"]:
            try:
                fig = _figure(h)
            except ImportError:   # no matplotlib: the scalars and the text suffice
                fig = None
            if fig is not None:
                writer.add_figure(f"{tag}/heat_map", fig, last)   # closes the figure
    finally:
        if owned:
            writer.close()
    return writer_or_logdir
