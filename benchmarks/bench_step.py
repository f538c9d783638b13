#!/usr/bin/env python3
"""Step benchmark: one full mixed-precision optimizer step, fusedamp against torch.amp.

With (scaled) gradients already in place, times what a training loop does after backward():
the overflow check / unscale, optional global-norm clipping, the optimizer update and the
loss-scale update.

    make bench-step                                  # CPU results into benchmarks/results/
    PYTHONPATH=python python3 benchmarks/bench_step.py [--device cuda] [--quick]

fusedamp side. Each configuration is built by one small function (``fusedamp_ops`` below).
Until the Python engine exists it is the op sequence the engine will issue:
    grad_stats_   (found_inf + sum of squares; one read-only pass over the FP16/BF16 grads)
    adam_step_ / sgd_step_  (FP32 master weights; inv_scale, found_inf and, when clipping,
                             grad_sum_sq + max_grad_norm applied inside the same pass)
    update_scale_
When ``fusedamp.optim.AdamW`` and ``fusedamp.GradScaler`` exist, the same configurations are
also run through them (``scaler.step(opt); scaler.update()``, rows marked "api").

torch side (FP32 parameters, FP32 gradients multiplied by the loss scale, as torch.amp leaves
them after backward): ``scaler.step(opt); scaler.update()``, with ``scaler.unscale_(opt);
clip_grad_norm_`` first when clipping; plus BF16 parameters with fused AdamW and no scaler.

Gradients are restored from a pristine copy before every repetition, outside the timed region
(unscale_ and clipping modify them in place; repeated unscaling would end in denormals), for
fusedamp as well as torch so that both see the same cache state.

Parameter shapes of resnet50 and GPT-2 come from torchvision / transformers when installed
(recorded as the "shape source"), else from the built-in derivation of the same architectures
below; the built-in lists reproduce the libraries' parameter counts exactly (25,557,032 and
124,439,808; the GPT-2 LM head is tied to the token embedding and is not a separate tensor).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

try:
    from tqdm import tqdm
except ImportError:  # progress bars are a nicety, not a requirement
    tqdm = None

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# The op tests' input builder: the benchmark times the inputs the tests check.
sys.path.insert(0, str(REPO / "tests" / "python"))
from op_inputs import op_inputs  # noqa: E402

# Hyper-parameters shared by every configuration (torch's defaults where it has them).
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 1e-2
SGD_LR, MOMENTUM = 1e-2, 0.9
MAX_NORM = 1.0                 # the clipping configurations really clip (norms are >> 1)
LOSS_SCALE = 2.0 ** 16
GRAD_STD = 1e-3                # unscaled gradient magnitude; x 2**16 stays well inside FP16
GROWTH_INTERVAL = 2000


# ----------------------------------------------------------------------------- shapes
def resnet50_shapes() -> list[tuple[int, ...]]:
    """torchvision resnet50: stem, 4 stages of bottlenecks [3, 4, 6, 3], fc; BN weight+bias."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for width, blocks in [(64, 3), (128, 4), (256, 6), (512, 3)]:
        out = width * 4
        for b in range(blocks):
            shapes += [(width, inplanes, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (out, width, 1, 1), (out,), (out,)]
            if b == 0:  # projection shortcut
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]
            inplanes = out
    return shapes + [(1000, 2048), (1000,)]


