#!/usr/bin/env python3
"""Master-weight modes benchmark: fusedamp AdamW's master_weights / state_dtype choices on BF16
parameters, against torch's plain BF16 fused AdamW, torch-optimi's Kahan-summation AdamW and
torchao's stochastic-rounding AdamW.

    PYTHONPATH=python python3 benchmarks/bench_master_modes.py --quick         # smoke run, no files
    PYTHONPATH=python python3 benchmarks/bench_master_modes.py                  # step time + bytes
    PYTHONPATH=python python3 benchmarks/bench_master_modes.py --accuracy       # accuracy part only
    PYTHONPATH=python python3 benchmarks/bench_master_modes.py --all --device cuda

Rows (every one on BF16 parameters with BF16 gradients, no loss scaler):
  torch    torch.optim.AdamW(fused=True): round-to-nearest BF16 weights, no master copy, moments
           in the parameter dtype (BF16). The baseline ("x base" columns).
  optimi   optimi.AdamW(kahan_sum=True): BF16 weights + a BF16 Kahan compensation buffer,
           BF16 moments (foreach on the CPU; Triton, its default, and foreach on CUDA).
  torchao  torchao.optim._AdamW(bf16_stochastic_round=True): FP32 math, BF16 moments,
           stochastically rounded BF16 weights; one torch.compile'd function per parameter.
  fusedamp fusedamp.optim.AdamW(master_weights=MODE, state_dtype=SDT), MODE in True (FP32 master),
           False (plain BF16), "split" (BF16 + int16 remainder), "kahan" (BF16 + BF16
           compensation), "split8" (BF16 + int8 remainder: a 24-bit master), "stochastic"
           (stochastic rounding); SDT FP32 or BF16 moments, or int8 (8-bit moments with block
           scales).
A row that cannot run (library missing, mode not implemented, ...) records why instead of a
number; the run goes on.

Step time. Parameter shapes of resnet50 and GPT-2 small (harness/model_shapes.py's derivations,
25,557,032 and 124,439,808 parameters), or both shrunk 8x per dimension with --quick. Random
weights and gradients are made once; the gradients are restored from a pristine copy before
every repetition, outside the timed region (optimi's foreach step uses .grad as scratch space).
Median of --reps repetitions after --warmup steps; the first step (state allocation, torch.compile
for torchao) is reported separately. One thread unless --threads. On CUDA the step is timed with
perf_counter between two synchronizations (host overhead included).

Bytes. Each row carries a small description of its per-parameter state (buffer, bytes) and,
where the implementation is not one fused pass, the passes it runs. From it: state bytes per
parameter besides the 2-byte weight; bytes moved per step per parameter by a single fused pass
(grad read 2, weight read + write 2 + 2, every state buffer read + written); and bytes moved as
implemented (the passes, or the single pass plus extra passes such as fusedamp's grad_stats_).
The state actually held in optimizer.state after a step is measured too, as a cross-check.

Accuracy (--accuracy / --all). The digits CNN and the character-level GPT of
examples/python/amp_models.py, trained in BF16 with each row's optimizer plus an FP32-parameter
torch AdamW reference: same seed, same initial weights, same batches, same hyper-parameters
for every row; a small learning rate (default 1e-4) at which many updates of BF16 weights fall
below half an ulp, so plain round-to-nearest BF16 stalls (at 1e-4, 200 steps: digits training
loss 0.88 against FP32's 0.39; char-GPT 3.14 against 2.89). Reported: final training loss
(mean of the last 20 steps), evaluation loss and (digits) test accuracy.

Results: benchmarks/results/master_modes_<device>.{json,md} (--out to change the folder). Each
part updates its own section of an existing JSON file, so the two parts can run separately.
--quick prints the tables and writes files only when --out is given.
"""
from __future__ import annotations

import ast
import json
import os
import sys
import time

import torch

from harness import results as res
from harness.machine import device_tag, load_average, machine_info
from master_modes.accuracy import run_accuracy
from master_modes.report import print_summary, row_table, write_markdown
from master_modes.rows import library_versions, make_rows
from master_modes.timing import QUICK_SHRINK, all_sizes, run_timing
from step.configs import BETAS, EPS, GRAD_STD, LR, WD


def _parse_kw(items):
    out = {}
    for it in items or []:
        k, _, v = it.partition("=")
        try:
            out[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k] = v
    return out


def merged_rows(doc, rows_doc):
    """The row descriptions: this run's, plus the earlier ones that the other part's results
    still refer to (the FP32 reference first)."""
    old = {r["row"]: r for r in doc.get("rows", [])}
    new = {r["row"]: r for r in rows_doc}
    used = set(new)
    for part in ("timing", "accuracy"):
        for r in doc.get(part, {}).get("results", []) + doc.get(part, {}).get("failures", []):
            used.add(r["row"])
    keys = list(dict.fromkeys([k for k in old if k in used] + list(new)))
    keys.sort(key=lambda k: not k.startswith("FP32 reference"))
    return [new.get(k) or old[k] for k in keys]


