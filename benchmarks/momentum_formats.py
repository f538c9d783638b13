#!/usr/bin/env python3
"""8-bit storage formats for SGD's momentum buffer: which element code state_dtype=torch.int8
should keep it in, decided by training the demo's models with each one.

    PYTHONPATH=python:examples/python:benchmarks python3 benchmarks/momentum_formats.py
    PYTHONPATH=python:examples/python:benchmarks python3 benchmarks/momentum_formats.py --quick

Optimizer. A reference SGD with momentum in plain PyTorch (FP32 weights and arithmetic,
momentum 0.9, dampening 0, weight decay 5e-4, torch's update formula; checked against
torch.optim.SGD at the start of every run). Each step forms the new buffer from the stored one
and the gradient, the weights take it in FP32, and only then is it stored: quantized and
dequantized, in blocks of 32 consecutive elements of each parameter (a tensor's last block
partial), what the fused kernels do.

Formats (int8 codes -127..127 of c(b / absmax), one FP32 absmax per block, as fusedamp keeps
its block scales; moments/formats.py's companding functions): lin, softsign (twice lin's
resolution near 0), sqrt (resolution growing towards 0: exp_avg's format in fusedamp). Baselines:
FP32 buffers (the reference) and BF16 (round to nearest, state_dtype=torch.bfloat16).

Runs: the digits CNN and the character GPT of examples/python/amp_models.py, several seeds
(the same initial weights and batches for every format). Reported: training loss (mean of the
last 20 steps), held-out loss (and the digits' test accuracy), mean ± sample sd over the seeds,
the difference of the means from FP32's in units of FP32's seed-to-seed sd, and the buffer's
storage error (relative RMS of stored minus exact over all steps and elements).

Writes benchmarks/results/momentum_formats_<device>.{json,md}; --quick is a smoke run that
writes files only with --out.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time

import torch

from harness import results as res
from harness.machine import device_tag, machine_info
from harness.results import mean_sd
from moments.formats import roundtrip_m
from moments.tasks import TaskSpec, make_task, teacher_forced_difference

COMMAND = "PYTHONPATH=python:examples/python:benchmarks"

MOMENTUM = 0.9
WD = 5e-4
BLOCK = 32
STORAGES = ("fp32", "bf16", "lin", "softsign", "sqrt")


def stored(buf, storage):
    """What the buffer is after a round trip through `storage`."""
    if storage == "fp32":
        return buf
    if storage == "bf16":
        return buf.bfloat16().float()
    flat = buf.reshape(-1)
    pad = (-flat.numel()) % BLOCK
    padded = torch.nn.functional.pad(flat, (0, pad))
    return roundtrip_m(padded, storage, BLOCK, scale="fp32")[:flat.numel()].view_as(buf)


class ReferenceSGD:
    def __init__(self, params, lr, storage):
        self.params = list(params)
        self.lr = lr
        self.storage = storage
        self.bufs = [None] * len(self.params)
        self.err_sq = 0.0
        self.ref_sq = 0.0

    @torch.no_grad()
    def step(self):
        for i, p in enumerate(self.params):
            g = p.grad + WD * p
            b = g.clone() if self.bufs[i] is None else MOMENTUM * self.bufs[i] + g
            p.sub_(self.lr * b)
            s = stored(b, self.storage)
            self.err_sq += (s - b).square().sum().item()
            self.ref_sq += b.square().sum().item()
            self.bufs[i] = s

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def self_check(spec):
    """The reference with FP32 storage against torch.optim.SGD on the same gradients."""
    err = teacher_forced_difference(
        spec, lambda model: ReferenceSGD(model.parameters(), spec.lr, "fp32"),
        lambda params: torch.optim.SGD(params, lr=spec.lr, momentum=MOMENTUM, weight_decay=WD,
                                       foreach=False))
    if err > 1e-6:
        raise SystemExit(f"reference SGD differs from torch.optim.SGD by {err:g} on {spec.model}")
    return err


def train(spec, storage, seed):
    model, batch, loss_fn, evaluate = make_task(spec, seed)
    opt = ReferenceSGD(model.parameters(), spec.lr, storage)
    losses = []
    for _ in range(spec.steps):
        loss = loss_fn(model, *batch())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    losses = torch.stack(losses).tolist()
    finite = all(math.isfinite(x) for x in losses)
    r = {"model": spec.model, "storage": storage, "seed": seed, "steps": spec.steps,
         "train_loss": statistics.fmean(losses[-20:]) if finite else math.nan,
         "buffer_error": math.sqrt(opt.err_sq / opt.ref_sq) if opt.ref_sq else 0.0}
    r.update(evaluate())
    return r


def summarize(results, models):
    out = {}
    for model in models:
        rows = {}
        for storage in STORAGES:
            runs = [r for r in results if r["model"] == model and r["storage"] == storage]
            row = {"runs": len(runs)}
            for key in ("train_loss", "heldout_loss", "accuracy", "buffer_error"):
                vals = [r[key] for r in runs if key in r]
                if vals:
                    row[key] = mean_sd(vals)
            rows[storage] = row
        ref = rows["fp32"]
        for row in rows.values():
            for key in ("train_loss", "heldout_loss"):
                mean, sd = row[key]
                ref_mean, ref_sd = ref[key]
                row[key + "_sds"] = (mean - ref_mean) / ref_sd if ref_sd else math.nan
        out[model] = rows
    return out


def _pm(pair, fmt=".4f"):
    """mean ± sd (the mean alone where there is no sd)."""
    mean, sd = pair
    return f"{mean:{fmt}} ± {sd:{fmt}}" if math.isfinite(sd) else f"{mean:{fmt}}"


def write_markdown(path, doc):
    m = doc["machine"]
    lines = [f"# 8-bit SGD momentum buffer formats — {doc['device']}", "",
             f"`{doc['command']}`", "",
             f"{m['date_utc']}; commit {m.get('fusedamp_commit', '?')}; {m['cpu']}, "
             f"{m['cpu_cores']} cores (flags: {', '.join(m['cpu_flags'])}; torch CPU capability "
             f"{m['cpu_capability']}), {m['torch_threads']} torch threads; torch {m['torch']}; "
             f"whole run {doc['minutes']:.1f} min.", "",
             "Method: the docstring of benchmarks/momentum_formats.py. Reference SGD in plain "
             f"PyTorch, momentum {MOMENTUM}, weight decay {WD}, FP32 weights and arithmetic; "
             f"the buffer replaced by its stored value after every step; blocks of {BLOCK} "
             "elements with FP32 scales. " + "; ".join(
                 f"{t['model']}: lr {t['lr']}, batch {t['batch']}, {t['steps']} steps"
                 for t in doc["tasks"]) + f"; seeds {doc['seeds']}. Reference vs "
             "torch.optim.SGD, 5 steps, largest weight difference: " + ", ".join(
                 f"{k} {v:.1e}" for k, v in doc["self_check"].items()) + ".", "",
             "Mean ± sample sd over the seeds; Δ/σ = (mean − FP32's mean) / FP32's "
             "seed-to-seed sd; buffer error = relative RMS of the stored buffer against the "
             "exact one, over all steps and elements.", ""]
    for model, rows in doc["summary"].items():
        lines += [f"## {model}", ""] + res.table(
            ["storage", "bytes/element", "train loss", "Δ/σ", "held-out loss", "Δ/σ",
             "test acc", "buffer error"], "lrrrrrrr",
            [[storage, {"fp32": "4", "bf16": "2"}.get(storage, f"1 + 4/{BLOCK} = 1.125"),
              _pm(row["train_loss"]), f"{row['train_loss_sds']:+.1f}", _pm(row["heldout_loss"]),
              f"{row['heldout_loss_sds']:+.1f}",
              f"{100 * row['accuracy'][0]:.1f}%" if "accuracy" in row else "",
              f"{row['buffer_error'][0]:.3g}"] for storage, row in rows.items()]) + [""]
    path.write_text("\n".join(lines))


def main(argv=None):
    ap = res.parser(__doc__)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--digits-lr", type=float, default=0.05)
    ap.add_argument("--char-lr", type=float, default=0.3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 seeds, 30 steps")
    res.add_output(ap, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.steps = 2, 30
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    specs = [TaskSpec("digits-cnn", args.digits_lr, 64, args.steps),
             TaskSpec("char-gpt", args.char_lr, 16, args.steps)]
    seeds = list(range(args.seeds))
    check = {s.model: self_check(s) for s in specs}
    results = []
    for spec in specs:
        for seed in seeds:
            for storage in STORAGES:
                r = train(spec, storage, seed)
                results.append(r)
                print(f"{spec.model:10s} seed {seed} {storage:8s} train {r['train_loss']:.4f} "
                      f"held-out {r['heldout_loss']:.4f} buffer error {r['buffer_error']:.3g}",
                      file=sys.stderr)
    doc = {"device": "cpu", "command": res.command(__file__, argv, prefix=COMMAND + " python3"),
           "machine": machine_info("cpu"), "minutes": (time.perf_counter() - t0) / 60,
           "tasks": [vars(s) for s in specs], "seeds": seeds, "self_check": check,
           "results": results, "summary": summarize(results, [s.model for s in specs])}
    out = res.out_dir(args, quick=args.quick)
    if out is None:
        print(json.dumps(doc["summary"], indent=1))
        return 0
    res.write_results(out, f"momentum_formats_{device_tag('cpu')}", doc,
                      lambda path: write_markdown(path, doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
