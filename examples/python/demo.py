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
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))


def worker(model_name, mode, steps, out_path, seed=0):
    import amp_models as am

    result = am.train_run(model_name, mode, steps, seed=seed, progress=True)
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

    from amp_models import MODES, REFERENCE_OF, TORCH_AMP_BF16

    import torch

    # Each fusedamp set-up is compared with torch.amp of its own dtype: FP16 with autocast FP16 +
    # GradScaler, BF16 with autocast bfloat16 (no scaler).
    modes = MODES + (TORCH_AMP_BF16,)

    os.makedirs(args.out, exist_ok=True)
    # A CPU has no fast FP16 kernels (torch.amp and fusedamp FP16 alike run FP16 convolutions
    # and matmuls slowly there), so the CPU run is short; a GPU trains longer.
    base = (600, 600) if torch.cuda.is_available() else (150, 120)
    plan = [("digits-cnn", int(base[0] * args.steps_scale)),
            ("char-gpt", int(base[1] * args.steps_scale))]
    print(f"fusedamp demo: {len(plan) * len(modes)} training runs "
          f"({', '.join(f'{m}: {n} steps' for m, n in plan)}), one process each", flush=True)
    results = []
    for model_name, steps in plan:
        for mode in modes:
            path = os.path.join(args.out, f"{model_name}_{mode}.json")
            print(f"  {model_name} / {mode} ...", flush=True)
            subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", model_name,
                            mode, str(steps), path], check=True)
            with open(path) as f:
                results.append(json.load(f))

    device = results[0]["device"]
    lines = [f"fusedamp demo — {device}, torch.amp = autocast FP16 + GradScaler + AdamW(fused), "
             f"{TORCH_AMP_BF16} = autocast bfloat16 + AdamW(fused); \"vs torch.amp\": against "
             "the torch.amp set-up of the same dtype",
             "",
             "| model | set-up | train loss | eval loss | accuracy / perplexity | ms/step | "
             "vs torch.amp | peak mem MB | skipped | final scale |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = next(b for b in results
                    if b["model"] == r["model"] and b["mode"] == REFERENCE_OF[r["mode"]])
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
