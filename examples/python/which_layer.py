"""The demo's "which layer" run: an FP16 run that goes NaN, and fusedamp.debug.watch naming the
module that produced the first non-finite value.

An MLP on scikit-learn's digits, converted to FP16 by fusedamp.initialize (FP32 masters, its
loss scaler), trained with SGD at a learning rate far too high (1.5, momentum 0.9): the
weights grow until one layer's output passes FP16's largest value (65504). The loss turns NaN,
and from then on the scaler skips every step: all it knows is that the gradients are not finite.
The watch, attached for the whole run, names the module, the phase and the iteration where the
first inf appeared, and its history shows that layer's headroom shrinking before.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict

STEPS = 30
LR = 1.5


def digits_mlp():
    from torch import nn

    return nn.Sequential(OrderedDict([
        ("flatten", nn.Flatten()),
        ("fc1", nn.Linear(64, 256)), ("act1", nn.ReLU()),
        ("fc2", nn.Linear(256, 256)), ("act2", nn.ReLU()),
        ("fc3", nn.Linear(256, 256)), ("act3", nn.ReLU()),
        ("classifier", nn.Linear(256, 10))]))


def which_layer_run(steps=STEPS, lr=LR, seed=0):
    """The run's losses, skipped steps, the watch's first_nonfinite and its forward headroom
    history (FP16 bits, per module and iteration), and the seconds it took."""
    import torch

    start = time.perf_counter()
    # Each op here is tiny (a 256-wide MLP, batch 64): a second OpenMP thread only waits, and
    # on a busy 2-core machine it made the run 12x slower (5.9 s against 0.5 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(steps, lr, seed, start)
    finally:
        torch.set_num_threads(threads)


def _train(steps, lr, seed, start):
    import torch
    import torch.nn.functional as F

    import fusedamp
    from amp_models import digits_data

    (x, y), _ = digits_data("cpu")
    torch.manual_seed(seed)
    model = digits_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model, opt, scaler = fusedamp.initialize(model, opt, dtype=torch.float16, init_scale=256.0)
    batches = torch.Generator().manual_seed(seed)
    losses = []
    with fusedamp.debug.watch(model) as watch:
        for _ in range(steps):
            i = torch.randint(0, len(x), (64,), generator=batches)
            loss = F.cross_entropy(model(x[i]).float(), y[i])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.detach())   # read after the run: no sync inside it
        history = watch.history(dtype=torch.float16)
        first = watch.first_nonfinite()
    return {"loss": [float(v) for v in losses],
            "skipped": [bool(s) for s in scaler.telemetry()["skipped"]],
            "first_nonfinite": first,
            "modules": history["modules"], "iterations": history["iterations"],
            "forward_headroom": history["forward_headroom"],
            "lr": lr, "seconds": time.perf_counter() - start}


def describe(run):
    """What the demo prints about the run."""
    loss = run["loss"]
    bad = next((k for k, v in enumerate(loss) if not math.isfinite(v)), None)
    lines = [f"Which layer (FP16 MLP on digits, SGD lr {run['lr']:g}, {len(loss)} steps, "
             f"{run['seconds']:.1f} s):",
             f"  loss {loss[0]:.2f} -> {loss[-1]:.4g}"
             + (f", first non-finite at step {bad}" if bad is not None else "")
             + f"; the loss scaler skipped {sum(run['skipped'])} of {len(loss)} steps"]
    first = run["first_nonfinite"]
    if first is None:
        lines.append("  watch.first_nonfinite(): None (no inf/NaN in this run)")
        return "\n".join(lines)
    m = run["modules"].index(first["module"])
    col = run["iterations"].index(first["iteration"])
    before = run["forward_headroom"][m][col - 1] if col > 0 else None
    lines.append(f"  watch.first_nonfinite(): {first}: the {first['phase']} of "
                 f"`{first['module']}` made it"
                 + (f" (its FP16 headroom one step before: {before:.1f} bits)"
                    if before is not None and math.isfinite(before) else ""))
    return "\n".join(lines)


def draw(ax_map, ax_loss, run):
    """The forward headroom heat map (module x iteration; black: non-finite; the first one
    circled) and the loss curve with the scaler's skipped steps."""
    import matplotlib
    import numpy as np

    names = [n or "(root)" for n in run["modules"]]
    data = np.array([[np.nan if v is None else v for v in row]
                     for row in run["forward_headroom"]], dtype=float)
    cmap = matplotlib.colormaps["viridis"].copy()
    cmap.set_bad("lightgrey")
    image = ax_map.imshow(np.ma.masked_invalid(np.where(np.isneginf(data), np.nan, data)),
                          aspect="auto", cmap=cmap, interpolation="nearest")
    ys, xs = np.nonzero(np.isneginf(data))
    ax_map.scatter(xs, ys, marker="s", s=25, color="black", label="non-finite")
    first = run["first_nonfinite"]
    if first is not None:
        ax_map.scatter([run["iterations"].index(first["iteration"])],
                       [run["modules"].index(first["module"])], s=220, facecolors="none",
                       edgecolors="red", linewidths=2,
                       label=f"first: {first['phase']} of {first['module']}")
    ax_map.set_yticks(range(len(names)), names, fontsize=8)
    ax_map.set_xlabel("iteration")
    ax_map.set_title("which layer: forward headroom in FP16 (bits) per module, "
                     "fusedamp.debug.watch")
    ax_map.legend(fontsize="small", loc="lower left")
    ax_map.figure.colorbar(image, ax=ax_map, fraction=0.03)
    steps = range(len(run["loss"]))
    ax_loss.plot(steps, [v if math.isfinite(v) else np.nan for v in run["loss"]], label="loss")
    skipped = [k for k, s in enumerate(run["skipped"]) if s]
    ax_loss.scatter(skipped, [1.0] * len(skipped), marker="x", color="red",
                    label="step skipped by the scaler")
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_title(f"which layer: FP16 training loss, lr {run['lr']:g} (NaN not drawn)")
    ax_loss.grid(True, alpha=0.3)
    ax_loss.legend(fontsize="small")
