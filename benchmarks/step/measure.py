"""The step benchmark's sizes and its measurement of one configuration: warm-up, a repetition
count from the time budget, the timed steps in turns with the gradients restored between them,
and the memory-copy bandwidth every configuration's traffic is compared with."""
from __future__ import annotations

import gc
import statistics

import torch

from harness.model_shapes import SizeSpec, gpt2_shapes, model_sizes
from harness.timing import percentile, sync, time_in_turns
from step.configs import BYTES_PER_PARAM, DT, Config, Runner


def make_sizes(device: str, only: list[str] | None) -> list[SizeSpec]:
    sizes = [SizeSpec("10000x64", [(64,)] * 10000, "synthetic"),
             SizeSpec("1000x1024", [(1024,)] * 1000, "synthetic"),
             SizeSpec("8x1024x1024", [(1024, 1024)] * 8, "synthetic")] + model_sizes()
    if device == "cuda":
        sizes.append(SizeSpec("gpt-1B", gpt2_shapes(d=2048, layers=18),
                              "built-in: GPT-2 architecture, d_model 2048, 18 layers"))
    if only:
        sizes = [s for s in sizes if s.name in only]
    return sizes


def time_steps(runner: Runner, device, reps: int):
    """(device time, host time) of each of `reps` steps, in seconds: CUDA events on the GPU; on
    the CPU, where issuing the step is running it, the host time for both."""
    wall, events = time_in_turns({"step": runner.step}, reps, reset={"step": runner.restore},
                                 device=device)["step"]
    host = [t / 1e9 for t in wall]
    return ([t / 1e9 for t in events] if events is not None else host), host


def copy_bandwidth(device, mbytes: int, reps: int) -> dict:
    """Large tensor.copy_ (read + write counted), the reference for achieved bandwidth."""
    n = mbytes * 2 ** 20 // 4
    src = torch.empty(n, device=device).uniform_()
    dst = torch.empty_like(src)
    r = Runner(lambda: dst.copy_(src), [], [])
    for _ in range(3):
        r.step()
    t, _ = time_steps(r, device, reps)
    med = statistics.median(t)
    del src, dst
    return {"tensor_mib": mbytes, "median_s": med, "gbps": 2 * n * 4 / med / 1e9, "reps": reps}


def measure(cfg: Config, spec: SizeSpec, w, g, device, budget_s, min_reps, max_reps,
            warmup) -> dict:
    runner = cfg.build(spec, w, g, device, DT[cfg.dtype], cfg.clip)
    runner.restore()
    runner.step()  # the first step allocates optimizer state lazily
    sync(device)
    est = time_steps(runner, device, 1)[0][0]
    # Slow configurations (a step longer than a third of the budget) get the minimum: one
    # more warm-up step was already timed above, then 3 repetitions.
    slow = est > budget_s / 3
    for _ in range(0 if slow else warmup):
        runner.restore()
        runner.step()
    reps = int(max(3 if slow else min_reps, min(max_reps, budget_s / max(est, 1e-6))))
    before = runner.probe.detach().clone()
    dev, host = time_steps(runner, device, reps)
    # A skipped step (overflow) or a no-op would make the numbers meaningless.
    if torch.equal(before, runner.probe.detach()):
        raise RuntimeError("the step changed no parameter (skipped?)")
    del runner
    gc.collect()
    return summarise(cfg, spec, dev, host)


def summarise(cfg: Config, spec: SizeSpec, dev, host) -> dict:
    med = statistics.median(dev)
    bpp = BYTES_PER_PARAM[cfg.bytes_key]
    return {"config": cfg.key, "size": spec.name, "family": cfg.family, "opt": cfg.opt,
            "dtype": cfg.dtype, "clip": cfg.clip, "reps": len(dev), "median_s": med,
            "p10_s": percentile(dev, 0.1), "p90_s": percentile(dev, 0.9),
            "host_median_s": statistics.median(host), "bytes_per_param": bpp,
            "gbps": bpp * spec.numel / med / 1e9, "_dev": dev, "_host": host}
