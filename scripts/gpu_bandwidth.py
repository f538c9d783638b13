#!/usr/bin/env python3
"""Achieved memory bandwidth of the fused AdamW step on the GPU, against a plain copy.

    PYTHONPATH=python python3 scripts/gpu_bandwidth.py [--params 100e6] [--json FILE]

Model: FP16 parameters with FP32 master weights and FP32 moments, FP16 gradients (the
DESIGN.md case). Bytes counted are the ideal traffic of each kernel (cuda/adam_kernel.cu):
adam_step_ reads 14 and writes 14 bytes per parameter; the whole step adds grad_stats_'s
2-byte read (30 bytes per parameter). The reference is a large device-to-device copy (bytes
read + bytes written). Times are CUDA-event medians of back-to-back repetitions. Prints one
JSON line last (also written to --json).
"""
import argparse
import json
import os
import statistics
import sys

import torch


def load_ops():
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "python"))
    try:
        import fusedamp  # noqa: F401  (loads libfusedamp, registers torch.ops.fusedamp)
    except Exception as e:  # the Python package may be mid-change; the library is enough
        lib = os.path.join(here, "..", "python", "fusedamp", "lib", "libfusedamp.so")
        print(f"gpu_bandwidth: import fusedamp failed ({e!r}); loading {lib}", file=sys.stderr)
        torch.ops.load_library(lib)
    return torch.ops.fusedamp


def time_ms(fn, reps):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--tensors", type=int, default=8, help="split the parameters over N tensors")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--copy-mib", type=int, default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_bandwidth: no CUDA device", file=sys.stderr)
        return 2
    ops = load_ops()
    n = int(args.params)
    # Uneven split, realistic for a model (and not all tensors a multiple of the chunk).
    weights = [2 ** (i % 4) for i in range(args.tensors)]
    sizes = [n * w // sum(weights) for w in weights]
    sizes[-1] += n - sum(sizes)
    dev = "cuda"
    master = [torch.randn(s, device=dev) for s in sizes]
    params = [m.half() for m in master]
    grads = [torch.randn(s, device=dev, dtype=torch.float16) for s in sizes]
    m = [torch.zeros(s, device=dev) for s in sizes]
    v = [torch.zeros(s, device=dev) for s in sizes]
    steps = [torch.zeros((), device=dev) for _ in sizes]
    found, sq = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    inv = torch.full((1,), 1 / 1024.0, device=dev)
    scale = torch.full((1,), 1024.0, device=dev)
    gt = torch.zeros(1, dtype=torch.int32, device=dev)
    ht = torch.ones(1, dtype=torch.int32, device=dev)
    kw = dict(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
              decoupled_weight_decay=True, inv_scale=inv, found_inf=found)

    def adam():
        ops.adam_step_(params, master, grads, m, v, steps, **kw)

    def whole_step():
        found.zero_()
        sq.zero_()
        ops.grad_stats_(grads, found, sq)
        ops.adam_step_(params, master, grads, m, v, steps, **kw, grad_sum_sq=sq,
                       max_grad_norm=1e9)
        ops.update_scale_(scale, gt, ht, found, 2.0, 0.5, 2000)

    adam_ms = time_ms(adam, args.reps)
    step_ms = time_ms(whole_step, args.reps)
    del master, params, grads, m, v
    torch.cuda.empty_cache()
    nbytes = args.copy_mib << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), args.reps)

    gbps = lambda b, ms: b / (ms * 1e-3) / 1e9  # noqa: E731
    res = {
        "params": n,
        "adam_ms": round(adam_ms, 4),
        "adam_gbps": round(gbps(28 * n, adam_ms), 1),
        "step_ms": round(step_ms, 4),
        "step_gbps": round(gbps(30 * n, step_ms), 1),
        "copy_mib": args.copy_mib,
        "copy_gbps": round(gbps(2 * nbytes, copy_ms), 1),
        "device": torch.cuda.get_device_name(),
    }
    res["adam_vs_copy"] = round(res["adam_gbps"] / res["copy_gbps"], 3)
    line = json.dumps(res)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