def gpt2_shapes(d: int = 768, layers: int = 12, vocab: int = 50257, ctx: int = 1024):
    """transformers GPT2LMHeadModel (Conv1D weights are (in, out)); LM head tied to wte."""
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,),
                   (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def _library_shapes(name: str):
    """Shapes from the real architecture definition, built on the meta device (no memory)."""
    try:
        with torch.device("meta"):
            if name == "resnet50":
                import torchvision
                model = torchvision.models.resnet50(weights=None)
                src = f"torchvision {torchvision.__version__} models.resnet50"
            else:
                import transformers
                model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
                src = f"transformers {transformers.__version__} GPT2LMHeadModel"
        return [tuple(p.shape) for p in model.parameters()], src
    except Exception:  # not installed (or unusable): use the built-in derivation
        return None, None


@dataclass
class SizeSpec:
    name: str
    shapes: list
    source: str
    numel: int = 0

    def __post_init__(self):
        self.numel = sum(math.prod(s) for s in self.shapes)


def make_sizes(device: str, only: list[str] | None) -> list[SizeSpec]:
    sizes = [SizeSpec("10000x64", [(64,)] * 10000, "synthetic"),
             SizeSpec("1000x1024", [(1024,)] * 1000, "synthetic"),
             SizeSpec("8x1024x1024", [(1024, 1024)] * 8, "synthetic")]
    for name, builtin in [("resnet50", resnet50_shapes), ("gpt2-124M", gpt2_shapes)]:
        shapes, src = _library_shapes("resnet50" if name == "resnet50" else "gpt2")
        if shapes is None:
            shapes, src = builtin(), "built-in derivation (bench_step.py)"
        elif shapes == builtin():
            src += " (identical to the built-in derivation)"
        sizes.append(SizeSpec(name, shapes, src))
    if device == "cuda":
        sizes.append(SizeSpec("gpt-1B", gpt2_shapes(d=2048, layers=18),
                              "built-in: GPT-2 architecture, d_model 2048, 18 layers"))
    if only:
        sizes = [s for s in sizes if s.name in only]
    return sizes


# ----------------------------------------------------------------------------- bytes
# Bytes moved per parameter by one step in steady state, counted pass by pass from the kernels
# that run (reads + writes of full tensors; scalars ignored). p = param, g = grad, m/v = Adam
# moments, w = FP32 master weight, b = momentum buffer; 2 = FP16/BF16, 4 = FP32.
BYTES_PER_PARAM = {
    # fusedamp, FP16/BF16 params + FP32 master, FP16/BF16 grads:
    #   grad_stats_ reads g (2); adam_step_ reads g,w,m,v (2+4+4+4) and writes p,w,m,v (2+4+4+4),
    #   and reads p (2) to adopt edits of the model into the masters (adopt_param_edits, on by
    #   default). Clipping costs nothing extra: the norm comes from grad_stats_, which runs anyway
    #   for found_inf.
    "fusedamp_adamw": 2 + 16 + 14,                              # 32
    #   Through fusedamp.optim: + the unscaled (and clipped) g written back (write_back_grads).
    "fusedamp_adamw_api": 2 + 16 + 16,                          # 34
    #   adopt_param_edits=False, write_back_grads=False: p is written, never read.
    "fusedamp_adamw_lean": 2 + 14 + 14,                         # 30
    #   sgd_step_ reads g,w,b,p (2+4+4+2), writes p,w,b (2+4+4); the same two options.
    "fusedamp_sgd": 2 + 12 + 10,                                # 24
    "fusedamp_sgd_api": 2 + 12 + 12,                            # 26
    "fusedamp_sgd_lean": 2 + 10 + 10,                           # 22
    # torch, FP32 params and grads.
    #   GradScaler.step → unscale_: _amp_foreach_non_finite_check_and_unscale_ reads and writes
    #   g (8). AdamW(foreach=True), torch 2.11 _multi_tensor_adam, one op per line:
    #   p *= 1-lr*wd (8); m.lerp_(g) (12); v *= b2 (8); v.addcmul_(g, g) (12);
    #   t = sqrt(v) (8); t /= bc2_sqrt (8); t += eps (8); p.addcdiv_(m, t) (16) → 80.
    "torch_adamw_foreach": 8 + 80,                              # 88
    #   + unscale_ (8, separate from step's check which is then skipped), clip_grad_norm_:
    #   norm pass reads g (4), scale pass g *= coef (8).
    "torch_adamw_foreach_clip": 8 + 4 + 8 + 80,                 # 100
    #   Fused optimizers: GradScaler.step only checks (_check_inf_per_device runs the unscale
    #   kernel with inv_scale 1: reads and writes g, 8); _fused_adamw_ reads p,g,m,v (16),
    #   writes p,m,v (12) and, because it unscales, writes g back (4).
    "torch_adamw_fused": 8 + 16 + 16,                           # 40
    #   After unscale_ + clipping, the fused kernel gets no grad_scale and does not write g.
    "torch_adamw_fused_clip": 8 + 4 + 8 + 28,                   # 48
    #   BF16 params, BF16 state (torch keeps moments in the parameter dtype), no scaler:
    #   reads p,g,m,v (8), writes p,m,v (6). Not the same algorithm: no FP32 master, BF16 m/v.
    "torch_adamw_fused_bf16": 8 + 6,                            # 14
    #   _fused_sgd_: reads p,g,b (12), writes p,b (8) and the unscaled g (4); + check (8).
    "torch_sgd_fused": 8 + 12 + 12,                             # 32
    "torch_sgd_fused_clip": 8 + 4 + 8 + 20,                     # 40
}


# ----------------------------------------------------------------------------- runners
@dataclass
class Runner:
    """One configuration, built: step() runs one optimizer step, restore() resets the grads."""
    step: Callable[[], None]
    grads: list
    pristine: list
    keep: list = field(default_factory=list)  # everything else that must stay alive
    probe: torch.Tensor | None = None  # a parameter: must change when a step is applied

    def restore(self):
        if self.grads:
            torch._foreach_copy_(self.grads, self.pristine)


def _split(flat: torch.Tensor, shapes, dtype, scale=1.0, device="cpu"):
    """Separate tensors (own allocations, like a model's), filled from one random buffer."""
    out, off = [], 0
    for s in shapes:
        n = math.prod(s)
        t = torch.empty(s, dtype=dtype, device=device)
        t.view(-1).copy_(flat[off:off + n])
        if scale != 1.0:
            t.mul_(scale)
        out.append(t)
        off += n
    return out


def _params_with_grads(spec, w, g, device, dtype, grad_scale):
    """A model's parameters in `dtype` with their .grad (g × grad_scale, as backward leaves
    them), and a pristine copy of the grads."""
    params = [torch.nn.Parameter(t) for t in _split(w, spec.shapes, dtype, device=device)]
    grads = _split(g, spec.shapes, dtype, grad_scale, device)
    for p, gr in zip(params, grads):
        p.grad = gr
    return params, grads, [x.clone() for x in grads]


def fusedamp_ops(opt_name):
    """fusedamp through the ops: grad_stats_ → adam_step_ / sgd_step_ (FP32 master weights;
    SGD with momentum) → update_scale_."""
    b1, b2 = BETAS
    step_op, hyper = {
        "adamw": ("adam_step_", dict(lr=LR, beta1=b1, beta2=b2, eps=EPS, weight_decay=WD,
                                     decoupled_weight_decay=True)),
        "sgd": ("sgd_step_", dict(lr=SGD_LR, momentum=MOMENTUM, dampening=0.0, weight_decay=0.0,
                                  nesterov=False)),
    }[opt_name]

    def build(spec, w, g, device, dtype, clip):
        inp = op_inputs(device, param_dtype=dtype, master_weights=True,
                        moments=opt_name == "adamw", momentum=opt_name == "sgd",
                        weights=_split(w, spec.shapes, torch.float32, device=device),
                        grads=_split(g, spec.shapes, dtype, LOSS_SCALE, device),
                        loss_scale=LOSS_SCALE,
                        scalars=dict(inv_scale=1 / LOSS_SCALE, found_inf=0.0, grad_sum_sq=0.0))
        pristine = [x.clone() for x in inp.grads]
        grad_stats = inp.bind("grad_stats_")
        optimizer_step = inp.bind(step_op, **hyper, max_grad_norm=MAX_NORM if clip else None)
        update_scale = inp.bind("update_scale_", growth_factor=2.0, backoff_factor=0.5,
                                growth_interval=GROWTH_INTERVAL)

        def step():
            inp.found_inf.zero_()
            inp.grad_sum_sq.zero_()
            grad_stats()
            torch.reciprocal(inp.scale, out=inp.inv_scale)
            optimizer_step()
            update_scale()

        return Runner(step, inp.grads, pristine, [inp], inp.params[-1])
    return build


def fusedamp_api(opt_name, scaler_options=None, **modes):
    """fusedamp through its public classes (fusedamp.optim.*, fusedamp.GradScaler); modes:
    adopt_param_edits / write_back_grads (default: the optimizers' defaults, both on);
    scaler_options: GradScaler keywords (default: its defaults, telemetry on)."""
    def build(spec, w, g, device, dtype, clip):
        import fusedamp
        params, grads, pristine = _params_with_grads(spec, w, g, device, dtype, LOSS_SCALE)
        norm = MAX_NORM if clip else None
        if opt_name == "adamw":
            opt = fusedamp.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                       master_weights=True, max_grad_norm=norm, **modes)
        else:
            opt = fusedamp.optim.SGD(params, lr=SGD_LR, momentum=MOMENTUM, master_weights=True,
                                     max_grad_norm=norm, **modes)
        scaler = fusedamp.GradScaler(device, init_scale=LOSS_SCALE,
                                     growth_interval=GROWTH_INTERVAL, **(scaler_options or {}))
        scaler.scale(torch.ones((), device=device))  # what backward's scale(loss) initialises

        def step():
            scaler.step(opt)
            scaler.update()

        return Runner(step, grads, pristine, [params, opt, scaler], params[-1])
    return build


