"""End-to-end benchmark: training steps of real architectures under FP32, torch.amp
(autocast FP16 + GradScaler + AdamW(fused=True)), torch.amp BF16 (autocast bfloat16, no scaler,
AdamW(fused=True)), fusedamp FP16 and fusedamp BF16. Each fusedamp row is compared with the
torch.amp row of its dtype (FP16 with FP16, BF16 with BF16).

    python benchmarks/bench_train.py [--steps-scale 1.0]      (make bench-train)

Models: torchvision resnet18 (CIFAR-sized batches), transformers' GPT-2 architecture (small
config, no downloaded weights) and the demo's two models, trained on the demo's data
(examples/python/amp_models.py). Every (model, set-up) runs in its own process: steps per
second (median step time after warm-up), peak memory (torch.cuda.max_memory_allocated, or on the
CPU the growth of the process's peak RSS from after the task's imports and data, before the model
is made: every set-up's weights and state count; glibc's mmap threshold is fixed in the workers,
see worker_env), the loss after the fixed number of steps, and
ratios against torch.amp of the same dtype. Writes benchmarks/results/train_<device>.{md,json}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import harness
from harness import results as res

harness.use_paths("python", "examples")

# Steps per model: (CPU, GPU). FP16 kernels are slow on a CPU, so its runs are short.
STEPS = {"digits-cnn": (60, 300), "char-gpt": (40, 300), "resnet18": (8, 200),
         "gpt2": (30, 300)}


# glibc's malloc raises its mmap threshold each time a large block is freed, after which large
# blocks come from the heap and a freed one may stay resident: the same CPU run's peak RSS then
# landed at ~205 or ~255 MB (char-GPT, torch.amp, six runs), more than the set-ups differ by.
# A fixed threshold (glibc's initial 128 KiB) gives every large tensor its own mapping, returned
# when freed, and the same peak run after run (177 MB, three runs). Workers only; a value the
# caller set is kept.
MMAP_THRESHOLD = "131072"


def worker_env():
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD)
    return env


def main(argv=None):
    ap = res.parser(__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps-scale", type=float, default=1.0)
    ap.add_argument("--models", default=",".join(STEPS))
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "MODE", "STEPS", "OUT"))
    res.add_output(ap)
    args = ap.parse_args(argv)
    if args.worker:
        import amp_models as am

        result = am.train_run(args.worker[0], args.worker[1], int(args.worker[2]), progress=True)
        with open(args.worker[3], "w") as f:
            json.dump(result, f)
        return 0

    import torch

    from amp_models import MODES, TORCH_AMP_BF16, reference_run
    from harness.machine import (CPU_FLAGS, cpu_model_and_flags, device_tag,
                                 short_commit)

    gpu = torch.cuda.is_available()
    tag = device_tag("cuda" if gpu else "cpu")
    out_dir = res.out_dir(args)
    tmp_dir = tempfile.mkdtemp(prefix=f"train_{tag}_")
    results = []
    for model in args.models.split(","):
        steps = max(5, int(STEPS[model][1 if gpu else 0] * args.steps_scale))
        for mode in MODES + (TORCH_AMP_BF16,):
            print(f"  {model} / {mode}: {steps} steps", flush=True)
            path = os.path.join(tmp_dir, f"{model}_{mode}.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", model, mode,
                            str(steps), path], check=True, env=worker_env())
            with open(path) as f:
                r = json.load(f)
            r.pop("loss_curve")
            r.pop("scale_curve")
            results.append(r)

    cpu, flags = cpu_model_and_flags()
    machine = {
        "device": torch.cuda.get_device_name() if gpu
        else platform.processor() or platform.machine(),
        "cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "date": datetime.date.today().isoformat(),
        "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
        "fusedamp_commit": short_commit(), "cpu_flags": [f for f in CPU_FLAGS if f in flags],
    }
    for r in results:
        base = reference_run(results, r)
        r["steps_per_s"] = 1e3 / r["ms_per_step"]
        r["speed_vs_torch_amp"] = base["ms_per_step"] / r["ms_per_step"]
        r["mem_vs_torch_amp"] = (r["peak_mem_mb"] / base["peak_mem_mb"]
                                 if base["peak_mem_mb"] > 0 else None)
    table = markdown(machine, results, tag, gpu)
    print(table)
    if out_dir is not None:
        res.write_results(out_dir, f"train_{tag}", {"machine": machine, "results": results},
                          table)
    shutil.rmtree(tmp_dir)
    return 0


def markdown(machine, results, tag, gpu):
    lines = [f"# End-to-end training benchmark ({tag})", "",
             f"{machine['cpu']}, {machine['cores']} cores; torch {machine['torch']}, CUDA "
             f"{machine['cuda']}; CPU flags: {', '.join(machine['cpu_flags']) or 'none recorded'}"
             f"; {machine['date']}; fusedamp {machine['fusedamp_commit']}; "
             f"load average {machine['load_average'][0]:.1f}. torch.amp = autocast FP16 + "
             "GradScaler + AdamW(fused=True); torch.amp-bf16 = autocast bfloat16 + "
             "AdamW(fused=True), no scaler. \"vs torch.amp\" compares with the torch.amp row of "
             "the same dtype (fusedamp-bf16 with torch.amp-bf16, the rest with torch.amp). Peak "
             "memory: " +
             ("torch.cuda.max_memory_allocated." if gpu else
              "growth of the process's peak RSS from before the model is made (CPU; imports "
              "and data excluded; glibc's mmap threshold fixed at "
              f"{worker_env()['MALLOC_MMAP_THRESHOLD_']} bytes, see bench_train.py)."), ""]
    rows = []
    for r in results:
        mem = "-" if r["mem_vs_torch_amp"] is None else f"{r['mem_vs_torch_amp']:.2f}x"
        slower = r["mode"].startswith("fusedamp") and r["speed_vs_torch_amp"] < 1
        rows.append([r["model"], r["mode"], r["steps"], f"{r['steps_per_s']:.2f}",
                     f"{r['speed_vs_torch_amp']:.2f}x" + (" **slower**" if slower else ""),
                     f"{r['peak_mem_mb']:.0f}", mem, f"{r['final_train_loss']:.3f}",
                     "-" if r["skipped_steps"] is None else r["skipped_steps"]])
    lines += res.table(["model", "set-up", "steps", "steps/s", "vs torch.amp", "peak MB",
                        "vs torch.amp", "final train loss", "skipped"], "lllllllll", rows,
                       compact=True)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
