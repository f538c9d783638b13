#!/usr/bin/env python3
"""Step-time overhead of fusedamp.debug.watch against the usual ways to find a NaN.

One FP32 training step (forward, backward, SGD step) of a small GPT-2 and of ResNet-18, four ways:

  plain              no instrumentation
  fusedamp watch     fusedamp.debug.watch(model): per module, grad_stats_ on inputs, outputs and
                     produced/received gradients, into a device ring, no host synchronisation
  watch, no stats    the same watch with its grad_stats_ calls left out: its hooks' Python alone
                     (what the statistics kernel costs is the difference to the full watch)
  isfinite hooks     what one writes by hand: a forward hook on every module raising where
                     ``not torch.isfinite(output).all()``, and a tensor hook doing the same for
                     the gradient w.r.t. each output (one host synchronisation per check)
  detect_anomaly     torch.autograd.detect_anomaly(): NaN checks of every backward op's
                     outputs, plus the forward traceback recorded for each op

The variants run interleaved, step by step, so that a busy shared machine slows them alike; the
table gives each one's median step time, its ratio to the plain step's, and the median of its
per-round ratios to the plain step of the same round, in wall-clock time and in the process's
CPU time (time.process_time: with one torch thread, the work done, without the time the step
spent descheduled by other processes, which on a shared machine moves wall-clock ratios by
several percent).

    PYTHONPATH=python python3 benchmarks/bench_debug.py [--steps 20] [--out benchmarks/results]
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

import torch

import harness
from harness import results as res
from harness.machine import machine_info
from harness.timing import paired_ratio

harness.use_paths("python")
import fusedamp  # noqa: E402


def gpt2():
    import transformers
    config = transformers.GPT2Config(vocab_size=512, n_positions=128, n_embd=128, n_layer=4,
                                     n_head=4)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 512, (4, 128))
    return model, lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss, \
        "GPT-2 (n_layer 4, n_embd 128, vocab 512), batch 4 x 128 tokens"


def resnet18():
    import torchvision
    model = torchvision.models.resnet18(num_classes=10)
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))
    return model, lambda m: torch.nn.functional.cross_entropy(m(x), y), \
        "ResNet-18 (torchvision, 10 classes), batch 8 x 3 x 64 x 64"


class IsfiniteHooks:
    """The hand-written check: raise at the first module whose output or output gradient holds
    inf/NaN."""

    def __init__(self, model):
        self.handles = [m.register_forward_hook(self._forward) for _, m in model.named_modules()]

    @staticmethod
    def _tensors(out):
        if isinstance(out, torch.Tensor):
            return [out] if out.is_floating_point() else []
        if isinstance(out, (tuple, list)):
            return [t for o in out for t in IsfiniteHooks._tensors(o)]
        if isinstance(out, dict):
            return [t for o in out.values() for t in IsfiniteHooks._tensors(o)]
        return []

    def _forward(self, module, args, out):
        for t in self._tensors(out):
            if not torch.isfinite(t).all():
                raise FloatingPointError(f"non-finite output of {type(module).__name__}")
            if t.requires_grad:
                t.register_hook(self._backward)

    @staticmethod
    def _backward(grad):
        if not torch.isfinite(grad).all():
            raise FloatingPointError("non-finite gradient")

    def remove(self):
        for h in self.handles:
            h.remove()


VARIANTS = ("plain", "fusedamp watch", "watch, no stats", "isfinite hooks", "detect_anomaly")


def attach(variant, model):
    """The function that detaches the variant's instrumentation from model."""
    if variant == "fusedamp watch":
        return fusedamp.debug.watch(model).remove
    if variant == "watch, no stats":
        w = fusedamp.debug.watch(model)
        # the watch's one statistics call site, replaced by its host-side bookkeeping only
        w._measure = lambda it, slot, tensors: it.measured(slot, tensors)
        return w.remove
    if variant == "isfinite hooks":
        return IsfiniteHooks(model).remove
    return lambda: None


def measure(build, steps, warmup):
    models = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        model, loss_fn, description = build()
        models[variant] = (model, torch.optim.SGD(model.parameters(), lr=1e-3), loss_fn)
    detach = [attach(v, models[v][0]) for v in VARIANTS]
    times = {clock: {v: [] for v in VARIANTS} for clock in CLOCKS}
    for step in range(warmup + steps):
        for v in VARIANTS:
            model, opt, loss_fn = models[v]
            start = {clock: read() for clock, read in CLOCKS.items()}
            with (torch.autograd.detect_anomaly() if v == "detect_anomaly"
                  else contextlib.nullcontext()):
                loss_fn(model).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step >= warmup:
                for clock, read in CLOCKS.items():
                    times[clock][v].append((read() - start[clock]) * 1e3)
    for d in detach:
        d()
    # Paired: each variant against the plain step of the same round, so that the machine's
    # load, which drifts over a run, cancels out.
    return description, {clock: {
        "median_ms": {v: statistics.median(t) for v, t in by_variant.items()},
        "median_paired_ratio": {v: paired_ratio(t, by_variant["plain"])
                                for v, t in by_variant.items()}}
        for clock, by_variant in times.items()}


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def main(argv=None):
    ap = res.parser(__doc__)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (1 on a loaded shared machine: OpenMP threads "
                         "waiting for a descheduled peer dominate the times otherwise)")
    res.add_output(ap)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    results = []
    for name, build in (("gpt2", gpt2), ("resnet18", resnet18)):
        description, clocks = measure(build, args.steps, args.warmup)
        results.append({"model": name, "description": description, **clocks})
        print(description)
        for v in VARIANTS:
            print(f"  {v:<16s}" + "".join(
                f"  {c}: {clocks[c]['median_ms'][v]:8.2f} ms paired "
                f"x{clocks[c]['median_paired_ratio'][v]:.3f}" for c in CLOCKS))
    m = machine_info("cpu")
    header = (f"{m['date_utc']}, fusedamp {m['fusedamp_commit']}, {m['cpu']} "
              f"({', '.join(m['cpu_flags'])}; {m['cpu_cores']} cores, {m['torch_threads']} "
              f"threads), torch {m['torch']}. FP32 step (forward, backward, SGD), median of "
              f"{args.steps} steps after {args.warmup}, variants interleaved step by step. "
              f"Load average over the run (the machine is shared): "
              f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after.")
    lines = ["# fusedamp.debug.watch: step-time overhead (CPU)", "",
             f"`PYTHONPATH=python python3 benchmarks/bench_debug.py --steps {args.steps}"
             f"{f' --threads {args.threads}' if args.threads else ''}`", "",
             header, ""]
    rows = []
    for r in results:
        for v in VARIANTS:
            cells = [r["description"], v]
            for c in CLOCKS:
                ms = r[c]["median_ms"]
                cells += [f"{ms[v]:.1f}", f"{ms[v] / ms['plain']:.3f}",
                          f"{r[c]['median_paired_ratio'][v]:.3f}"]
            rows.append(cells)
    lines += res.table(["model", "variant", "step ms (median)", "/ plain",
                        "paired ratio (median)", "CPU ms (median)", "/ plain",
                        "paired CPU ratio (median)"], "llrrrrrr", rows, compact=True)
    out = res.out_dir(args)
    if out is not None:
        res.write_results(out, "debug_cpu", {"header": header, "results": results},
                          "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
