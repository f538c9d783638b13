"""fusedamp demo: trains real models with FP32, torch.amp and fusedamp (FP16, BF16) side by
side on real data, then prints a comparison table and saves a plot.

    python examples/python/demo.py [--steps-scale 1.0] [--out demo_output]

Every (model, set-up) pair runs in its own process, so peak memory is measured per run
(torch.cuda.max_memory_allocated on a GPU, peak resident set on the CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))


def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def worker(model_name, mode, steps, out_path, seed=0):
    import torch
    from tqdm import tqdm

    import amp_models as am

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    if model_name == "digits-cnn":
        (xtr, ytr), (xte, yte) = am.digits_data(device)
        model = am.DigitsCNN().to(device)
        setup = am.Setup(mode, model, lr=3e-3, weight_decay=1e-4, device=device)
        g = torch.Generator().manual_seed(seed)

        def batch():
            ix = torch.randint(0, len(xtr), (64,), generator=g).to(device)
            return xtr[ix], ytr[ix]

        loss_fn = am.digits_loss

        def evaluate():
            loss, acc = am.digits_eval(setup.model, xte, yte, setup.autocast_dtype)
            return {"eval_loss": loss, "accuracy": acc}
    else:
        context = 64
        train, val, vocab = am.char_data(device, context)
        model = am.CharGPT(vocab, context).to(device)
        setup = am.Setup(mode, model, lr=2e-3, weight_decay=0.01, device=device,
                         max_grad_norm=1.0)
        g = torch.Generator().manual_seed(seed)

        def batch():
            return am.char_batch(train, 32, context, g)

        loss_fn = am.char_loss

        def evaluate():
            loss, ppl = am.char_eval(setup.model, val, context, setup.autocast_dtype)
            return {"eval_loss": loss, "perplexity": ppl}

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rss0 = _rss_mb()
    losses, scales, times = [], [], []
    bar = tqdm(range(steps), desc=f"{model_name:>10s} {mode:<14s}", ncols=90, mininterval=1.0,
               disable=None)  # no bar when the output is not a terminal
    for _ in bar:
        xb, yb = batch()
        t0 = time.perf_counter()
        loss = setup.train_step(loss_fn, xb, yb)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if setup.scaler is not None and setup.scaler.is_enabled():
            scales.append(setup.scaler.get_scale())
    losses = [float(v) for v in torch.stack(losses).float().cpu().tolist()]
    result = {
        "model": model_name, "mode": mode, "device": device, "steps": steps,
        "loss_curve": losses, "scale_history": scales,
        "final_train_loss": sum(losses[-20:]) / min(20, len(losses)),
        "ms_per_step": 1e3 * sorted(times[steps // 5:])[len(times[steps // 5:]) // 2],
        "skipped_steps": setup.skipped_steps(), "final_scale": setup.scale(),
    }
    result.update(evaluate())
    if device == "cuda":
        result["peak_mem_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        result["peak_mem_mb"] = peak - rss0  # growth of the peak RSS during training
    with open(out_path, "w") as f:
        json.dump(result, f)


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="demo_output")
    ap.add_argument("--steps-scale", type=float, default=1.0)
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "MODE", "STEPS", "OUT"))
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]), args.worker[3])
        return

    from amp_models import MODES

    import torch

    os.makedirs(args.out, exist_ok=True)
    # A CPU has no fast FP16 kernels (torch.amp and fusedamp FP16 alike run FP16 convolutions
    # and matmuls slowly there), so the CPU run is short; a GPU trains longer.
    base = (600, 600) if torch.cuda.is_available() else (150, 120)
    plan = [("digits-cnn", int(base[0] * args.steps_scale)),
            ("char-gpt", int(base[1] * args.steps_scale))]
    print(f"fusedamp demo: {len(plan) * len(MODES)} training runs "
          f"({', '.join(f'{m}: {n} steps' for m, n in plan)}), one process each", flush=True)
    results = []
    for model_name, steps in plan:
        for mode in MODES:
            path = os.path.join(args.out, f"{model_name}_{mode}.json")
            print(f"  {model_name} / {mode} ...", flush=True)
            subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", model_name,
                            mode, str(steps), path], check=True)
            with open(path) as f:
                results.append(json.load(f))

    device = results[0]["device"]
    lines = [f"fusedamp demo — {device}, torch.amp = autocast FP16 + GradScaler + AdamW(fused)",
             "",
             "| model | set-up | train loss | eval loss | accuracy / perplexity | ms/step | "
             "vs torch.amp | peak mem MB | skipped | final scale |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = next(b for b in results if b["model"] == r["model"] and b["mode"] == "torch.amp")
        metric = (f"{100 * r['accuracy']:.1f} %" if "accuracy" in r
                  else f"{r['perplexity']:.2f}")
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['final_train_loss']:.3f} | {r['eval_loss']:.3f} | "
            f"{metric} | {r['ms_per_step']:.2f} | {base['ms_per_step'] / r['ms_per_step']:.2f}x | "
            f"{r['peak_mem_mb']:.0f} | {fmt(r['skipped_steps'], 'd')} | "
            f"{fmt(r['final_scale'], '.0f')} |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "demo_table.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "demo_results.json"), "w") as f:
        json.dump(results, f)
    plot(results, os.path.join(args.out, "demo.png"))
    print(f"\nplot: {os.path.join(args.out, 'demo.png')}   table: {os.path.join(args.out, 'demo_table.md')}")


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in results})
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 7))
    for col, m in enumerate(models):
        ax, sax = axes[0][col], axes[1][col]
        for r in (r for r in results if r["model"] == m):
            curve = r["loss_curve"]
            k = 10
            smooth = [sum(curve[max(0, i - k):i + 1]) / len(curve[max(0, i - k):i + 1])
                      for i in range(len(curve))]
            ax.plot(smooth, label=r["mode"])
            if r["scale_history"]:
                sax.semilogy(r["scale_history"], label=r["mode"])
        ax.set_title(f"{m}: training loss (smoothed)")
        ax.set_xlabel("step")
        ax.legend()
        sax.set_title(f"{m}: loss scale")
        sax.set_xlabel("step")
        sax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
