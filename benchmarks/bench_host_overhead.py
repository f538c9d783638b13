"""Host overhead per tensor of the fusedamp ops (many small tensors).

Times grad_stats_, adam_step_ and the whole step (+ update_scale_) (FP16 params, FP32 master weights, inv_scale + found_inf as
in a GradScaler step) on N tensors of M elements, and reports the median over reps in ns per
tensor per op. With --meta it also times the same calls on meta tensors: the Meta kernels run
only the argument checks (op_checks.cpp), which isolates their cost from the kernels'.

    PYTHONPATH=python python3 benchmarks/bench_host_overhead.py [--tensors 10000 --numel 64]
"""
import argparse
import statistics
import time

import torch

import fusedamp  # noqa: F401  (loads the ops)

ops = torch.ops.fusedamp


def make_state(n, numel, device, dtype=torch.float16):
    gen = torch.Generator().manual_seed(0)
    master = [torch.randn(numel, generator=gen).to(device) for _ in range(n)]
    params = [m.to(dtype) for m in master]
    grads = [torch.randn(numel, generator=gen).to(device=device, dtype=dtype) for _ in range(n)]
    exp_avg = [torch.zeros_like(m) for m in master]
    exp_avg_sq = [torch.zeros_like(m) for m in master]
    steps = [torch.zeros((), device=device) for _ in range(n)]
    f32 = dict(dtype=torch.float32, device=device)
    st = dict(found_inf=torch.zeros(1, **f32), sum_sq=torch.zeros(1, **f32),
              inv_scale=torch.full((1,), 1.0, **f32), scale=torch.full((1,), 1.0, **f32),
              growth=torch.zeros(1, dtype=torch.int32, device=device),
              hyst=torch.ones(1, dtype=torch.int32, device=device))
    return params, master, grads, exp_avg, exp_avg_sq, steps, st


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
    params, master, grads, m, v, steps, st = make_state(n, numel, device)

    def stats():
        ops.grad_stats_(grads, st["found_inf"], st["sum_sq"])

    def adam():
        ops.adam_step_(params, master, grads, m, v, steps, lr=1e-3, beta1=0.9, beta2=0.999,
                       eps=1e-8, weight_decay=0.01, decoupled_weight_decay=True,
                       inv_scale=st["inv_scale"], found_inf=st["found_inf"])

    def step():  # a whole AdamW step as bench_step.py times it (the scalars' resets aside)
        stats()
        adam()
        ops.update_scale_(st["scale"], st["growth"], st["hyst"], st["found_inf"], 2.0, 0.5, 2000)

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
