#!/usr/bin/env python3
"""Host overhead per tensor, fusedamp against torch, side by side.

Many one-element tensors make the kernels' work negligible, so what is timed is the host path:
dispatch, argument checks, the engine's bucket walk, the pybind11 boundary and the Python
step. Each row times one call of a fusedamp op or step and of its torch counterpart on the same
N tensors, and reports the median over repetitions (after warm-up) in ns per tensor and per
call, with the ratio fusedamp/torch. All sides at one N are timed in turn, one call each per
round in a new (seeded) random order, so that a busy moment of the machine and the cache state
a call inherits from the one before it fall on all of them alike:

  unscale op        torch._amp_foreach_non_finite_check_and_unscale_  vs  unscale_and_check_
  AdamW op          torch._fused_adamw_ (FP32, grad_scale + found_inf)  vs  adam_step_ (FP16
                    params + FP32 masters, inv_scale + found_inf); and FP32 against FP32
  grad stats        torch._foreach_norm + the check (inv_scale 1, as torch.amp checks for a
                    fused optimizer)  vs  grad_stats_
  The fusedamp ops are called through fusedamp.ops, their direct Python entry (as torch's own
  ops are called from Python); the rows "through torch.ops" call the same ops through
  torch.ops.fusedamp, torch's boxed path for custom operators, for reference.
  whole AMP step    torch.amp.GradScaler + torch.optim.AdamW(fused=True)  vs  fusedamp.GradScaler
                    + fusedamp.optim.AdamW: scaler.step(opt); scaler.update(); with clipping
                    torch adds scaler.unscale_(opt) + clip_grad_norm_(foreach=True) and fusedamp
                    passes max_grad_norm; "lean" is fusedamp's step with
                    adopt_param_edits=False, write_back_grads=False (where the package has them)

Gradients are refilled from a pristine copy (torch._foreach_copy_) and found_inf zeroed before
every timed call, outside the timed region: the unscaling calls and steps divide the gradients
in place, and repeated unscaling would end in zeros. The "new gradients each call" row instead
gives every parameter a new gradient tensor before each call, as a loop with
zero_grad(set_to_none=True) does. Before the first timed step the scaler has
scaled a 0-dim tensor once, as an iteration starts with scale().

On CUDA the time is the wall time of issuing one call (the stream is idle when it starts) and,
beside it, the CUDA-event time of the same call. `--device meta` times the ops alone (their
Meta kernels run only the argument checks); the whole steps are skipped there.

    PYTHONPATH=python python3 benchmarks/bench_host_overhead.py [--tensors 1000 10000]
                                                                 [--device cuda] [--out DIR]

An installed package without an op's newer arguments (an older build) gets only the arguments
its schema has; a row it cannot run says why instead of a number.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

# bench_step puts tests/python on sys.path; its machine description is this table's too.
from bench_step import HERE, REPO, device_tag, machine_info
from op_inputs import HYPER_DEFAULTS, op_inputs

LOSS_SCALE = 1024.0     # randn gradients / 1024 stay normal in FP16
MAX_GRAD_NORM = 1.0
ADAM = HYPER_DEFAULTS["adam_step_"]  # the hyper-parameters of every Adam row, both sides
LEAN_OPTIONS = dict(adopt_param_edits=False, write_back_grads=False)
OP_TARGET = 0.8         # each op <= 0.8x its torch counterpart, per tensor
STEP_TARGET = 0.5       # the whole step <= 0.5x torch's bare _fused_adamw_, per tensor
ORDER_SEED = 13         # the sides' order in each timing round (time_interleaved)


class Skip(Exception):
    """A side of a row that this device or this installed package cannot run; the message
    says why and stands in the table instead of a number."""


@dataclass
class Timed:
    """What one side of a row times: `call` is timed, `reset` runs before it, untimed."""
    call: Callable[[], object]
    reset: Callable[[], object]


@dataclass
class Side:
    key: str                      # measured once per N, however many rows show it
    label: str
    dtype: str
    build: Callable[[str, int, int], Timed]   # (device, tensors, numel) -> Timed


@dataclass
class Row:
    title: str
    torch: Side
    fusedamp: Side
    target: str                   # "op", "step" or "reference" (shown, held to no target)
    note: str = ""


# ----------------------------------------------------------------------------- inputs
def sizes_of(n, numel):
    return [(numel,)] * n


def refill(grads, found_inf=None):
    """Puts the gradients back as they were now (and found_inf at zero): the reset between
    timed calls of anything that unscales or clips them in place."""
    pristine = [g.clone() for g in grads]

    def reset():
        torch._foreach_copy_(grads, pristine)
        if found_inf is not None:
            found_inf.zero_()
    return reset


def fusedamp_op(op, via_torch_ops=False, **problem):
    """A bare fusedamp op on op_inputs' problem, with the op's own defaults, called through
    fusedamp.ops (the direct entry) or, with via_torch_ops, torch.ops.fusedamp (torch's boxed
    path for custom operators). The arguments come from the installed op's schema
    (OpInputs.args), so an older build without newer optional arguments runs too."""
    def build(device, n, numel):
        import fusedamp
        entry = torch.ops.fusedamp if via_torch_ops else getattr(fusedamp, "ops", None)
        if not hasattr(entry, op):
            raise Skip("the installed fusedamp has no fusedamp.ops entry")
        inp = op_inputs(device, sizes_of(n, numel), loss_scale=LOSS_SCALE, **problem)
        return Timed(inp.bind(op, entry=entry), refill(inp.grads, inp.found_inf))
    return build


def torch_problem(device, n, numel, grad_dtype):
    # The same builder as fusedamp's rows: FP32 params and state, no masters.
    return op_inputs(device, sizes_of(n, numel), grad_dtype=grad_dtype, loss_scale=LOSS_SCALE,
                     scalars=dict(found_inf=0.0, inv_scale=1.0 / LOSS_SCALE))


def torch_unscale(device, n, numel):
    inp = torch_problem(device, n, numel, torch.float16)
    return Timed(lambda: torch._amp_foreach_non_finite_check_and_unscale_(
        inp.grads, inp.found_inf, inp.inv_scale), refill(inp.grads, inp.found_inf))


def torch_fused_adamw(device, n, numel):
    inp = torch_problem(device, n, numel, torch.float32)
    hyper = dict(lr=ADAM["lr"], beta1=ADAM["beta1"], beta2=ADAM["beta2"], eps=ADAM["eps"],
                 weight_decay=ADAM["weight_decay"])
    return Timed(lambda: torch._fused_adamw_(
        inp.params, inp.grads, inp.exp_avgs, inp.exp_avg_sqs, [], inp.steps, amsgrad=False,
        maximize=False, grad_scale=inp.scale, found_inf=inp.found_inf, **hyper),
        refill(inp.grads, inp.found_inf))


def torch_norm_and_check(device, n, numel):
    inp = torch_problem(device, n, numel, torch.float16)
    check_only = torch.ones(1, device=device)

    def call():
        torch._foreach_norm(inp.grads)
        torch._amp_foreach_non_finite_check_and_unscale_(inp.grads, inp.found_inf, check_only)
    return Timed(call, refill(inp.grads, inp.found_inf))


def renew(params):
    """Gives every parameter a new gradient tensor with the values it has now, as a training loop
    with zero_grad(set_to_none=True) (torch's default) and a backward does: the reset between
    timed calls of a row whose step must not find last call's gradient tensors again. The
    previous gradients are dropped here, outside the timed call, unless the step holds them."""
    pristine = [p.grad.clone() for p in params]

    def reset():
        for p, g in zip(params, pristine):
            p.grad = None
            p.grad = g.clone()
    return reset


# ----------------------------------------------------------------------------- whole steps
def model_params(device, n, numel, dtype):
    """Leaf parameters with gradients in their own dtype, from op_inputs' values."""
    inp = op_inputs(device, sizes_of(n, numel), param_dtype=dtype, moments=False)
    params = [torch.nn.Parameter(p) for p in inp.params]
    for p, g in zip(params, inp.grads):
        p.grad = g
    return params


def require_real_device(device):
    if device == "meta":
        raise Skip("the optimizer APIs need real tensors")


def start_iteration(scaler, device):
    # An iteration starts with scale(): the scaler creates its scale on the device there.
    scaler.scale(torch.ones((), device=device))


def fusedamp_whole_step(clip, lean=False, telemetry=True, new_grads=False):
    def build(device, n, numel):
        require_real_device(device)
        import fusedamp
        import fusedamp.optim
        params = model_params(device, n, numel, torch.float16)
        options = dict(LEAN_OPTIONS) if lean else {}
        if clip:
            options["max_grad_norm"] = MAX_GRAD_NORM
        try:
            opt = fusedamp.optim.AdamW(params, lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]),
                                       eps=ADAM["eps"], weight_decay=ADAM["weight_decay"],
                                       **options)
        except (TypeError, ValueError) as e:
            refused = sorted(LEAN_OPTIONS if lean else options)
            raise Skip(f"the installed fusedamp.optim.AdamW refuses {refused} ({e})") from e
        try:
            scaler = fusedamp.GradScaler(device, init_scale=LOSS_SCALE, telemetry=telemetry)
        except TypeError as e:
            raise Skip(f"the installed fusedamp.GradScaler has no telemetry switch ({e})") from e
        start_iteration(scaler, device)

        def call():
            scaler.step(opt)
            scaler.update()
        return Timed(call, renew(params) if new_grads else refill([p.grad for p in params]))
    return build


