#!/usr/bin/env python3
"""8-bit storage formats for AdamW's two moments: which element code and which block size the
fused kernels should implement, decided by training the demo's models with each one.

    PYTHONPATH=python:examples/python:benchmarks python3 benchmarks/moment_formats.py
    PYTHONPATH=python:examples/python:benchmarks python3 benchmarks/moment_formats.py --quick

Optimizer. A reference AdamW in plain PyTorch (FP32 weights and arithmetic; betas (0.9, 0.999),
eps 1e-8, weight decay 0.01, torch's update formula; checked against torch.optim.AdamW at the
start of every run). The moments live in flat FP32 buffers in which every parameter's segment
starts on a multiple of 256 elements, so a block of B elements (B dividing 256) never spans two
tensors and a tensor's last block is partial (the zeros after it change no block maximum). Within
a step the new moments are formed from the stored (dequantized) ones and the FP32 gradient, the
update reads them in FP32, and only then are they stored: quantized and dequantized in place.
That is what a fused kernel does when it loads a block, updates it in registers and writes it
back, so the quantization error enters through the next step's moments.

Formats, each block with one scale stored in FP16, rounded up to the next FP16 value (rounding to
nearest could put the scale below the block's maximum and a small block's scale at zero; rounded
up, every code stays in range and a nonzero block keeps a nonzero scale):
  exp_avg (int8, codes -127..127, u = m / absmax of the block):
    lin       q = round(127 u)
    softsign  q = round(127 c(u)), c(u) = 2u / (1 + |u|)      (twice lin's resolution near 0)
    sqrt      q = round(127 c(u)), c(u) = sign(u) |u|^(1/2)   (resolution grows towards 0)
  exp_avg_sq (uint8, codes 0..255), stored as x = v^p with the block maximum of x as scale,
  q = round(255 x / max x), dequantized as (q / 255 max x)^(1/p):
    lin       p = 1
    sqrt      p = 1/2  (sqrt(v) linearly: the quantity the update divides by)
    4th-root  p = 1/4
Baselines: FP32 moments (the reference) and BF16 moments (round to nearest, what fusedamp's
state_dtype=torch.bfloat16 stores). Storage per element of a moment: 4, 2, or 1 + 2/B bytes.

Runs. Stage 1: FP32, BF16 and the nine (exp_avg, exp_avg_sq) pairs at B = 32; stage 2: the two
best pairs of stage 1 (rank_pairs) at B = 64, 128, 256; stage 3: the recommended pair and block
size (choose_block) with its scale stored as BF16 instead of FP16 (same bytes; not a format
asked for: it measures what FP16's range costs). Each on the digits CNN (lr 2e-3, batch 64) and
the character GPT (dim 128, 2 blocks, context 64, batch 16, lr 1e-3) of
examples/python/amp_models.py, several seeds (seed = initial weights and batch order, the same
for every format, so runs with the same seed are paired). Reported: training loss (mean of the
last 20 steps), held-out loss (digits: the 297 test images, also accuracy; char-GPT: 8 fixed
validation batches of 32), mean ± sample standard deviation over seeds, the difference of the
means from FP32's in units of FP32's seed-to-seed standard deviation; the update error, against
the update exact moments kept alongside in FP32 would give on the run's own gradients; how far
the stored sqrt(v) has drifted from the exact one by the end; the largest |update| / lr seen,
and the share of element-steps whose |update| / lr exceeds 1.5 times what exact Adam can reach
at that step (adam_bound): such steps are made by the storage, not by the gradients.

Diagnostic. During the FP32 run of the first seed, at a few checkpoints, the exact moments are
put through every format once and compared with the exact ones: relative RMS error, the share
of nonzero values stored as 0, and the error of the update direction m / (sqrt(v) + eps) (bias
corrected) the next step would take from them with its own gradient, against the exact one.

Writes benchmarks/results/moment_formats_<device>.{json,md}; --quick is a smoke run that writes
files only with --out. The formats are in moments/formats.py, the reference optimizer in
moments/reference.py, the runs and the rule in moments/runs.py, the tables in moments/report.py.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness import results as res
from harness.machine import device_tag, machine_info
from moments.diagnostic import diagnostic_storages
from moments.formats import BF16, BLOCKS, FP32, M_CODES, V_CODES, Storage, pairs
from moments.reading import reading
from moments.reference import BETAS, EPS, WD, self_check
from moments.report import write_markdown
from moments.runs import choose_block, rank_pairs, summarize, train
from moments.tasks import TaskSpec

COMMAND = "PYTHONPATH=python:examples/python:benchmarks"


def main(argv=None):
    ap = res.parser(__doc__)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--digits-steps", type=int, default=600)
    ap.add_argument("--char-steps", type=int, default=600)
    ap.add_argument("--digits-lr", type=float, default=2e-3)
    ap.add_argument("--char-lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", nargs="*", default=["digits-cnn", "char-gpt"],
                    choices=["digits-cnn", "char-gpt"])
    ap.add_argument("--limit", type=float, default=2.0,
                    help="loss test: |Δ| at most this many FP32 sds (default 2)")
    ap.add_argument("--tolerance", type=float, default=1.1,
                    help="block test: direction error at most this times B=32's (default 1.1)")
    ap.add_argument("--pair", nargs=2, metavar=("EXP_AVG", "EXP_AVG_SQ"),
                    help="skip the rule, sweep the block size of this pair")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 seeds, 40 steps")
    ap.add_argument("--resume", action="store_true", help="keep the runs an interrupted run "
                    "with the same seeds and tasks left in the temporary folder")
    res.add_output(ap, default=None)
    ap.add_argument("--render", metavar="JSON", help="rewrite the markdown, the block choice "
                    "and the reading of an earlier run's JSON file, running nothing")
    args = ap.parse_args(argv)
    if args.render:
        return render(Path(args.render))
    if args.pair and Storage(args.pair[0], args.pair[1], 32) not in pairs(32):
        ap.error(f"--pair: exp_avg of {M_CODES}, exp_avg_sq of {V_CODES}")
    if args.quick:
        args.seeds, args.digits_steps, args.char_steps = 2, 40, 40
    torch.set_num_threads(args.threads)
    specs = {"digits-cnn": TaskSpec("digits-cnn", args.digits_lr, 64, args.digits_steps),
             "char-gpt": TaskSpec("char-gpt", args.char_lr, 16, args.char_steps)}
    doc = study(args, [specs[m] for m in args.models],
                res.command(__file__, argv, prefix=COMMAND + " python3"))
    print("\n".join(doc["reading"]))
    print(f"whole run {doc['wall_s'] / 60:.1f} min")
    out = res.out_dir(args, quick=args.quick)
    if out is not None:
        res.write_results(out, f"moment_formats_{device_tag('cpu')}", doc,
                          lambda path: write_markdown(path, doc))
    return 0


def render(path):
    """Rewrites the markdown, the block choice and the reading of an earlier run's JSON file."""
    doc = json.loads(path.read_text())
    storages = [Storage(d["exp_avg"], d["exp_avg_sq"], d["block"], d["scale"],
                        d.get("m_scale")) for d in doc["storages"]]
    doc["summary"] = summarize(doc["results"], [t["model"] for t in doc["tasks"]], storages)
    c = doc["choice"]  # the block rule may have changed; every block size's data is here
    c["block"] = choose_block(doc["summary"], Storage(c["exp_avg"], c["exp_avg_sq"], 32),
                              c["limit"], c["tolerance"])
    doc["reading"] = reading(doc)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    write_markdown(path.with_suffix(".md"), doc)
    print(f"wrote {path.with_suffix('.md')}", file=sys.stderr)
    return 0


