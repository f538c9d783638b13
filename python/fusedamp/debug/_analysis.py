"""Reading a watch's record: the producer of the first inf/NaN, per-module summaries, heat maps.
Everything here runs after the fact and may synchronise (one copy of the ring to the host)."""
from __future__ import annotations

import math

import torch

from ._record import KINDS, OUT, PROD, RECV, Stats, headroom_bits, producer

__all__ = ["first_nonfinite", "first_underflow", "report", "history", "plot"]


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
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np

    h = history(watch, dtype)
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
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