def torch_whole_step(clip, new_grads=False):
    def build(device, n, numel):
        require_real_device(device)
        params = model_params(device, n, numel, torch.float32)
        opt = torch.optim.AdamW(params, lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]),
                                eps=ADAM["eps"], weight_decay=ADAM["weight_decay"], fused=True)
        scaler = torch.amp.GradScaler(device, init_scale=LOSS_SCALE)
        start_iteration(scaler, device)

        def call():
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM, foreach=True)
            scaler.step(opt)
            scaler.update()
        return Timed(call, renew(params) if new_grads else refill([p.grad for p in params]))
    return build


# ----------------------------------------------------------------------------- the rows
TORCH_ADAMW_OP = Side("torch_fused_adamw", "`torch._fused_adamw_`", "FP32", torch_fused_adamw)
TORCH_STEP = Side("torch_step", "torch.amp.GradScaler + torch.optim.AdamW(fused=True)", "FP32",
                  torch_whole_step(clip=False))
TORCH_STEP_CLIP = Side("torch_step_clip", "torch.amp.GradScaler + unscale_ + "
                       "clip_grad_norm_(foreach=True) + torch.optim.AdamW(fused=True)", "FP32",
                       torch_whole_step(clip=True))
MIXED_DTYPE = "FP16 params + FP32 masters"
MIXED = dict(param_dtype=torch.float16, master_weights=True,
             scalars=dict(found_inf=0.0, inv_scale=1.0 / LOSS_SCALE))