def torch_amp(opt_name, impl, clip):
    """torch.amp.GradScaler + torch.optim on FP32 params with loss-scaled FP32 grads."""
    def build(spec, w, g, device, dtype, _clip):
        params, grads, pristine = _params_with_grads(spec, w, g, device, torch.float32,
                                                     LOSS_SCALE)
        kw = {impl: True}
        if opt_name == "adamw":
            opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
        else:
            opt = torch.optim.SGD(params, lr=SGD_LR, momentum=MOMENTUM, **kw)
        scaler = torch.amp.GradScaler(device, init_scale=LOSS_SCALE,
                                      growth_interval=GROWTH_INTERVAL)
        scaler.scale(torch.ones((), device=device))  # what backward's scale(loss) initialises

        def step():
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            scaler.step(opt)
            scaler.update()

        return Runner(step, grads, pristine, [params, opt, scaler], params[-1])
    return build


def torch_bf16_fused(spec, w, g, device, dtype, clip):
    """BF16 params and grads, torch AdamW(fused=True), no scaler (and no master weights)."""
    # bf16 needs no loss scale
    params, grads, pristine = _params_with_grads(spec, w, g, device, torch.bfloat16, 1.0)
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    return Runner(opt.step, grads, pristine, [params, opt], params[-1])


@dataclass
class Config:
    key: str
    family: str          # "fusedamp" or "torch"
    opt: str             # "adamw" or "sgd"
    dtype: str           # param dtype: "fp16", "bf16", "fp32"
    clip: bool
    bytes_key: str
    build: Callable
    baseline_of: tuple = ()  # for fusedamp rows: the torch keys it is compared against


