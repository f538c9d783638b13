"""Host overhead per tensor of the fusedamp ops (many small tensors).

Times grad_stats_, adam_step_ and the whole step (+ update_scale_) (FP16 params, FP32 master weights, inv_scale + found_inf as
in a GradScaler step) on N tensors of M elements, and reports the median over reps in ns per
tensor per op. With --meta it also times the same calls on meta tensors: the Meta kernels run
only the argument checks (op_checks.cpp), which isolates their cost from the kernels'.

    PYTHONPATH=python python3 benchmarks/bench_host_overhead.py [--tensors 10000 --numel 64]
"""
import argparse
import os
import statistics
import sys
import time

import torch

import fusedamp  # noqa: F401  (loads the ops)

# The op tests' input builder: the benchmark times the inputs the tests check.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "python"))
from op_inputs import op_inputs  # noqa: E402


def time_ns(fn, reps, inner):
    fn()  # warm-up
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter_ns() - t0) / inner)
    return statistics.median(samples)


def bench(device, n, numel, reps, inner):
    inp = op_inputs(device, [(numel,)] * n, param_dtype=torch.float16, master_weights=True,
                    loss_scale=1.0, scalars=dict(found_inf=0.0, grad_sum_sq=0.0, inv_scale=1.0))
    stats = inp.bind("grad_stats_")
    adam = inp.bind("adam_step_", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                    decoupled_weight_decay=True)
    update_scale = inp.bind("update_scale_", growth_factor=2.0, backoff_factor=0.5,
                            growth_interval=2000)

    def step():  # a whole AdamW step as bench_step.py times it (the scalars' resets aside)
        stats()
        adam()
        update_scale()

    out = {}
    for name, fn in (("grad_stats_", stats), ("adam_step_", adam), ("whole step", step)):
        out[name] = time_ns(fn, reps, inner) / n
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=10000)
    ap.add_argument("--numel", type=int, default=64)
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--meta", action="store_true", help="also time the checks alone (meta)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: keep)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = ["cpu"] + (["meta"] if args.meta else [])
    print(f"{args.tensors} tensors x {args.numel} elements, FP16 params + FP32 master, "
          f"torch threads {torch.get_num_threads()}, median of {args.reps}x{args.inner}")
    print(f"{'device':<6} {'op':<12} {'ns/tensor':>10} {'ms/call':>9}")
    for device in devices:
        res = bench(device, args.tensors, args.numel, args.reps, args.inner)
        for op, ns in res.items():
            print(f"{device:<6} {op:<12} {ns:>10.1f} {ns * args.tensors / 1e6:>9.3f}")


if __name__ == "__main__":
    main()