TORCH_UNSCALE = Side("torch_unscale", "`_amp_foreach_non_finite_check_and_unscale_`",
                     "FP16 grads", torch_unscale)
ADAMW_MIXED_NOTE = "inv_scale + found_inf; torch: grad_scale + found_inf"

ROWS = [
    Row("unscale op", TORCH_UNSCALE,
        Side("fusedamp_unscale", "`fusedamp.ops.unscale_and_check_`", "FP16 grads",
             fusedamp_op("unscale_and_check_", **MIXED)), "op"),
    Row("unscale op, through torch.ops", TORCH_UNSCALE,
        Side("fusedamp_unscale_boxed", "`torch.ops.fusedamp.unscale_and_check_`", "FP16 grads",
             fusedamp_op("unscale_and_check_", via_torch_ops=True, **MIXED)), "reference",
        "torch's boxed path for custom operators"),
    Row("AdamW op, mixed precision", TORCH_ADAMW_OP,
        Side("fusedamp_adam_mixed", "`fusedamp.ops.adam_step_`", MIXED_DTYPE,
             fusedamp_op("adam_step_", **MIXED)), "op", ADAMW_MIXED_NOTE),
    Row("AdamW op, mixed precision, through torch.ops", TORCH_ADAMW_OP,
        Side("fusedamp_adam_mixed_boxed", "`torch.ops.fusedamp.adam_step_`", MIXED_DTYPE,
             fusedamp_op("adam_step_", via_torch_ops=True, **MIXED)), "reference",
        ADAMW_MIXED_NOTE + "; torch's boxed path for custom operators"),
    Row("AdamW op, FP32", TORCH_ADAMW_OP,
        Side("fusedamp_adam_fp32", "`fusedamp.ops.adam_step_`", "FP32, no masters",
             fusedamp_op("adam_step_", param_dtype=torch.float32,
                         scalars=dict(found_inf=0.0, inv_scale=1.0 / LOSS_SCALE))), "op"),
    Row("grad stats",
        Side("torch_norm_check", "`_foreach_norm` + the check (inv_scale 1)", "FP16 grads",
             torch_norm_and_check),
        Side("fusedamp_grad_stats", "`fusedamp.ops.grad_stats_`", "FP16 grads",
             fusedamp_op("grad_stats_", param_dtype=torch.float16,
                         scalars=dict(found_inf=0.0, grad_sum_sq=0.0))), "op",
        "torch has no single op: its pair"),
    Row("whole AMP step", TORCH_STEP,
        Side("fusedamp_step", "fusedamp.GradScaler + fusedamp.optim.AdamW", MIXED_DTYPE,
             fusedamp_whole_step(clip=False)), "step"),
    Row("whole AMP step, telemetry off", TORCH_STEP,
        Side("fusedamp_step_no_telemetry", "fusedamp.GradScaler(telemetry=False) + "
             "fusedamp.optim.AdamW", MIXED_DTYPE, fusedamp_whole_step(clip=False,
                                                                   telemetry=False)), "step"),
    Row("whole AMP step, clipping", TORCH_STEP_CLIP,
        Side("fusedamp_step_clip", "fusedamp.GradScaler + fusedamp.optim.AdamW("
             "max_grad_norm=1.0)", MIXED_DTYPE, fusedamp_whole_step(clip=True)), "step"),
    Row("whole AMP step, new gradients each call",
        Side("torch_step_new_grads", "torch.amp.GradScaler + torch.optim.AdamW(fused=True)",
             "FP32", torch_whole_step(clip=False, new_grads=True)),
        Side("fusedamp_step_new_grads", "fusedamp.GradScaler + fusedamp.optim.AdamW",
             MIXED_DTYPE, fusedamp_whole_step(clip=False, new_grads=True)), "step",
        "each parameter gets a new gradient tensor before each call, as after "
        "zero_grad(set_to_none=True) and a backward; the other rows refill the same tensors"),
    Row("whole AMP step, lean", TORCH_STEP,
        Side("fusedamp_step_lean", "fusedamp.GradScaler + fusedamp.optim.AdamW("
             "adopt_param_edits=False, write_back_grads=False)",
             MIXED_DTYPE, fusedamp_whole_step(clip=False, lean=True)), "step"),
    Row("whole AMP step, lean, clipping", TORCH_STEP_CLIP,
        Side("fusedamp_step_lean_clip", "fusedamp.GradScaler + fusedamp.optim.AdamW("
             "adopt_param_edits=False, write_back_grads=False, max_grad_norm=1.0)",
             MIXED_DTYPE, fusedamp_whole_step(clip=True, lean=True)), "step"),
]


