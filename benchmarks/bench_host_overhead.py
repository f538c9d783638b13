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
its schema has; a row it cannot run says why instead of a number. The sides are built in
host_overhead/sides.py, the rows and their timing are in host_overhead/rows.py, the table in
host_overhead/report.py.
"""
from __future__ import annotations

import sys

import torch

from harness import results as res
from harness.machine import device_tag, library_built_utc, machine_info
from host_overhead.report import markdown
from host_overhead.rows import run
from host_overhead.sides import LOSS_SCALE, MAX_GRAD_NORM


def main(argv=None):
    ap = res.parser(__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "meta"])
    ap.add_argument("--tensors", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--numel", type=int, default=1, help="elements per tensor")
    ap.add_argument("--reps", type=int, default=41, help="rounds: timed calls of each side")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    res.add_output(ap)
    args = ap.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_host_overhead: --device cuda, but CUDA is not available here (no GPU); "
              "skipped, nothing written.")
        return 0
    import fusedamp  # noqa: F401  (registers torch.ops.fusedamp)

    torch.set_num_threads(args.threads)
    info = machine_info(args.device)
    built = library_built_utc()
    if built:
        info["fusedamp_library_built_utc"] = built
    command = res.command(__file__, argv)
    results = run(args.device, args.tensors, args.numel, args.reps, args.warmup,
                  lambda s: print(s, file=sys.stderr, flush=True))
    table = markdown(info, results, args, command)
    print(table)
    out = res.out_dir(args)
    if out is not None:
        tag = device_tag(args.device) if args.device != "meta" else "meta"
        res.write_results(out, f"host_overhead_{tag}", {
            "machine": info, "command": command, "numel": args.numel, "reps": args.reps,
            "warmup": args.warmup, "loss_scale": LOSS_SCALE, "max_grad_norm": MAX_GRAD_NORM,
            "rows": results}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
