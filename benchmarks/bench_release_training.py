#!/usr/bin/env python3
"""Training with gradient release (fusedamp.release_gradients) against the normal step: the
loss curves, and what the per-parameter skip does in a run that overflows.

Character-level GPT-2 models (transformers, built from a config) trained on this repository's
documentation (docs/*.md and README.md, the last 10 % held out), every mode from the same
initial weights and batches, 3 seeds:

  loss      FP16 (fusedamp.convert_module: norms FP32) with a fusedamp.GradScaler, and BF16
            without one; fusedamp AdamW, normal mode and release mode.
  overflow  FP16 with a scaler that grows every 10 clean iterations (so it overflows again and
            again): fusedamp normal mode (an overflow skips the whole step), release mode (it
            skips the overflowing parameters only) and torch.amp (FP32 weights, autocast FP16,
            torch.amp.GradScaler with growth_interval 10, torch.optim.AdamW). Counted: the
            overflowing iterations and, in release mode, how many parameters each skipped.

    PYTHONPATH=python python3 benchmarks/bench_release_training.py [--steps N] [--seeds 3]
"""
from __future__ import annotations

import statistics
import time

import torch

import harness
from harness import REPO
from harness import results as res
from harness.machine import machine_info, working_tree
from bench_release import header, write

harness.use_paths("python")
import fusedamp  # noqa: E402

# (shape, steps, with the overflow experiment): a step of the larger model takes 4x as long.
MODELS = {"char GPT (2 layers, width 128)": (dict(n_embd=128, n_layer=2, n_head=4), 300, True),
          "small GPT-2 (4 layers, width 256)": (dict(n_embd=256, n_layer=4, n_head=4), 100,
                                                False)}
CONTEXT, BATCH = 64, 16


def corpus():
    text = "".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    text += (REPO / "README.md").read_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    cut = int(len(data) * 0.9)
    return data[:cut], data[cut:], len(chars)


def batches(data, n, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        start = torch.randint(0, len(data) - CONTEXT - 1, (BATCH,), generator=gen)
        x = torch.stack([data[s:s + CONTEXT + 1] for s in start.tolist()])
        yield x[:, :-1], x[:, 1:]


def make_model(shape, vocab, seed):
    import transformers
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab, n_positions=CONTEXT, **shape))


def loss_of(model, x, y):
    logits = model(input_ids=x, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def run(mode, dtype, shape, data, seed, steps, growth_interval=2000):
    """Trains one run; returns its losses, held-out loss and overflow counts."""
    train, held, vocab = data
    model = make_model(shape, vocab, seed)
    lr = 2e-3
    if mode == "torch.amp":
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        scaler = torch.amp.GradScaler("cpu", growth_interval=growth_interval)
    else:
        fusedamp.convert_module(model, dtype)
        opt = fusedamp.optim.AdamW(model.parameters(), lr=lr)
        scaler = fusedamp.GradScaler("cpu", growth_interval=growth_interval) \
            if dtype == torch.float16 else None
    handle = fusedamp.release_gradients(model, opt, scaler) if mode == "release" else None
    losses, overflows = [], 0
    t0 = time.perf_counter()
    for x, y in batches(train, steps, seed):
        if handle is None:
            opt.zero_grad()
        if mode == "torch.amp":
            with torch.autocast("cpu", dtype=dtype):
                loss = loss_of(model, x, y)
        else:
            loss = loss_of(model, x, y)
        (scaler.scale(loss) if scaler else loss).backward()
        if handle is None:
            scaler.step(opt) if scaler else opt.step()
        if scaler:
            before = scaler.get_scale() if mode == "torch.amp" else None
            scaler.update()
            if mode == "torch.amp":
                overflows += scaler.get_scale() < before
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    out = {"mode": mode, "seed": seed, "losses": losses, "seconds": seconds,
           "n_params": sum(1 for p in model.parameters() if p.requires_grad)}
    if isinstance(scaler, fusedamp.GradScaler):
        found = scaler.telemetry()["found_inf"]
        out["overflows"] = sum(1 for f in found if f > 0)
        if mode == "release":  # the scaler's flag counts the parameters skipped
            out["skipped_params"] = [int(f) for f in found if f > 0]
    elif mode == "torch.amp":
        out["overflows"] = int(overflows)
    if handle is not None:
        handle.remove()
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=mode == "torch.amp"):
        out["held_out"] = statistics.mean(float(loss_of(model, x, y))
                                          for x, y in batches(held, 8, 1234))
    out["final_train"] = statistics.mean(losses[-30:])
    return out