# ----------------------------------------------------------------------------- timing
FAILURES = (Skip, RuntimeError, TypeError, ValueError, AttributeError)


def skipped(e):
    """Why a side has no number: a Skip's reason, or the first line of what failed (an older
    build without an op or an argument)."""
    if isinstance(e, Skip):
        return {"skipped": str(e)}
    return {"skipped": f"failed: {type(e).__name__}: {str(e).splitlines()[0]}"}


def time_interleaved(timed: dict, device, reps, warmup):
    """{key: [wall ns of each call], [CUDA-event ns of each call] or None} for the sides in
    `timed`, called in turn: repetition r calls every side once, so every side sees the same
    machine (another process, a frequency change) instead of each its own stretch of time; in
    a new random order each round (seeded), so every side also sees the same cache states: a
    call finds in cache what the call before it left, and in a fixed cycle each side would
    always follow the same one (the fusedamp step torch's Python loop, its telemetry-off twin
    the fusedamp step itself, with the engine's code still hot). The stream is drained before
    each call, so the wall time is what issuing it costs the host. The garbage collector is off
    while timing, as in timeit: a collection is noise, not a cost of the call."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    keys = list(timed)
    wall = {k: [] for k in keys}
    events = {k: [] for k in keys}
    for _ in range(warmup):  # the first step also creates the optimizer state
        for k in keys:
            timed[k].reset()
            timed[k].call()
    sync()
    gc.collect()
    gc.disable()
    try:
        order = random.Random(ORDER_SEED)
        for _ in range(reps):
            for k in order.sample(keys, len(keys)):
                timed[k].reset()
                sync()
                if cuda:
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                t0 = time.perf_counter_ns()
                timed[k].call()
                wall[k].append(time.perf_counter_ns() - t0)
                if cuda:
                    end.record()
                    events[k].append((start, end))
        sync()
    finally:
        gc.enable()
    return {k: (wall[k], [a.elapsed_time(b) * 1e6 for a, b in events[k]] if cuda else None)
            for k in keys}


def build_and_warm(side: Side, device, n, numel):
    """The side's Timed, called once (a side that cannot run fails here, not mid-timing)."""
    timed = side.build(device, n, numel)
    timed.reset()
    timed.call()
    return timed