def main(argv=None):
    ap = res.parser(__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    part = ap.add_mutually_exclusive_group()
    part.add_argument("--accuracy", action="store_true", help="run the accuracy part only")
    part.add_argument("--all", action="store_true", help="step time and accuracy")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: shrunk sizes, few repetitions, few training steps; "
                         "files only with an explicit --out")
    ap.add_argument("--sizes", nargs="*", help=f"of {list(all_sizes())} (default: resnet50 "
                    f"gpt2-124M; with --quick the /{QUICK_SHRINK} versions)")
    ap.add_argument("--rows", nargs="*", help="substrings; keep rows matching any")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 10 CPU, "
                    "50 CUDA; 3 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="(default 2 CPU, 10 CUDA; 1 quick)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: 1 for the step time, all cores for accuracy)")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps per accuracy run (default 200; 30 with --quick)")
    ap.add_argument("--models", nargs="*", default=["digits-cnn", "char-gpt"],
                    choices=["digits-cnn", "char-gpt"])
    ap.add_argument("--digits-batch", type=int, default=64, help="images per step")
    ap.add_argument("--char-batch", type=int, default=16, help="sequences of 64 characters "
                    "per step")
    ap.add_argument("--acc-lr", type=float, default=1e-4,
                    help="learning rate of every accuracy run (default 1e-4: plain BF16 stalls)")
    ap.add_argument("--acc-wd", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fusedamp-kw", nargs="*", metavar="KEY=VALUE",
                    help="extra fusedamp.optim.AdamW arguments (Python literals), e.g. "
                         "skip_nonfinite=False")
    res.add_output(ap, default=None)
    args = ap.parse_args(argv)

    device = args.device
    cuda = device == "cuda"
    do_timing = not args.accuracy
    do_accuracy = args.accuracy or args.all
    if args.reps is None:
        args.reps = 3 if args.quick else (50 if cuda else 10)
    if args.warmup is None:
        args.warmup = 1 if args.quick else (10 if cuda else 2)
    if args.steps is None:
        args.steps = 30 if args.quick else 200
    sizes_by_name = all_sizes()
    names = args.sizes or ([f"resnet50/{QUICK_SHRINK}", f"gpt2-124M/{QUICK_SHRINK}"]
                           if args.quick else ["resnet50", "gpt2-124M"])
    unknown = [n for n in names if n not in sizes_by_name]
    if unknown:
        ap.error(f"unknown size(s) {unknown}; choose from {list(sizes_by_name)}")
    sizes = [sizes_by_name[n] for n in names]

    fusedamp_kw = _parse_kw(args.fusedamp_kw)
    rows = make_rows(device, fusedamp_kw)
    if args.rows:
        rows = [r for r in rows if r.baseline or any(s in r.key for s in args.rows)]
    command = res.command(__file__, argv)
    libs = library_versions()

    out_dir = res.out_dir(args, quick=args.quick)
    tag = device_tag(device)
    doc = {}
    if out_dir is not None and (out_dir / f"master_modes_{tag}.json").exists():
        try:
            doc = json.loads((out_dir / f"master_modes_{tag}.json").read_text())
        except (OSError, ValueError):
            doc = {}
    doc.update(device=device, libraries=libs)

    hyper = {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}
    if do_timing:
        torch.set_num_threads(args.threads or 1)
        info = machine_info(device)
        results, failures = run_timing(args, rows, sizes, device, hyper)
        load = load_average()
        if load is not None:
            info["load_average_at_end"] = load
        doc["timing"] = {
            "machine": info, "command": command, "reps": args.reps, "warmup": args.warmup,
            "hyper_parameters": hyper, "grad_std": GRAD_STD, "weight_std": 0.02,
            "fusedamp_extra_kwargs": fusedamp_kw,
            "sizes": [s.as_dict() for s in sizes],
            "results": results, "failures": failures}
    if do_accuracy:
        torch.set_num_threads(args.threads or os.cpu_count())
        info = machine_info(device)
        acc_hyper = {"lr": args.acc_lr, "betas": list(BETAS), "eps": EPS,
                     "weight_decay": args.acc_wd}
        t0 = time.perf_counter()
        results, failures, acc_rows = run_accuracy(args, rows, device, acc_hyper)
        info["wall_s"] = round(time.perf_counter() - t0, 1)
        doc["accuracy"] = {
            "machine": info, "command": command, "steps": args.steps, "seed": args.seed,
            "models": args.models, "hyper_parameters": acc_hyper,
            "batch": {"digits-cnn": args.digits_batch, "char-gpt": args.char_batch},
            "fusedamp_extra_kwargs": fusedamp_kw,
            "reference": acc_rows[0].key, "rows": [r.key for r in acc_rows],
            "results": results, "failures": failures}
        ref = acc_rows[0]
        rows_doc = row_table([ref] + rows, hyper)
    else:
        rows_doc = row_table(rows, hyper)
    doc["rows"] = merged_rows(doc, rows_doc)
    print_summary(doc)
    if out_dir is not None:
        res.write_results(out_dir, f"master_modes_{tag}", doc,
                          lambda path: write_markdown(path, doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
