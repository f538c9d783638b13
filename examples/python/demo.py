"""fusedamp demo: trains real models with FP32, torch.amp and fusedamp (FP16, BF16) side by
side on real data, then two stress runs of the char-GPT in FP16 under torch's loss-scale rule
and under fusedamp's amax policy, and a short FP16 run that goes NaN with fusedamp.debug.watch
naming the layer that produced it (which_layer.py); prints the comparison, the stress outcomes
and the layer, and saves one picture of it all (demo.png).

    python examples/python/demo.py [--steps-scale 1.0] [--out demo_output]

On a CPU the char-GPT runs are sized to a time budget: a CPU without FP16/BF16 arithmetic
(AVX2, or AVX-512 without AVX512-FP16/AMX) runs their matmuls more than ten times slower than
FP32, so the demo times a few FP16 steps first and chooses the step count (20 to 120, the same
for every set-up) that keeps its eight low-precision char-GPT runs within about two minutes.

Every (model, set-up) pair runs in its own process, so peak memory is measured per run
(torch.cuda.max_memory_allocated on a GPU, peak resident set on the CPU). The stress runs:
  "scale too high"  init_scale = 2^24, which overflows: torch's rule halves once per skipped
                    step; the amax policy drops to what an overflow proves and then moves to
                    the measured scale;
  "loss too small"  the loss multiplied by 1e-8 (a mis-normalised loss, a tiny auxiliary
                    weight) at torch's default init_scale, with AdamW's eps and the clipping
                    threshold multiplied too, so that exact arithmetic would retrace the run of
                    the unscaled loss (run beside them as the reference): under torch's rule
                    (x2 per 2000 clean steps) FP16 gradients stay underflowed to zero and the
                    model learns little; the amax policy raises the scale within a few steps.
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


# The stress runs: name -> policy_run's keyword arguments.
STRESS = {"scale too high": dict(init_scale=2.0 ** 24),
          "loss too small": dict(loss_factor=1e-8)}
POLICIES = ("torch", "amax")
# The run beside a stress run's policies that shows where they should end: the same set-up
# without the stress (torch's rule, loss x1).
REFERENCE = {"loss too small": ("unscaled loss", dict(loss_factor=1.0))}
# On a CPU: the char-GPT's batch (sequences), and the seconds its low-precision runs (three
# side-by-side set-ups, the BF16 reference and the five stress runs: nine) may take together.
CPU_CHAR_BATCH = 8
CPU_CHAR_BUDGET_S = 120.0
CPU_CHAR_LOW_PRECISION_RUNS = 9


def worker(model_name, mode, steps, out_path, batch_size=None, seed=0):
    import amp_models as am

    result = am.train_run(model_name, mode, steps, seed=seed, progress=True,
                          batch_size=batch_size)
    with open(out_path, "w") as f:
        json.dump(result, f)


def stress_worker(steps, out_path, batch_size=None):
    import amp_models as am

    runs = {}
    for name, kwargs in STRESS.items():
        plan = [(policy, policy, kwargs) for policy in POLICIES]
        if name in REFERENCE:
            label, ref_kwargs = REFERENCE[name]
            plan.append((label, "torch", ref_kwargs))
        runs[name] = {label: am.policy_run("char-gpt", policy, steps, batch_size=batch_size, **kw)
                      for label, policy, kw in plan}
    with open(out_path, "w") as f:
        json.dump(runs, f)


def stress_table(stress):
    lines = ["| stress run | policy | skipped steps | skipped before the first applied | "
             "underflow, first step | underflow, last step | final scale | final train loss | "
             "eval loss |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    for name, runs in stress.items():
        for policy, r in runs.items():
            t = r["telemetry"]
            first_applied = next((k for k, s in enumerate(t["skipped"]) if not s), len(t["skipped"]))
            tail = r["loss"][-20:]
            lines.append(f"| {name} | {policy} | {sum(t['skipped'])} | {first_applied} | "
                         f"{t['underflow_fraction'][0]:.2%} | {t['underflow_fraction'][-1]:.2%} | "
                         f"{t['scale'][-1]:g} | {sum(tail) / len(tail):.3f} | "
                         f"{r['eval']['eval_loss']:.3f} |")
    return "\n".join(lines)


def run_label(label):
    """A stress run's legend entry: its policy, or the reference run's own name."""
    return f"policy={label}" if label in POLICIES else label


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="demo_output")
    ap.add_argument("--steps-scale", type=float, default=1.0)
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "MODE", "STEPS", "OUT"))
    ap.add_argument("--stress-worker", nargs=2, metavar=("STEPS", "OUT"))
    ap.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]), args.worker[3], args.batch)
        return
    if args.stress_worker:
        stress_worker(int(args.stress_worker[0]), args.stress_worker[1], args.batch)
        return

    from amp_models import MODES, TORCH_AMP_BF16, reference_run

    import torch

    # Each fusedamp set-up is compared with torch.amp of its own dtype: FP16 with autocast FP16 +
    # GradScaler, BF16 with autocast bfloat16 (no scaler).
    modes = MODES + (TORCH_AMP_BF16,)

    os.makedirs(args.out, exist_ok=True)
    # A CPU has no fast FP16 kernels (torch.amp and fusedamp FP16 alike run FP16 convolutions
    # and matmuls slowly there), so the CPU run is short; a GPU trains longer.
    batch = {}
    if torch.cuda.is_available():
        base = (600, 600)
    else:
        batch["char-gpt"] = CPU_CHAR_BATCH
        base = (150, char_gpt_steps_for_cpu(args.out))
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
                            mode, str(steps), path, *batch_args(batch.get(model_name))],
                           check=True)
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
        base = reference_run(results, r)
        metric = (f"{100 * r['accuracy']:.1f} %" if "accuracy" in r
                  else f"{r['perplexity']:.2f}")
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['final_train_loss']:.3f} | {r['eval_loss']:.3f} | "
            f"{metric} | {r['ms_per_step']:.2f} | {base['ms_per_step'] / r['ms_per_step']:.2f}x | "
            f"{r['peak_mem_mb']:.0f} | {fmt(r['skipped_steps'], 'd')} | "
            f"{fmt(r['final_scale'], '.0f')} |")
    stress_steps = plan[1][1]
    print(f"  stress runs: char-gpt FP16, {stress_steps} steps, "
          f"{' / '.join(STRESS)} x policy {' / '.join(POLICIES)} ...", flush=True)
    stress_path = os.path.join(args.out, "stress.json")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--stress-worker",
                    str(stress_steps), stress_path, *batch_args(batch.get("char-gpt"))],
                   check=True)
    with open(stress_path) as f:
        stress = json.load(f)
    from which_layer import describe, which_layer_run

    culprit = which_layer_run()
    table = "\n".join(lines) + "\n\nStress runs (char-gpt, fusedamp FP16):\n\n" + \
        stress_table(stress) + "\n\n" + describe(culprit)
    print(table)
    with open(os.path.join(args.out, "demo_table.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "demo_results.json"), "w") as f:
        json.dump(results, f)
    plot(results, stress, culprit, os.path.join(args.out, "demo.png"))
    print(f"\nplot: {os.path.join(args.out, 'demo.png')}   table: {os.path.join(args.out, 'demo_table.md')}")


def batch_args(batch_size):
    return [] if batch_size is None else ["--batch", str(batch_size)]


def char_gpt_steps_for_cpu(out):
    """The char-GPT's step count on this CPU: five FP16 steps timed (their median after the
    first), then as many steps as fit CPU_CHAR_BUDGET_S for all low-precision runs."""
    path = os.path.join(out, "char-gpt_timing.json")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "char-gpt",
                    "fusedamp-fp16", "5", path, *batch_args(CPU_CHAR_BATCH)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(path) as f:
        ms = json.load(f)["ms_per_step"]
    steps = int(CPU_CHAR_BUDGET_S * 1e3 / (ms * CPU_CHAR_LOW_PRECISION_RUNS))
    steps = max(20, min(120, steps))
    print(f"  char-gpt: an FP16 step takes {ms:.0f} ms on this CPU (batch {CPU_CHAR_BATCH}): "
          f"{steps} steps per run", flush=True)
    return steps


def smoothed(curve, k=10):
    return [sum(curve[max(0, i - k):i + 1]) / len(curve[max(0, i - k):i + 1])
            for i in range(len(curve))]


def plot(results, stress, culprit, path):
    """One picture: the side-by-side runs (loss curves, step time and peak memory) on top, the
    stress runs' telemetry (torch's rule vs the amax policy) below, the which-layer run last."""
    from fusedamp.diagnostics import draw_panel
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from which_layer import draw

    fig = Figure(figsize=(18, 17), layout="constrained")
    axes = fig.subplots(4, 3)
    for ax in axes[3][:2]:
        ax.remove()
    draw(fig.add_subplot(axes[3][2].get_gridspec()[3, :2]), axes[3][2], culprit)
    models = sorted({r["model"] for r in results})
    modes = list(dict.fromkeys(r["mode"] for r in results))
    for ax, m in zip(axes[0][:2], models):
        for r in (r for r in results if r["model"] == m):
            ax.plot(smoothed(r["loss_curve"]), label=r["mode"])
        ax.set_title(f"{m}: training loss (smoothed)")
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    width = 0.8 / len(modes)
    for ax, key, title in ((axes[0][2], "ms_per_step", "ms per step (lower is faster)"),
                           (axes[1][2], "peak_mem_mb", "peak memory, MB")):
        for k, mode in enumerate(modes):
            values = [next(r[key] for r in results if r["model"] == m and r["mode"] == mode)
                      for m in models]
            ax.bar([i + k * width for i in range(len(models))], values, width, label=mode)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(models))], models)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize="small")
    high = {p: r["telemetry"] for p, r in stress["scale too high"].items()}
    small = {p: r["telemetry"] for p, r in stress["loss too small"].items()}
    for ax, telemetry, key, title in (
            (axes[1][0], high, "scale", "scale too high (init 2^24): loss scale, skips in red"),
            (axes[2][0], small, "underflow_fraction",
             "loss too small (x1e-8): FP16 gradients underflowed"),
            (axes[2][1], small, "scale", "loss too small: loss scale")):
        draw_panel(ax, {run_label(p): t for p, t in telemetry.items()}, key)
        ax.set_title(title)
        ax.set_xlabel("step")
    for ax, name in ((axes[1][1], "scale too high"), (axes[2][2], "loss too small")):
        for label, r in stress[name].items():
            ax.plot(smoothed(r["loss"]), label=run_label(label))
        ax.set_title(f"{name}: training loss (smoothed)")
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"fusedamp demo ({results[0]['device']}): fusedamp vs torch.amp, the loss "
                 "scale under stress, and which layer made the NaN")
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