DT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def make_configs(with_api: bool) -> list[Config]:
    cfgs = []
    for opt in ["adamw", "sgd"]:
        for clip in [False, True]:
            c = "+clip" if clip else ""
            if opt == "adamw":
                base = (f"torch adamw foreach{c}", f"torch adamw fused{c}")
            else:
                base = (f"torch sgd fused{c}",)
            for dt in ["fp16", "bf16"]:
                extra = ("torch adamw fused bf16 (no scaler)",) if (
                    opt == "adamw" and dt == "bf16" and not clip) else ()
                cfgs.append(Config(f"fusedamp {opt} {dt}{c}", "fusedamp", opt, dt, clip,
                                   f"fusedamp_{opt}", fusedamp_ops(opt), base + extra))
                if with_api:
                    cfgs.append(Config(f"fusedamp-api {opt} {dt}{c}", "fusedamp", opt, dt, clip,
                                       f"fusedamp_{opt}_api", fusedamp_api(opt), base + extra))
                if with_api and dt == "fp16":
                    # The cost of the two defaults that keep torch's contract: edits of the
                    # model reach the masters, .grad is left unscaled.
                    cfgs.append(Config(
                        f"fusedamp-api {opt} {dt}{c} lean", "fusedamp", opt, dt, clip,
                        f"fusedamp_{opt}_lean",
                        fusedamp_api(opt, adopt_param_edits=False, write_back_grads=False),
                        base))
                    # The default's telemetry (GradScaler(telemetry=True)) against none: its
                    # own cost is the ratio of this row's time to the default row's.
                    cfgs.append(Config(
                        f"fusedamp-api {opt} {dt}{c} telemetry off", "fusedamp", opt, dt, clip,
                        f"fusedamp_{opt}_api", fusedamp_api(opt, dict(telemetry=False)), base))
    for clip in [False, True]:
        c = "+clip" if clip else ""
        s = "_clip" if clip else ""
        cfgs.append(Config(f"torch adamw foreach{c}", "torch", "adamw", "fp32", clip,
                           f"torch_adamw_foreach{s}", torch_amp("adamw", "foreach", clip)))
        cfgs.append(Config(f"torch adamw fused{c}", "torch", "adamw", "fp32", clip,
                           f"torch_adamw_fused{s}", torch_amp("adamw", "fused", clip)))
        cfgs.append(Config(f"torch sgd fused{c}", "torch", "sgd", "fp32", clip,
                           f"torch_sgd_fused{s}", torch_amp("sgd", "fused", clip)))
    cfgs.append(Config("torch adamw fused bf16 (no scaler)", "torch", "adamw", "bf16", False,
                       "torch_adamw_fused_bf16", torch_bf16_fused))
    return cfgs