def study(args, specs, command):
    """Stage 1, the block-size sweep of the best pairs, the BF16-scale variants of the chosen
    one: every run, the summary, the choice and the reading."""
    t_start = time.perf_counter()
    seeds = list(range(args.seeds))
    check = {s.model: self_check(s) for s in specs}
    diag_storages = diagnostic_storages()
    results, diag = [], {}

    # Every finished run is kept in a scratch file, so a failure late in a quarter-hour run
    # (or an interrupted one) costs only what --resume cannot find there.
    partial = Path(tempfile.gettempdir()) / f"moment_formats_{device_tag('cpu')}.partial.json"
    setup = {"seeds": seeds, "tasks": [vars(s) for s in specs]}
    if args.resume and partial.exists():
        saved = json.loads(partial.read_text())
        if saved["setup"] == setup:
            results, diag = saved["results"], saved["diagnostic"]
            t_start -= saved["elapsed_s"]
            print(f"resuming: {len(results)} runs from {partial}")

    def run(storage):
        for spec in specs:
            for seed in seeds:
                if any(r["model"] == spec.model and r["storage"] == storage.key
                       and r["seed"] == seed for r in results):
                    continue
                cps = ()
                if storage == FP32 and seed == seeds[0]:
                    cps = tuple(sorted({spec.steps // 10, spec.steps // 2, spec.steps - 1}))
                r = train(spec, storage, seed, cps, diag_storages)
                if "diagnostic" in r:
                    diag[spec.model] = r.pop("diagnostic")
                results.append(r)
                print(f"  {spec.model:>10} {storage.key:<32} seed {seed}  train "
                      f"{r['train_loss']:.4f}  held-out {r['heldout_loss']:.4f}  max|d| "
                      f"{r['max_abs_direction']:.3g}  {r['ms_per_step']:.1f} ms/step  "
                      f"[{time.perf_counter() - t_start:.0f} s]", flush=True)
                partial.write_text(json.dumps(
                    {"setup": setup, "results": results, "diagnostic": diag,
                     "elapsed_s": time.perf_counter() - t_start}))

    models = [s.model for s in specs]
    stage1 = [FP32, BF16] + pairs(32)
    for s in stage1:
        run(s)
    ranking, ok = rank_pairs(summarize(results, models, stage1), args.limit)
    if args.pair:
        pair = Storage(args.pair[0], args.pair[1], 32)
        swept = [pair]
    else:  # the runner-up too: near-ties between the best two are to be expected
        pair, swept = ranking[0], ranking[:2]
    sweep = [Storage(s.m, s.v, b) for s in swept for b in BLOCKS[1:]]
    for s in sweep:
        run(s)
    block = choose_block(summarize(results, models, stage1 + sweep), pair, args.limit,
                         args.tolerance)
    # Not formats asked for: the same two bytes as a BF16 scale, FP32's range with 8
    # significant bits, to measure what FP16's range costs the chosen format; for both
    # moments, and for exp_avg alone (v's roots stay in FP16's normal range, m does not).
    alt = [Storage(pair.m, pair.v, block, "bf16"),
           Storage(pair.m, pair.v, block, "fp16", m_scale="bf16")]
    for s in alt:
        run(s)
    storages = stage1 + sweep + alt
    doc = {"device": "cpu", "command": command, "machine": machine_info("cpu"),
           "wall_s": time.perf_counter() - t_start, "seeds": seeds, "self_check": check,
           "tasks": [vars(s) for s in specs],
           "hyper_parameters": {"betas": list(BETAS), "eps": EPS, "weight_decay": WD},
           "storages": [s.as_dict() for s in storages],
           "choice": {"exp_avg": pair.m, "exp_avg_sq": pair.v, "block": block,
                      "by_rule": not args.pair, "within_noise": ok, "limit": args.limit,
                      "tolerance": args.tolerance, "swept": [s.key for s in swept],
                      "ranking": [s.key for s in ranking]},
           "summary": summarize(results, models, storages), "diagnostic": diag,
           "results": results}
    doc["reading"] = reading(doc)
    partial.unlink(missing_ok=True)
    return doc


if __name__ == "__main__":
    sys.exit(main())