def run(device, tensors, numel, reps, warmup, log):
    results = []
    for n in tensors:
        sides = list({side.key: side for row in ROWS
                      for side in (row.torch, row.fusedamp)}.values())
        timed, measured = {}, {}
        for side in sides:
            log(f"  N={n}: building {side.key}")
            try:
                timed[side.key] = build_and_warm(side, device, n, numel)
            except FAILURES as e:
                measured[side.key] = skipped(e)
        log(f"  N={n}: timing {len(timed)} sides, {reps} rounds")
        for key, (wall, event) in time_interleaved(timed, device, reps, warmup).items():
            ns = statistics.median(wall)
            quartiles = statistics.quantiles(wall, n=4)
            measured[key] = {"ns_per_call": ns, "ns_per_tensor": ns / n,
                             "ns_per_call_p25": quartiles[0], "ns_per_call_p75": quartiles[2]}
            if event is not None:
                measured[key]["event_ns_per_call"] = statistics.median(event)
        del timed
        gc.collect()
        bare_adamw = measured.get(TORCH_ADAMW_OP.key, {})
        for row in ROWS:
            results.append(row_result(row, n, measured, bare_adamw))
    return results


def row_result(row, n, measured, bare_adamw):
    """One row of the table: both sides, the ratio, and the issue-13 target it is held to."""
    fa, th = measured[row.fusedamp.key], measured[row.torch.key]
    out = {"row": row.title, "tensors": n, "note": row.note,
           "torch": dict(th, key=row.torch.key, label=row.torch.label, dtype=row.torch.dtype),
           "fusedamp": dict(fa, key=row.fusedamp.key, label=row.fusedamp.label,
                            dtype=row.fusedamp.dtype)}
    if "ns_per_tensor" in fa and "ns_per_tensor" in th:
        out["ratio"] = fa["ns_per_tensor"] / th["ns_per_tensor"]
    if row.target == "op" and "ratio" in out:
        out["target"] = {"against": f"torch's {row.torch.label}", "limit": OP_TARGET,
                         "ratio": out["ratio"], "met": out["ratio"] <= OP_TARGET}
    elif row.target == "step" and "ns_per_tensor" in fa and "ns_per_tensor" in bare_adamw:
        ratio = fa["ns_per_tensor"] / bare_adamw["ns_per_tensor"]
        out["target"] = {"against": f"torch's bare {TORCH_ADAMW_OP.label}", "limit": STEP_TARGET,
                         "ratio": ratio,
                         "met": ratio <= STEP_TARGET}
    return out


# ----------------------------------------------------------------------------- report
def ns_cell(side, field="ns_per_tensor", scale=1.0, digits=0):
    if field not in side:
        return "—"
    return f"{side[field] / scale:,.{digits}f}"


def side_name(side):
    return f"{side['label']} ({side['dtype']})"


