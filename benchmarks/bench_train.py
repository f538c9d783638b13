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
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples", "python"))
sys.path.insert(0, os.path.join(ROOT, "python"))

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


def device_tag(torch):
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        return "cuda_" + "".join(c if c.isalnum() else "_" for c in name).strip("_")
    return "cpu"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps-scale", type=float, default=1.0)
    ap.add_argument("--models", default=",".join(STEPS))
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "MODE", "STEPS", "OUT"))
    args = ap.parse_args()
    if args.worker:
        import amp_models as am

        result = am.train_run(args.worker[0], args.worker[1], int(args.worker[2]), progress=True)
        with open(args.worker[3], "w") as f:
            json.dump(result, f)
        return

    import torch

    from amp_models import MODES, TORCH_AMP_BF16, reference_run

    gpu = torch.cuda.is_available()
    tag = device_tag(torch)
    out_dir = os.path.join(HERE, "results")
    tmp_dir = os.path.join(out_dir, f".train_{tag}.tmp")
    os.makedirs(tmp_dir, exist_ok=True)
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

    machine = {
        "device": torch.cuda.get_device_name() if gpu else platform.processor() or platform.machine(),
        "cpu": _cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "date": datetime.date.today().isoformat(),
        "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
        "fusedamp_commit": _git_commit(),
    }
    lines = [f"# End-to-end training benchmark ({tag})", "",
             f"{machine['cpu']}, {machine['cores']} cores; torch {machine['torch']}, CUDA "
             f"{machine['cuda']}; {machine['date']}; fusedamp {machine['fusedamp_commit']}; "
             f"load average {machine['load_average'][0]:.1f}. torch.amp = autocast FP16 + GradScaler + "
             "AdamW(fused=True); torch.amp-bf16 = autocast bfloat16 + AdamW(fused=True), no scaler. "
             "\"vs torch.amp\" compares with the torch.amp row of the same dtype (fusedamp-bf16 "
             "with torch.amp-bf16, the rest with torch.amp). Peak memory: " +
             ("torch.cuda.max_memory_allocated." if gpu else
              "growth of the process's peak RSS from before the model is made (CPU; imports "
              "and data excluded; glibc's mmap threshold fixed at "
              f"{worker_env()['MALLOC_MMAP_THRESHOLD_']} bytes, see bench_train.py)."), "",
             "| model | set-up | steps | steps/s | vs torch.amp | peak MB | vs torch.amp | "
             "final train loss | skipped |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = reference_run(results, r)
        sps = 1e3 / r["ms_per_step"]
        r["steps_per_s"] = sps
        r["speed_vs_torch_amp"] = base["ms_per_step"] / r["ms_per_step"]
        r["mem_vs_torch_amp"] = (r["peak_mem_mb"] / base["peak_mem_mb"]
                                 if base["peak_mem_mb"] > 0 else None)
        mem_ratio = "-" if r["mem_vs_torch_amp"] is None else f"{r['mem_vs_torch_amp']:.2f}x"
        flag = " **slower**" if r["mode"].startswith("fusedamp") and r["speed_vs_torch_amp"] < 1 else ""
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['steps']} | {sps:.2f} | "
            f"{r['speed_vs_torch_amp']:.2f}x{flag} | {r['peak_mem_mb']:.0f} | {mem_ratio} | "
            f"{r['final_train_loss']:.3f} | {'-' if r['skipped_steps'] is None else r['skipped_steps']} |")
    table = "\n".join(lines) + "\n"
    print(table)
    with open(os.path.join(out_dir, f"train_{tag}.md"), "w") as f:
        f.write(table)
    with open(os.path.join(out_dir, f"train_{tag}.json"), "w") as f:
        json.dump({"machine": machine, "results": results}, f, indent=1)
    for name in os.listdir(tmp_dir):
        os.remove(os.path.join(tmp_dir, name))
    os.rmdir(tmp_dir)


def _git_commit():
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip() or None
    except OSError:
        return None


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