# ----------------------------------------------------------------------------- timing
class Clock:
    """Step time (CUDA events on the GPU, perf_counter on the CPU) and host time per step."""

    def __init__(self, device):
        self.cuda = device == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, runner: Runner, reps: int):
        dev_times, host_times, events = [], [], []
        for _ in range(reps):
            runner.restore()
            self.sync()
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            t0 = time.perf_counter()
            runner.step()
            t1 = time.perf_counter()
            if self.cuda:
                b.record()
                events.append((a, b))
            host_times.append(t1 - t0)
        self.sync()
        if self.cuda:
            dev_times = [a.elapsed_time(b) / 1e3 for a, b in events]
        else:
            dev_times = host_times  # synchronous: issuing the step is running it
        return dev_times, host_times


def copy_bandwidth(device, clock: Clock, mbytes: int, reps: int) -> dict:
    """Large tensor.copy_ (read + write counted), the reference for achieved bandwidth."""
    n = mbytes * 2 ** 20 // 4
    src = torch.empty(n, device=device).uniform_()
    dst = torch.empty_like(src)
    r = Runner(lambda: dst.copy_(src), [], [])
    for _ in range(3):
        r.step()
    t, _ = clock.time(r, reps)
    med = statistics.median(t)
    del src, dst
    return {"tensor_mib": mbytes, "median_s": med, "gbps": 2 * n * 4 / med / 1e9, "reps": reps}


def percentile(xs, q):
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def measure(cfg: Config, spec: SizeSpec, w, g, device, clock: Clock, budget_s, min_reps,
            max_reps, warmup) -> dict:
    runner = cfg.build(spec, w, g, device, DT[cfg.dtype], cfg.clip)
    runner.restore()
    runner.step()  # the first step allocates optimizer state lazily
    clock.sync()
    est = clock.time(runner, 1)[0][0]
    # Slow configurations (a step longer than a third of the budget) get the minimum: one
    # more warm-up step was already timed above, then 3 repetitions.
    slow = est > budget_s / 3
    for _ in range(0 if slow else warmup):
        runner.restore()
        runner.step()
    reps = int(max(3 if slow else min_reps, min(max_reps, budget_s / max(est, 1e-6))))
    before = runner.probe.detach().clone()
    dev, host = clock.time(runner, reps)
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


# ----------------------------------------------------------------------------- machine
# The instruction-set flags a result depends on (the CPU kernels' and torch's paths).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")