def markdown(info, results, args, command):
    cuda = args.device == "cuda"
    per_side = ["ns/tensor", "µs/call"] + (["event µs/call"] if cuda else [])
    head = (["row", "N"] + [f"torch {h}" for h in per_side] + [f"fusedamp {h}" for h in per_side]
            + ["fusedamp/torch", "target (per tensor)", "met"])
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if h in ("row", "target (per tensor)", "met") else "--:"
                           for h in head) + "|"]
    legend, skipped = {}, {}  # each once, not once per N
    for r in results:
        legend.setdefault(r["row"], f"- **{r['row']}**: {side_name(r['torch'])} vs "
                          f"{side_name(r['fusedamp'])}"
                          + (f"; {r['note']}" if r["note"] else ""))
        cells = [r["row"], f"{r['tensors']:,}"]
        for name in ("torch", "fusedamp"):
            side = r[name]
            cells += [ns_cell(side), ns_cell(side, "ns_per_call", 1e3, 1)]
            if cuda:
                cells.append(ns_cell(side, "event_ns_per_call", 1e3, 1))
            if "skipped" in side:
                skipped.setdefault(f"- {name} {side['label']}: {side['skipped']}")
        cells.append(f"{r['ratio']:.2f}" if "ratio" in r else "—")
        t = r.get("target")
        cells += ([f"{t['ratio']:.2f} ≤ {t['limit']} × {t['against']}",
                   "yes" if t["met"] else "no"] if t else ["—", "—"])
        lines.append("| " + " | ".join(cells) + " |")
    timing = ("wall time of issuing one call; event: its CUDA-event time" if cuda
              else "wall time of one call")
    out = [f"# Host overhead per tensor: fusedamp vs torch ({info['device']})", "",
           f"`{command}`", "",
           f"{args.numel}-element tensors, torch threads {info['torch_threads']}, median of "
           f"{args.reps} calls after {args.warmup} warm-up calls ({timing}); the sides are "
           "called in turn, one call each per round, in a new random order each round (seed "
           f"{ORDER_SEED}). Gradients refilled from a pristine copy "
           "before each call, outside the timed region. Targets, "
           f"per tensor: an op ≤ {OP_TARGET} × its torch counterpart; a whole step ≤ "
           f"{STEP_TARGET} × torch's bare `_fused_adamw_` at the same N.", "", *lines, "",
           "Rows:", *legend.values(), ""]
    if skipped:
        out += ["Not measured:", *skipped, ""]
    out += ["Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), ""]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "meta"])
    ap.add_argument("--tensors", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--numel", type=int, default=1, help="elements per tensor")
    ap.add_argument("--reps", type=int, default=41, help="rounds: timed calls of each side")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--out", default=str(HERE / "results"), help="where the .md/.json go")
    ap.add_argument("--no-files", action="store_true", help="print the table only")
    args = ap.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_host_overhead: --device cuda, but CUDA is not available here (no GPU); "
              "skipped, nothing written.")
        return 0
    import fusedamp  # registers torch.ops.fusedamp

    torch.set_num_threads(args.threads)
    info = machine_info(args.device)
    # The commit is the source tree's HEAD; the library may have been built before it.
    built = [p.stat().st_mtime for p in Path(fusedamp.__file__).parent.glob("_C*.so")]
    if built:
        info["fusedamp_library_built_utc"] = _dt.datetime.fromtimestamp(
            max(built), _dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "python3 " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:])
    results = run(args.device, args.tensors, args.numel, args.reps, args.warmup,
                  lambda s: print(s, file=sys.stderr, flush=True))
    table = markdown(info, results, args, command)
    print(table)
    if not args.no_files:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"host_overhead_{device_tag(args.device) if args.device != 'meta' else 'meta'}"
        stem.with_suffix(".md").write_text(table)
        stem.with_suffix(".json").write_text(json.dumps(
            {"machine": info, "command": command, "numel": args.numel, "reps": args.reps,
             "warmup": args.warmup, "loss_scale": LOSS_SCALE, "max_grad_norm": MAX_GRAD_NORM,
             "rows": results}, indent=1))
        print(f"wrote {stem}.md and .json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