def mean_sd(values):
    values = list(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {sd:.4f}"


def main():
    ap = res.parser(__doc__)
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: the "
                    "model's, 300 or 100)")
    ap.add_argument("--seeds", type=int, default=3)
    res.add_threads(ap)
    res.add_output(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = corpus()
    doc = {"machine": machine_info("cpu"), "tree": working_tree(), "args": res.recorded(args),
           "loss": [], "overflow": []}
    loss_rows, over_rows = [], []
    for name, (shape, steps, overflow) in MODELS.items():
        steps = args.steps or steps
        for dtype in (torch.float16, torch.bfloat16):
            runs = {m: [run(m, dtype, shape, data, s, steps) for s in range(args.seeds)]
                    for m in ("normal", "release")}
            doc["loss"].append({"model": name, "dtype": str(dtype), "steps": steps,
                                "runs": runs})
            for m, rs in runs.items():
                loss_rows.append([name, steps, str(dtype).replace("torch.", ""), m,
                                  mean_sd(r["final_train"] for r in rs),
                                  mean_sd(r["held_out"] for r in rs),
                                  f"{statistics.mean(r['seconds'] for r in rs):.1f}"])
                print(loss_rows[-1], flush=True)
        if not overflow:
            continue
        runs = {m: [run(m, torch.float16, shape, data, s, steps, growth_interval=10)
                    for s in range(args.seeds)] for m in ("normal", "release", "torch.amp")}
        doc["overflow"].append({"model": name, "steps": steps, "runs": runs})
        for m, rs in runs.items():
            partial = "—"
            if m == "release":
                n = rs[0]["n_params"]
                counts = [c for r in rs for c in r["skipped_params"]]
                part = sum(1 for c in counts if c < n)
                partial = (f"{part} of {len(counts)} (median {statistics.median(counts):.0f} "
                           f"of {n} parameters skipped)" if counts else "none")
            over_rows.append([name, steps, m, mean_sd(r["overflows"] for r in rs), partial,
                              mean_sd(r["final_train"] for r in rs),
                              mean_sd(r["held_out"] for r in rs)])
            print(over_rows[-1], flush=True)
    md = header("# Gradient release: training loss against the normal step (CPU)", __file__,
                doc) + [
          f"Character-level GPT-2 on the repository's docs, context {CONTEXT}, batch {BATCH}, "
          f"AdamW (lr 2e-3), seeds 0..{args.seeds - 1} (mean ± standard "
          "deviation over seeds). Train: mean of the last 30 steps' losses; held-out: 8 "
          "batches of the last 10 % of the text.", "", "## Loss, normal and release mode", ""]
    md += res.table(["model", "steps", "dtype", "mode", "train loss", "held-out loss",
                     "s per run"], "lrllrrr", loss_rows)
    md += ["", "## A run that overflows (FP16, the scale grows every 10 clean iterations)", "",
           "Overflowing iterations per run; partial skips: overflowing iterations in which release "
           "mode stepped some parameters (a whole-step skip would have stepped none).", ""]
    md += res.table(["model", "steps", "mode", "overflows per run", "partial skips (release)",
                     "train loss", "held-out loss"], "lrlrlrr", over_rows)
    write(args, "release_training_cpu", doc, md)


if __name__ == "__main__":
    main()