def machine_info(device) -> dict:
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    info = {"date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "host": platform.node(), "cpu": cpu, "cpu_cores": os.cpu_count(),
            "cpu_flags": [f for f in CPU_FLAGS if f in flags],
            "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": device}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2 ** 30, 1),
                    gpu_sms=p.multi_processor_count)
    import fusedamp
    pkg = Path(fusedamp.__file__).resolve().parent
    info["fusedamp_module"] = str(pkg)
    src = pkg.parents[1]  # python/fusedamp → the source tree it was built from
    try:
        rev = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "csrc",
                                "cuda", "CMakeLists.txt"], capture_output=True,
                               text=True).stdout.strip()
        info["fusedamp_commit"] = rev + (" (+ uncommitted csrc/cuda changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        pass
    if hasattr(os, "getloadavg"):  # other processes on the cores distort OpenMP timings
        info["load_average_at_start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return info


def device_tag(device) -> str:
    if device == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name(0).lower().replace("nvidia", "").strip()
    return "cuda_" + "".join(ch if ch.isalnum() else "_" for ch in name).strip("_")


# ----------------------------------------------------------------------------- report
def ratios(results: list[dict], cfgs: list[Config]) -> list[dict]:
    by = {(r["size"], r["config"]): r for r in results}
    out = []
    for c in cfgs:
        if c.family != "fusedamp":
            continue
        for size in dict.fromkeys(r["size"] for r in results):
            fa = by.get((size, c.key))
            for b in c.baseline_of:
                tb = by.get((size, b))
                if fa and tb:
                    out.append({"size": size, "fusedamp": c.key, "torch": b,
                                "ratio": tb["median_s"] / fa["median_s"],
                                "host_ratio": tb["host_median_s"] / fa["host_median_s"]})
    return out


def fmt_t(s):
    return f"{s * 1e3:.3f}" if s < 0.01 else f"{s * 1e3:.1f}" if s < 10 else f"{s * 1e3:.0f}"


def write_markdown(path, info, copy, sizes, results, rat, targets, command):
    L = [f"# fusedamp step benchmark — {info['device']}", "",
         f"Produced by `{command}` on {info['date_utc']}.", "",
         "| machine | |", "| --- | --- |"]
    L += [f"| {k} | {v} |" for k, v in info.items()]
    L += [f"| memory copy reference | {copy['gbps']:.1f} GB/s ({copy['tensor_mib']} MiB "
          f"tensor.copy_, read + write, median of {copy['reps']}) |", "",
          "## Sizes", "", "| size | tensors | parameters | shape source |", "| --- | --: | --: | --- |"]
    L += [f"| {s.name} | {len(s.shapes):,} | {s.numel:,} | {s.source} |" for s in sizes]
    L += ["", "## Step time torch / fusedamp (> 1: fusedamp faster)", "",
          "Median step time of the torch configuration divided by fusedamp's, same size, same "
          "run. **bold < 1.00** = fusedamp slower. Host ratio in parentheses where it differs "
          "(GPU only: CPU wall time of issuing the step).", ""]
    size_names = [s.name for s in sizes]
    pairs = list(dict.fromkeys((r["fusedamp"], r["torch"]) for r in rat))
    L += ["| fusedamp | vs torch | " + " | ".join(size_names) + " |",
          "| --- | --- | " + " | ".join("--:" for _ in size_names) + " |"]
    rmap = {(r["fusedamp"], r["torch"], r["size"]): r for r in rat}
    for fa, tb in pairs:
        cells = []
        for s in size_names:
            r = rmap.get((fa, tb, s))
            if r is None:
                cells.append("—")
                continue
            cell = f"{r['ratio']:.2f}"
            if r["ratio"] < 1.0:
                cell = f"**{cell}**"
            if info["device"] == "cuda":
                cell += f" ({r['host_ratio']:.2f})"
            cells.append(cell)
        L.append(f"| {fa} | {tb} | " + " | ".join(cells) + " |")
    if targets:
        L += ["", "## Targets", "", "| target | size | fusedamp | ratio | met |",
              "| --- | --- | --- | --: | --- |"]
        L += [f"| {t['target']} | {t['size']} | {t['fusedamp']} | {t['ratio']:.2f} | "
              f"{'yes' if t['met'] else '**no**'} |" for t in targets]
    cost = telemetry_cost(results)
    if cost:
        L += ["", "## Telemetry's cost", "",
              "Median step time of the default (GradScaler telemetry on) over the same step "
              "with `GradScaler(telemetry=False)`, same size, same run, minus 1.", "",
              "| size | configuration | telemetry cost |", "| --- | --- | --: |"]
        L += [f"| {c['size']} | {c['config']} | {100 * c['cost']:+.1f}% |" for c in cost]
    slower = [r for r in rat if r["ratio"] < 1.0]
    L += ["", "## Flags: fusedamp slower than torch", ""]
    L += [f"- {r['size']}: {r['fusedamp']} vs {r['torch']}: {r['ratio']:.2f}" for r in slower] \
        or ["- none"]
    L += ["", "## All configurations", "",
          "time = median step time (p10–p90), ms; host = median host time per step, ms; "
          "B/param = bytes moved per parameter counted from the kernels (see BYTES_PER_PARAM in "
          "bench_step.py); GB/s = B/param × parameters / time; % copy = that bandwidth as a "
          "fraction of the memory copy above.", "",
          "| size | configuration | reps | time ms | p10–p90 ms | host ms | B/param | GB/s | % copy |",
          "| --- | --- | --: | --: | --: | --: | --: | --: | --: |"]
    for r in results:
        L.append(f"| {r['size']} | {r['config']} | {r['reps']} | {fmt_t(r['median_s'])} | "
                 f"{fmt_t(r['p10_s'])}–{fmt_t(r['p90_s'])} | {fmt_t(r['host_median_s'])} | "
                 f"{r['bytes_per_param']} | {r['gbps']:.1f} | "
                 f"{100 * r['gbps'] / copy['gbps']:.0f}% |")
    Path(path).write_text("\n".join(L) + "\n")


def telemetry_cost(results) -> list[dict]:
    """Each default API row against its telemetry-off twin: time on / time off - 1."""
    by = {(r["size"], r["config"]): r for r in results}
    out = []
    for (size, key), r in by.items():
        off = by.get((size, key + " telemetry off"))
        if off:
            out.append({"size": size, "config": key,
                        "cost": r["median_s"] / off["median_s"] - 1.0})
    return out


def check_targets(rat, device) -> list[dict]:
    """The step's targets for this device kind, per size (fusedamp FP16 and BF16 AdamW)."""
    if device == "cpu":
        want = [("adamw", "+clip", "torch adamw fused+clip", 1.3),
                ("adamw", "", "torch adamw fused", 1.0)]
    else:
        want = [("adamw", "", "torch adamw fused", 1.3),
                ("adamw", "+clip", "torch adamw fused+clip", 1.6),
                ("adamw", "", "torch adamw foreach", 2.5)]
    out = []
    for r in rat:
        for opt, c, base, goal in want:
            if r["torch"] == base and r["fusedamp"].split(" ", 1)[1] in (f"{opt} fp16{c}",
                                                                         f"{opt} bf16{c}"):
                goal_here = 2.0 if (device == "cuda" and r["size"] == "10000x64"
                                    and base == "torch adamw fused") else goal
                out.append({"target": f">= {goal_here}x vs {base}", "size": r["size"],
                            "fusedamp": r["fusedamp"], "ratio": r["ratio"],
                            "met": r["ratio"] >= goal_here})
    return out


def plot(path, rat, sizes, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pairs = list(dict.fromkeys((r["fusedamp"], r["torch"]) for r in rat))
    rmap = {(r["fusedamp"], r["torch"], r["size"]): r["ratio"] for r in rat}
    names = [s.name for s in sizes]
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names) + 3, 0.32 * len(pairs) + 2),
                             sharey=True, squeeze=False)
    labels = [f"{fa.replace('fusedamp ', '')}  vs  {tb.replace('torch ', '')}" for fa, tb in pairs]
    for ax, name in zip(axes[0], names):
        vals = [rmap.get((fa, tb, name), float("nan")) for fa, tb in pairs]
        colors = ["tab:red" if v < 1 else "tab:green" if v >= 1.3 else "tab:olive" for v in vals]
        ax.barh(range(len(pairs)), vals, color=colors)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.axvline(1.3, color="gray", lw=0.8, ls="--")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("torch time / fusedamp time", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_yticks(range(len(pairs)))
    axes[0][0].set_yticklabels(labels)
    axes[0][0].invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--sizes", nargs="*", help="subset of sizes (default: all for the device)")
    ap.add_argument("--configs", nargs="*", help="substrings; keep configurations matching any")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds of timed repetitions per configuration (default: 0.5 s; slow "
                         "configurations get 3 reps)")
    ap.add_argument("--min-reps", type=int, default=None)
    ap.add_argument("--max-reps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--copy-mib", type=int, default=None, help="memory-copy reference size")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny budget, no files")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every configuration this many times, in turns, and pool")
    ap.add_argument("--name", default="step",
                    help="result files' stem: NAME_cpu.{md,json,png} (default: step)")
    ap.add_argument("--no-api", action="store_true",
                    help="skip the fusedamp.optim/GradScaler rows even if they exist")
    args = ap.parse_args(argv)

    import fusedamp  # registers torch.ops.fusedamp

    device = args.device
    torch.set_num_threads(args.threads)
    cpu = device == "cpu"
    budget = args.budget if args.budget is not None else 0.5
    min_reps = args.min_reps or (5 if cpu else 20)
    max_reps = args.max_reps or (200 if cpu else 1000)
    warmup = 2 if cpu else 10  # after the first step (state allocation) and one timed one
    if args.quick:
        budget, min_reps, max_reps, warmup = 0.05, 2, 3, 1
    with_api = (not args.no_api and hasattr(fusedamp, "GradScaler")
                and hasattr(getattr(fusedamp, "optim", None), "AdamW"))
    sizes = make_sizes(device, args.sizes)
    cfgs = make_configs(with_api)
    if args.configs:
        cfgs = [c for c in cfgs if any(s in c.key for s in args.configs)]
    clock = Clock(device)
    info = machine_info(device)
    command = "python3 " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:])

    copy = copy_bandwidth(device, clock, args.copy_mib or (256 if cpu else 1024),
                          5 if args.quick else 20)
    print(f"memory copy reference: {copy['gbps']:.1f} GB/s", file=sys.stderr)

    results, failures = [], []
    total = len(sizes) * len(cfgs) * args.rounds
    bar = tqdm(total=total, unit="cfg", dynamic_ncols=True) if tqdm else None
    for spec in sizes:
        gen = torch.Generator().manual_seed(0)
        w = (torch.randn(spec.numel, generator=gen) * 0.02).to(device)
        g = (torch.randn(spec.numel, generator=gen) * GRAD_STD).to(device)
        # Rounds take turns over the configurations (a slow spell of a shared machine then
        # falls on all of them); each configuration's repetitions of all rounds are pooled.
        pooled = {}
        for cfg in [c for _ in range(args.rounds) for c in cfgs]:
            if bar:
                bar.set_postfix_str(f"{spec.name}: {cfg.key}")
            try:
                r = measure(cfg, spec, w, g, device, clock, budget, min_reps, max_reps, warmup)
                if cfg.key in pooled:
                    r = summarise(cfg, spec, pooled[cfg.key]["_dev"] + r["_dev"],
                                  pooled[cfg.key]["_host"] + r["_host"])
                pooled[cfg.key] = r
            except Exception as e:  # keep the run going; report the failure
                failures.append({"size": spec.name, "config": cfg.key, "error": repr(e)})
                print(f"\n{spec.name} / {cfg.key} failed: {e!r}", file=sys.stderr)
            if bar:
                bar.update(1)
            gc.collect()
        for r in pooled.values():
            del r["_dev"], r["_host"]
            results.append(r)
        del w, g
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    if bar:
        bar.close()

    if hasattr(os, "getloadavg"):
        info["load_average_at_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rat = ratios(results, cfgs)
    targets = check_targets(rat, device)
    for r in rat:
        flag = "  <-- fusedamp slower" if r["ratio"] < 1 else ""
        print(f"{r['size']:>10}  {r['fusedamp']:<26} vs {r['torch']:<36} {r['ratio']:5.2f}{flag}")
    for c in telemetry_cost(results):
        print(f"{c['size']:>10}  {c['config']:<26} telemetry cost {100 * c['cost']:+.1f}%")
    if failures:
        print(f"{len(failures)} configuration(s) failed", file=sys.stderr)
    if args.quick:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = device_tag(device)
    doc = {"machine": info, "command": command, "copy_reference": copy,
           "sizes": [{"name": s.name, "tensors": len(s.shapes), "parameters": s.numel,
                      "shape_source": s.source} for s in sizes],
           "bytes_per_param": BYTES_PER_PARAM,
           "hyper_parameters": {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD,
                                "sgd_lr": SGD_LR, "momentum": MOMENTUM, "max_norm": MAX_NORM,
                                "loss_scale": LOSS_SCALE, "grad_std": GRAD_STD},
           "results": results, "ratios": rat, "targets": targets,
           "telemetry_cost": telemetry_cost(results), "failures": failures}
    stem = f"{args.name}_{tag}"
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    write_markdown(out / f"{stem}.md", info, copy, sizes, results, rat, targets, command)
    plot(out / f"{stem}.png", rat, sizes,
         f"fusedamp step vs torch.amp — {info.get('gpu', info['cpu'])}, torch {info['torch']}")
    print(f"wrote {out}/{stem}.{{md,json,png}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
