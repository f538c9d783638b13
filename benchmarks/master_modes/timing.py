"""The master-weight modes benchmark's step time: each row's optimizer stepped on the parameter
shapes of resnet50 and GPT-2 small (or both shrunk), its state measured, its rate of moving
bytes against the baseline row's time."""
from __future__ import annotations

import gc
import statistics
import sys
import time

import torch

from harness.model_shapes import BUILT_IN, SizeSpec, gpt2_shapes, resnet50_shapes, split
from harness.timing import fmt_ms, percentile, sync, time_in_turns
from master_modes.rows import Row, short_error
from step.configs import GRAD_STD

QUICK_SHRINK = 8


def _shrink(shapes, f):
    """Every dimension of 16 or more divided by f: same tensor count, same set of distinct
    shapes (torchao compiles once per shape), about f**2 fewer parameters."""
    return [tuple(d // f if d >= 16 else d for d in s) for s in shapes]


def all_sizes() -> dict[str, SizeSpec]:
    sizes = [SizeSpec("resnet50", resnet50_shapes(), BUILT_IN),
             SizeSpec("gpt2-124M", gpt2_shapes(), BUILT_IN)]
    for s in list(sizes):
        sizes.append(SizeSpec(f"{s.name}/{QUICK_SHRINK}", _shrink(s.shapes, QUICK_SHRINK),
                              f"{s.name} with every dimension >= 16 divided by {QUICK_SHRINK}"))
    return {s.name: s for s in sizes}


def measured_state_bytes(opt) -> float:
    """Bytes of every tensor held in optimizer.state (scalars included), per parameter."""
    n = sum(p.numel() for g in opt.param_groups for p in g["params"])

    def nbytes(t):
        # A tensor subclass (torchao's quantized state) is counted by the tensors it holds.
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            return sum(nbytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
        return t.numel() * t.element_size()
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                total += nbytes(v)
    return total / max(n, 1)


def time_row(row: Row, size: SizeSpec, w, g, device, hyper, reps, warmup) -> dict:
    params = [torch.nn.Parameter(t) for t in split(w, size.shapes, row.param_dtype, device)]
    grads = split(g, size.shapes, row.param_dtype, device)
    pristine = [x.clone() for x in grads]
    for p, gr in zip(params, grads):
        p.grad = gr
    opt = row.build(params, hyper)

    def restore():
        torch._foreach_copy_(grads, pristine)

    restore()
    sync(device)
    t0 = time.perf_counter()
    opt.step()  # state allocation (and compilation for torchao)
    sync(device)
    first = time.perf_counter() - t0
    for _ in range(warmup):
        restore()
        opt.step()
    probe = max(params, key=lambda t: t.numel())
    before = probe.detach().clone()
    # perf_counter between two synchronizations: on CUDA the host overhead is included.
    wall, _ = time_in_turns({"step": opt.step}, reps, reset={"step": restore}, device=device,
                            until_done=True)["step"]
    times = [t / 1e9 for t in wall]
    changed = not torch.equal(before, probe.detach())
    state_measured = measured_state_bytes(opt)
    del opt, params, grads, pristine, before
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"row": row.key, "size": size.name, "reps": reps, "warmup": warmup,
            "median_s": statistics.median(times), "p10_s": percentile(times, 0.1),
            "p90_s": percentile(times, 0.9), "first_step_s": first, "times_s": times,
            "state_bytes_measured": state_measured, "weight_changed": changed}


def run_timing(args, rows, sizes, device, hyper):
    results, failures = [], []
    for size in sizes:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(size.numel, generator=gen) * 0.02
        g = torch.randn(size.numel, generator=gen) * GRAD_STD
        for row in rows:
            label = f"{size.name:>14} | {row.key:<36}"
            if row.unavailable:
                failures.append({"row": row.key, "size": size.name, "error": row.unavailable})
                print(f"{label} skipped: {row.unavailable}", file=sys.stderr, flush=True)
                continue
            try:
                r = time_row(row, size, w, g, device, hyper, args.reps, args.warmup)
                results.append(r)
                print(f"{label} {fmt_ms(r['median_s']):>8} ms   first step "
                      f"{r['first_step_s']:.2f} s", file=sys.stderr, flush=True)
            except Exception as e:  # record and go on
                failures.append({"row": row.key, "size": size.name, "error": short_error(e)})
                print(f"{label} failed: {short_error(e)}", file=sys.stderr, flush=True)
            gc.collect()
        del w, g
        gc.collect()
    base = {r["size"]: r for r in results if r["row"] == next(x.key for x in rows if x.baseline)}
    moved = {row.key: row.moved_as_implemented() for row in rows}
    numel = {size.name: size.numel for size in sizes}
    for r in results:
        b = base.get(r["size"])
        r["vs_baseline"] = r["median_s"] / b["median_s"] if b else None
        r["achieved_bytes_per_s"] = moved[r["row"]] * numel[r["size"]] / r["median_s"]
    return results, failures
