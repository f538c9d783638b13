#!/usr/bin/env python3
"""Compact optimizer state (state_dtype=torch.int8, 8-bit moments) against FP32-master AdamW,
plain BF16 AdamW and fusedamp's other modes: bytes per parameter, accuracy over seeds, and the
step time, in one run on one machine.

    PYTHONPATH=python python3 benchmarks/bench_state_formats.py               # all three parts
    PYTHONPATH=python python3 benchmarks/bench_state_formats.py --quick       # smoke run, no files

Rows are bench_master_modes.py's (same constructors, same byte accounting), every one on BF16
parameters with BF16 gradients and no loss scaler, plus its FP32 reference (torch AdamW on FP32
parameters) in the accuracy part.

Bytes: weight + gradient + every state tensor, per parameter, measured from the tensors an
optimizer holds after a step on the GPT-2-124M shapes (scalars included), beside the row's
declared layout.

Accuracy: the digits CNN and the char-GPT of examples/python/amp_models.py, --steps steps at
--lr for each of --seeds (the same initial weights and batches for every row of a seed); the
final training loss (mean of the last 20 steps) and the held-out loss, as mean and sample sd
over the seeds; "in spread" says whether a row's mean held-out loss lies within the FP32-master
row's mean ± 2 sd.

Speed: median step time on the GPT-2-124M and resnet50 parameter shapes
(harness/model_shapes.py's derivations), one thread, against torch's plain BF16 fused AdamW
(which keeps no master copy and BF16 moments: a different algorithm, the baseline the 8-bit
state is measured against);
the rows take turns in --rounds rounds (speed_part), so that a slow spell of a shared machine
does not land on one row.

Results: benchmarks/results/state_formats_<device>.{json,md} (bytes and accuracy) and
state_formats_speed_<device>.{json,md} (`--parts speed --stem state_formats_speed`), so the
long accuracy run and the step timing, which wants a quiet machine, are taken apart.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from harness import results as res
from harness.machine import machine_info
from harness.model_shapes import split
from harness.timing import percentile
from master_modes.accuracy import Task, train_one
from master_modes.rows import fp32_reference_row, library_versions, make_rows
from master_modes.timing import all_sizes, measured_state_bytes, time_row
from step.configs import GRAD_STD

ROWS = ["torch AdamW fused", "fusedamp fp32-master / fp32 state",
        "fusedamp split / bf16 state", "fusedamp fp32-master / int8 state",
        "fusedamp split / int8 state", "fusedamp split8 / bf16 state",
        "fusedamp split8 / int8 state", "bitsandbytes AdamW8bit", "torchao AdamW8bit"]
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def pick_rows(device):
    rows = {r.key: r for r in make_rows(device, {})}
    for k in ROWS:
        if k in rows and rows[k].unavailable:
            print(f"skipped: {k} ({rows[k].unavailable})", file=sys.stderr)
    return [rows[k] for k in ROWS if k in rows and not rows[k].unavailable]


def bytes_part(rows, size, device):
    """Weights + gradients + state per parameter, measured after one step."""
    out = []
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(size.numel, generator=gen) * 0.02
    g = torch.randn(size.numel, generator=gen) * 1e-3
    for row in rows:
        params = [torch.nn.Parameter(t) for t in split(w, size.shapes, row.param_dtype,
                                                           device)]
        for p, gr in zip(params, split(g, size.shapes, row.param_dtype, device)):
            p.grad = gr
        opt = row.build(params, HYPER)
        opt.step()
        n = sum(p.numel() for p in params)
        weights = sum(p.numel() * p.element_size() for p in params) / n
        grads = sum(p.grad.numel() * p.grad.element_size() for p in params) / n
        state = measured_state_bytes(opt)
        out.append({"row": row.key, "weights": weights, "grads": grads, "state": state,
                    "total": weights + grads + state, "declared_state": row.state_bytes()})
        del opt, params
    return out


def accuracy_part(rows, device, models, seeds, steps, lr):
    """steps: {model: training steps}."""
    hyper = dict(HYPER, lr=lr)
    results = []
    acc_rows = [fp32_reference_row()] + rows
    for name in models:
        task = Task(name, device, 64 if name == "digits-cnn" else 16)
        for seed in seeds:
            for row in acc_rows:
                r = train_one(task, row, steps[name], hyper, seed, device)
                r.pop("loss_curve")
                r["seed"] = seed
                results.append(r)
                print(f"{name:>10} seed {seed} | {row.key:<42} train {r['final_train_loss']:.4f}"
                      f"  held-out {r['eval_loss']:.4f}  ({r['ms_per_step']:.1f} ms/step)",
                      file=sys.stderr, flush=True)
    return results


def summarize_accuracy(results):
    by = {}
    for r in results:
        by.setdefault((r["model"], r["row"]), []).append(r)
    out = []
    for (model, row), rs in by.items():
        def ms(key):
            vals = [x[key] for x in rs]
            return statistics.mean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)
        tm, ts = ms("final_train_loss")
        em, es = ms("eval_loss")
        item = {"model": model, "row": row, "seeds": len(rs), "train_mean": tm, "train_sd": ts,
                "heldout_mean": em, "heldout_sd": es,
                "nonfinite": any(x["nonfinite_loss"] for x in rs)}
        if "accuracy" in rs[0]:
            item["accuracy_mean"] = statistics.mean(x["accuracy"] for x in rs)
        out.append(item)
    for item in out:
        ref = next((x for x in out if x["model"] == item["model"]
                    and x["row"] == "fusedamp fp32-master / fp32 state"), None)
        if ref is not None:
            item["in_spread"] = abs(item["heldout_mean"] - ref["heldout_mean"]) <= \
                2 * ref["heldout_sd"]
    return out


def speed_part(rows, sizes, device, reps, warmup, rounds):
    """Each row timed in `rounds` rounds of reps / rounds steps, the rows taking turns, so that
    a slow spell of a shared machine falls on every row alike rather than on whichever row
    was running; the median is over all the rounds' steps."""
    out = []
    torch.set_num_threads(1)
    per_round = max(1, -(-reps // rounds))
    for size in sizes:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(size.numel, generator=gen) * 0.02
        g = torch.randn(size.numel, generator=gen) * GRAD_STD
        runs = {row.key: [] for row in rows}
        for _ in range(rounds):
            for row in rows:
                runs[row.key].append(time_row(row, size, w, g, device, HYPER, per_round,
                                                 warmup))
        for row in rows:
            r = dict(runs[row.key][0])
            times = [t for run in runs[row.key] for t in run["times_s"]]
            r.update(reps=len(times), rounds=rounds, times_s=times,
                     median_s=statistics.median(times), p10_s=percentile(times, 0.1),
                     p90_s=percentile(times, 0.9))
            out.append(r)
            print(f"{size.name:>12} | {row.key:<42} {1e3 * r['median_s']:8.2f} ms",
                  file=sys.stderr, flush=True)
    for r in out:
        base = next(x for x in out if x["size"] == r["size"] and x["row"] == ROWS[0])
        r["x_torch_bf16"] = r["median_s"] / base["median_s"]
    return out


def write_markdown(path, doc):
    L = [f"# Compact optimizer state — {doc['device']}", "",
         f"`{doc['command']}`", "",
         f"{doc['machine'].get('date_utc', '')}; "
         f"commit {doc['machine'].get('fusedamp_commit', '?')}; "
         f"{doc['machine'].get('cpu', doc['machine'].get('device_name', ''))} "
         f"(flags: {', '.join(doc['machine'].get('cpu_flags', [])) or '—'}; torch CPU "
         f"capability {doc['machine'].get('cpu_capability', '?')}), "
         f"{doc['machine'].get('cpu_cores', '?')} cores; torch {doc['machine'].get('torch', '')}; "
         f"whole run {doc.get('wall_s', 0) / 60:.1f} min. Method: the docstring of "
         "benchmarks/bench_state_formats.py.",
         ""]
    if "libraries" in doc:
        L += ["Libraries: " + ", ".join(f"{k} {v}" for k, v in doc["libraries"].items()) + "."
              + (f" {doc['note']}." if doc.get("note") else ""), ""]
    if "bytes" in doc:
        L += ["## Bytes per parameter (BF16 weights and gradients, measured from the tensors)",
              "", "| row | weights | gradients | state | total |", "| --- | --: | --: | --: | --: |"]
        L += [f"| {r['row']} | {r['weights']:.2f} | {r['grads']:.2f} | {r['state']:.3f} | "
              f"{r['total']:.3f} |" for r in doc["bytes"]]
        L.append("")
    if "accuracy" in doc:
        a = doc["accuracy"]
        steps = ", ".join(f"{m} {n}" for m, n in a["steps"].items())
        L += [f"## Accuracy (steps: {steps}; lr {a['lr']}; seeds {a['seeds']})", "",
              "| model | row | train loss | held-out loss | test acc | within FP32-master's "
              "mean ± 2 sd |", "| --- | --- | --: | --: | --: | --- |"]
        for r in a["summary"]:
            acc = f"{100 * r['accuracy_mean']:.1f}%" if "accuracy_mean" in r else "—"
            spread = {True: "yes", False: "no"}.get(r.get("in_spread"), "—")
            L.append(f"| {r['model']} | {r['row']} | {r['train_mean']:.4f} ± {r['train_sd']:.4f}"
                     f" | {r['heldout_mean']:.4f} ± {r['heldout_sd']:.4f} | {acc} | {spread} |")
        L.append("")
    if "speed" in doc:
        L += ["## Step time (one thread; × torch's plain BF16 fused AdamW, a different "
              "algorithm: no master, BF16 moments)", "",
              "| shapes | row | median ms | × torch BF16 |", "| --- | --- | --: | --: |"]
        L += [f"| {r['size']} | {r['row']} | {1e3 * r['median_s']:.2f} | "
              f"{r['x_torch_bf16']:.2f}x |" for r in doc["speed"]]
        L.append("")
    Path(path).write_text("\n".join(L))


def main(argv=None):
    ap = res.parser(__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", nargs="*", default=["bytes", "accuracy", "speed"])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--model-steps", nargs="*", default=[], metavar="MODEL=N",
                    help="another number of steps for a model (e.g. char-gpt=200)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--models", nargs="*", default=["digits-cnn", "char-gpt"])
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3,
                    help="speed: the rows take turns this many times (reps split among them)")
    res.add_output(ap, default=None)
    ap.add_argument("--note", default="", help="how the run was set up, for the results")
    ap.add_argument("--stem", default="state_formats",
                    help="results file name before _<device> (a run of some parts only keeps "
                         "the others' file)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.reps, args.model_steps = 30, [0], 2, []
    steps = {m: args.steps for m in args.models}
    steps.update({k: int(v) for k, v in (x.split("=") for x in args.model_steps)})
    rows = pick_rows(args.device)
    sizes = all_sizes()
    names = ["gpt2-124M/8", "resnet50/8"] if args.quick else ["gpt2-124M", "resnet50"]
    given = list(argv if argv is not None else sys.argv[1:])
    if "--note" in given:  # its text is printed beside the libraries, not in the command
        at = given.index("--note")
        given[at:at + 2] = ["--note", "'...'"]
    doc = {"device": args.device, "command": "python3 benchmarks/bench_state_formats.py "
           + " ".join(given),
           "machine": machine_info(args.device), "libraries": library_versions(),
           "rows": ROWS, "note": args.note}
    t0 = time.time()
    if "bytes" in args.parts:
        doc["bytes"] = bytes_part(rows, sizes[names[0]], args.device)
    if "accuracy" in args.parts:
        results = accuracy_part(rows, args.device, args.models, args.seeds, steps, args.lr)
        doc["accuracy"] = {"steps": steps, "lr": args.lr, "seeds": args.seeds,
                           "runs": results, "summary": summarize_accuracy(results)}
    if "speed" in args.parts:
        doc["speed"] = speed_part(rows, [sizes[n] for n in names], args.device, args.reps, 2,
                                   1 if args.quick else args.rounds)
    doc["wall_s"] = time.time() - t0
    out = res.out_dir(args, quick=args.quick)
    if out is None:
        write_markdown("/dev/stdout", doc)
    else:
        res.write_results(out, f"{args.stem}_{args.device}", doc,
                          lambda path: write_markdown(path, doc))


if __name__ == "__main__":
    main()
