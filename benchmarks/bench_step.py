#!/usr/bin/env python3
"""Step benchmark: one full mixed-precision optimizer step, fusedamp against torch.amp.

With (scaled) gradients already in place, times what a training loop does after backward():
the overflow check / unscale, optional global-norm clipping, the optimizer update and the
loss-scale update.

    make bench-step                                  # CPU results into benchmarks/results/
    PYTHONPATH=python python3 benchmarks/bench_step.py [--device cuda] [--quick]

fusedamp side. Each configuration is built by one small function. Through the ops
(``fusedamp_ops``), the op sequence the engine issues:
    grad_stats_   (found_inf + sum of squares; one read-only pass over the FP16/BF16 grads)
    adam_step_ / sgd_step_  (FP32 master weights; inv_scale, found_inf and, when clipping,
                             grad_sum_sq + max_grad_norm applied inside the same pass)
    update_scale_
and the same configurations through ``fusedamp.optim`` and ``fusedamp.GradScaler``
(``scaler.step(opt); scaler.update()``, rows marked "api").

torch side (FP32 parameters, FP32 gradients multiplied by the loss scale, as torch.amp leaves
them after backward): ``scaler.step(opt); scaler.update()``, with ``scaler.unscale_(opt);
clip_grad_norm_`` first when clipping; plus BF16 parameters with fused AdamW and no scaler.

Gradients are restored from a pristine copy before every repetition, outside the timed region
(unscale_ and clipping modify them in place; repeated unscaling would end in denormals), for
fusedamp as well as torch so that both see the same cache state.

Parameter shapes of resnet50 and GPT-2 come from torchvision / transformers when installed
(recorded as the "shape source"), else from harness/model_shapes.py's derivation of the same
architectures. The configurations are built in step/configs.py, measured in step/measure.py and
reported by step/report.py.
"""
from __future__ import annotations

import gc
import os
import sys

import torch

try:
    from tqdm import tqdm
except ImportError:  # progress bars are a nicety, not a requirement
    tqdm = None

from harness import results as res
from harness.machine import device_tag, load_average, machine_info
from step.configs import (BETAS, BYTES_PER_PARAM, EPS, GRAD_STD, LOSS_SCALE, LR, MAX_NORM,
                          MOMENTUM, SGD_LR, WD, make_configs)
from step.measure import copy_bandwidth, make_sizes, measure, summarise
from step.report import check_targets, plot, ratios, telemetry_cost, write_markdown


def main(argv=None):
    ap = res.parser(__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--sizes", nargs="*", help="subset of sizes (default: all for the device)")
    ap.add_argument("--configs", nargs="*", help="substrings; keep configurations matching any")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds of timed repetitions per configuration (default: 0.5 s; slow "
                         "configurations get 3 reps)")
    ap.add_argument("--min-reps", type=int, default=None)
    ap.add_argument("--max-reps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--copy-mib", type=int, default=None, help="memory-copy reference size")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny budget, files only with an explicit --out")
    res.add_output(ap, default=None)
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every configuration this many times, in turns, and pool")
    ap.add_argument("--name", default="step",
                    help="result files' stem: NAME_cpu.{md,json,png} (default: step)")
    ap.add_argument("--no-api", action="store_true",
                    help="skip the fusedamp.optim/GradScaler rows even if they exist")
    args = ap.parse_args(argv)

    import fusedamp  # registers torch.ops.fusedamp

    device = args.device
    torch.set_num_threads(args.threads)
    cpu = device == "cpu"
    budget = args.budget if args.budget is not None else 0.5
    min_reps = args.min_reps or (5 if cpu else 20)
    max_reps = args.max_reps or (200 if cpu else 1000)
    warmup = 2 if cpu else 10  # after the first step (state allocation) and one timed one
    if args.quick:
        budget, min_reps, max_reps, warmup = 0.05, 2, 3, 1
    with_api = (not args.no_api and hasattr(fusedamp, "GradScaler")
                and hasattr(getattr(fusedamp, "optim", None), "AdamW"))
    sizes = make_sizes(device, args.sizes)
    cfgs = make_configs(with_api)
    if args.configs:
        cfgs = [c for c in cfgs if any(s in c.key for s in args.configs)]
    info = machine_info(device)
    command = res.command(__file__, argv)

    copy = copy_bandwidth(device, args.copy_mib or (256 if cpu else 1024),
                          5 if args.quick else 20)
    print(f"memory copy reference: {copy['gbps']:.1f} GB/s", file=sys.stderr)
    results, failures = run(sizes, cfgs, device, args.rounds,
                            dict(budget_s=budget, min_reps=min_reps, max_reps=max_reps,
                                 warmup=warmup))
    load = load_average()
    if load is not None:
        info["load_average_at_end"] = load
    rat = ratios(results, cfgs)
    targets = check_targets(rat, device)
    for r in rat:
        flag = "  <-- fusedamp slower" if r["ratio"] < 1 else ""
        print(f"{r['size']:>10}  {r['fusedamp']:<26} vs {r['torch']:<36} {r['ratio']:5.2f}{flag}")
    for c in telemetry_cost(results):
        print(f"{c['size']:>10}  {c['config']:<26} telemetry cost {100 * c['cost']:+.1f}%")
    if failures:
        print(f"{len(failures)} configuration(s) failed", file=sys.stderr)
    out = res.out_dir(args, quick=args.quick)
    if out is None:
        return 0
    doc = {"machine": info, "command": command, "copy_reference": copy,
           "sizes": [s.as_dict() for s in sizes],
           "bytes_per_param": BYTES_PER_PARAM,
           "hyper_parameters": {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD,
                                "sgd_lr": SGD_LR, "momentum": MOMENTUM, "max_norm": MAX_NORM,
                                "loss_scale": LOSS_SCALE, "grad_std": GRAD_STD},
           "results": results, "ratios": rat, "targets": targets,
           "telemetry_cost": telemetry_cost(results), "failures": failures}
    stem = f"{args.name}_{device_tag(device)}"
    base = res.write_results(out, stem, doc, lambda path: write_markdown(
        path, info, copy, sizes, results, rat, targets, command))
    plot(f"{base}.png", rat, sizes,
         f"fusedamp step vs torch.amp — {info.get('gpu', info['cpu'])}, torch {info['torch']}")
    return 0


def run(sizes, cfgs, device, rounds, timing):
    """Every configuration measured on every size; (results, failures)."""
    results, failures = [], []
    bar = tqdm(total=len(sizes) * len(cfgs) * rounds, unit="cfg", dynamic_ncols=True) \
        if tqdm else None
    for spec in sizes:
        gen = torch.Generator().manual_seed(0)
        w = (torch.randn(spec.numel, generator=gen) * 0.02).to(device)
        g = (torch.randn(spec.numel, generator=gen) * GRAD_STD).to(device)
        # Rounds take turns over the configurations (a slow spell of a shared machine then
        # falls on all of them); each configuration's repetitions of all rounds are pooled.
        pooled = {}
        for cfg in [c for _ in range(rounds) for c in cfgs]:
            if bar:
                bar.set_postfix_str(f"{spec.name}: {cfg.key}")
            try:
                r = measure(cfg, spec, w, g, device, **timing)
                if cfg.key in pooled:
                    r = summarise(cfg, spec, pooled[cfg.key]["_dev"] + r["_dev"],
                                  pooled[cfg.key]["_host"] + r["_host"])
                pooled[cfg.key] = r
            except Exception as e:  # keep the run going; report the failure
                failures.append({"size": spec.name, "config": cfg.key, "error": repr(e)})
                print(f"\n{spec.name} / {cfg.key} failed: {e!r}", file=sys.stderr)
            if bar:
                bar.update(1)
            gc.collect()
        for r in pooled.values():
            del r["_dev"], r["_host"]
            results.append(r)
        del w, g
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    if bar:
        bar.close()
    return results, failures


if __name__ == "__main__":
    sys.exit(main())
