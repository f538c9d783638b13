#!/usr/bin/env python3
"""Master-weight modes benchmark: fusedamp AdamW's master_weights / state_dtype choices on BF16
parameters, against torch's plain BF16 fused AdamW, torch-optimi's Kahan-summation AdamW and
torchao's stochastic-rounding AdamW.

    PYTHONPATH=python python3 benchmarks/bench_master_modes.py --quick         # smoke run, no files
    PYTHONPATH=python python3 benchmarks/bench_master_modes.py                  # step time + bytes
    PYTHONPATH=python python3 benchmarks/bench_master_modes.py --accuracy       # accuracy part only
    PYTHONPATH=python python3 benchmarks/bench_master_modes.py --all --device cuda

Rows (every one on BF16 parameters with BF16 gradients, no loss scaler):
  torch    torch.optim.AdamW(fused=True): round-to-nearest BF16 weights, no master copy, moments
           in the parameter dtype (BF16). The baseline ("x base" columns).
  optimi   optimi.AdamW(kahan_sum=True): BF16 weights + a BF16 Kahan compensation buffer,
           BF16 moments (foreach on the CPU; Triton, its default, and foreach on CUDA).
  torchao  torchao.optim._AdamW(bf16_stochastic_round=True): FP32 math, BF16 moments,
           stochastically rounded BF16 weights; one torch.compile'd function per parameter.
  fusedamp fusedamp.optim.AdamW(master_weights=MODE, state_dtype=SDT), MODE in True (FP32 master),
           False (plain BF16), "split" (BF16 + int16 remainder), "kahan" (BF16 + BF16
           compensation), "split8" (BF16 + int8 remainder: a 24-bit master), "stochastic" (stochastic
           rounding); SDT FP32 or BF16 moments, or int8 (8-bit moments with block scales).
A row that cannot run (library missing, mode not implemented yet, ...) records why instead of a
number; the run goes on.

Step time. Parameter shapes of resnet50 and GPT-2 small (bench_step.py's built-in derivations,
25,557,032 and 124,439,808 parameters), or both shrunk 8x per dimension with --quick. Random
weights and gradients are made once; the gradients are restored from a pristine copy before
every repetition, outside the timed region (optimi's foreach step uses .grad as scratch space).
Median of --reps repetitions after --warmup steps; the first step (state allocation, torch.compile
for torchao) is reported separately. One thread unless --threads. On CUDA the step is timed with
perf_counter between two synchronizations (host overhead included).

Bytes. Each row carries a small description of its per-parameter state (buffer, bytes) and,
where the implementation is not one fused pass, the passes it runs. From it: state bytes per
parameter besides the 2-byte weight; bytes moved per step per parameter by a single fused pass
(grad read 2, weight read + write 2 + 2, every state buffer read + written); and bytes moved as
implemented (the passes, or the single pass plus extra passes such as fusedamp's grad_stats_).
The state actually held in optimizer.state after a step is measured too, as a cross-check.

Accuracy (--accuracy / --all). The digits CNN and the character-level GPT of
examples/python/amp_models.py, trained in BF16 with each row's optimizer plus an FP32-parameter
torch AdamW reference: same seed, same initial weights, same batches, same hyper-parameters
for every row; a small learning rate (default 1e-4) at which many updates of BF16 weights fall
below half an ulp, so plain round-to-nearest BF16 stalls (at 1e-4, 200 steps: digits training
loss 0.88 against FP32's 0.39; char-GPT 3.14 against 2.89). Reported: final training loss
(mean of the last 20 steps), evaluation loss and (digits) test accuracy.

Results: benchmarks/results/master_modes_<device>.{json,md} (--out to change the folder). Each
part updates its own section of an existing JSON file, so the two parts can run separately.
--quick prints the tables and writes files only when --out is given.
"""
from __future__ import annotations

import argparse
import ast
import datetime as _dt
import gc
import importlib
import inspect
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# Importing bench_step runs no benchmark (its main() runs under __main__ only); its one side
# effect is to put tests/python on sys.path and import op_inputs / op_helpers from there, which
# neither load the fusedamp library nor need it.
sys.path.insert(0, str(HERE))
import bench_step  # noqa: E402
from bench_step import (BETAS, EPS, GRAD_STD, LR, WD, device_tag, fmt_t,  # noqa: E402
                        gpt2_shapes, percentile, resnet50_shapes)

BF16, FP32 = torch.bfloat16, torch.float32
QUICK_SHRINK = 8
ERR_CHARS = 300  # error messages are cut to this length in the tables


# ----------------------------------------------------------------------------- sizes
Size = bench_step.SizeSpec  # (name, shapes, source): the step benchmark's


def _shrink(shapes, f):
    """Every dimension of 16 or more divided by f: same tensor count, same set of distinct
    shapes (torchao compiles once per shape), about f**2 fewer parameters."""
    return [tuple(d // f if d >= 16 else d for d in s) for s in shapes]


def all_sizes() -> dict[str, Size]:
    src = "built-in derivation (bench_step.py)"
    sizes = [Size("resnet50", resnet50_shapes(), src), Size("gpt2-124M", gpt2_shapes(), src)]
    for s in list(sizes):
        sizes.append(Size(f"{s.name}/{QUICK_SHRINK}", _shrink(s.shapes, QUICK_SHRINK),
                          f"{s.name} with every dimension >= 16 divided by {QUICK_SHRINK}"))
    return {s.name: s for s in sizes}


# ----------------------------------------------------------------------------- rows
# A pass: (what it does, tensors read, tensors written); tensor names: g = grad, p = weight,
# the other names are state buffers of the row (or temporaries listed in Row.temps).
Pass = tuple[str, str, str]


@dataclass
class Row:
    key: str
    family: str                      # torch / optimi / torchao / fusedamp
    factory: str                     # dotted name of the optimizer class
    kwargs: dict                     # constructor arguments besides params and the hyper-parameters
    state: list[tuple[str, int]]     # per-parameter state besides the weight: (name, bytes)
    param_dtype: torch.dtype = BF16
    passes: list[Pass] | None = None   # as implemented, when not a single fused pass
    extra_passes: list[tuple[str, int]] = field(default_factory=list)  # (what, bytes/param)
    temps: dict[str, int] = field(default_factory=dict)  # temporaries used by the passes
    note: str = ""
    unavailable: str | None = None   # why the row cannot run here
    state_dtype_text: str = ""
    baseline: bool = False

    # --- bytes per parameter ---
    @property
    def weight_bytes(self):
        return torch.empty((), dtype=self.param_dtype).element_size()

    def sizes(self):
        d = {"g": self.weight_bytes, "p": self.weight_bytes}
        d.update(dict(self.state))
        d.update(self.temps)
        return d

    def state_bytes(self):
        return sum(b for _, b in self.state)

    def moved_one_pass(self):
        """grad read; weight read + write; every state buffer read + written."""
        return self.weight_bytes + 2 * self.weight_bytes + 2 * self.state_bytes()

    def moved_as_implemented(self):
        if self.passes is None:
            return self.moved_one_pass() + sum(b for _, b in self.extra_passes)
        size = self.sizes()
        total = 0
        for _, reads, writes in self.passes:
            total += sum(size[t] for t in reads.split()) + sum(size[t] for t in writes.split())
        return total

    def implementation_text(self):
        if self.passes is not None:
            return f"{len(self.passes)} passes: " + "; ".join(p[0] for p in self.passes)
        extra = "".join(f" + {what} ({b} B)" for what, b in self.extra_passes)
        return "one fused pass" + extra

    # --- construction ---
    def _kwargs(self, hyper, extra=None):
        return dict(lr=hyper["lr"], betas=tuple(hyper["betas"]), eps=hyper["eps"],
                    weight_decay=hyper["weight_decay"], **self.kwargs, **(extra or {}))

    def ctor_text(self, hyper):
        kw = self._kwargs(hyper)
        return f"{self.factory}(params, " + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")"

    def build(self, params, hyper, extra=None):
        if self.unavailable:
            raise RuntimeError(self.unavailable)
        mod, _, name = self.factory.rpartition(".")
        cls = getattr(importlib.import_module(mod), name)
        return cls(params, **self._kwargs(hyper, extra))


def _try_import(module):
    """(module, None) or (None, why not)."""
    try:
        return importlib.import_module(module), None
    except ImportError as e:
        if getattr(e, "name", None) == module.split(".")[0]:
            return None, "not installed"
        return None, f"import {module} failed: {e!r}"[:ERR_CHARS]
    except Exception as e:  # a broken build, an ABI mismatch...
        return None, f"import {module} failed: {e!r}"[:ERR_CHARS]


def _version(dist, module=None):
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:
        return getattr(module, "__version__", None)


def torch_fused_bf16_ok(device) -> str | None:
    """None if torch.optim.AdamW(fused=True) steps BF16 parameters on this device."""
    try:
        p = torch.nn.Parameter(torch.ones(8, dtype=BF16, device=device))
        p.grad = torch.ones_like(p)
        torch.optim.AdamW([p], lr=1e-3, fused=True).step()
        return None
    except Exception as e:
        return repr(e)[:ERR_CHARS]


# torch's _multi_tensor_adam (non-capturable, decoupled weight decay), torch 2.x.
TORCH_FOREACH_PASSES = [
    ("p *= 1-lr*wd", "p", "p"), ("m.lerp_(g)", "m g", "m"), ("v *= b2", "v", "v"),
    ("v.addcmul_(g, g)", "v g", "v"), ("t = sqrt(v)", "v", "t"), ("t /= sqrt(bc2)", "t", "t"),
    ("t += eps", "t", "t"), ("p.addcdiv_(m, t)", "p m t", "p")]
# optimi 0.3 _foreach_adam with kahan_sum (uses g as scratch space).
OPTIMI_FOREACH_PASSES = [
    ("p *= 1-lr*wd", "p", "p"), ("m.lerp_(g)", "m g", "m"), ("v *= b2", "v", "v"),
    ("v.addcmul_(g, g)", "v g", "v"), ("g = v", "v", "g"), ("g.sqrt_()", "g", "g"),
    ("g += eps", "g", "g"), ("c.addcdiv_(m, g)", "c m g", "c"), ("g = p", "p", "g"),
    ("p += c", "p c", "p"), ("g -= p", "g p", "g"), ("c += g", "c g", "c")]

FUSEDAMP_MODES = [  # (label, master_weights, extra state besides the moments)
    ("fp32-master", True, [("master (fp32)", 4)]),
    ("bf16-rtn", False, []),
    ("split", "split", [("remainder (int16)", 2)]),
    ("split8", "split8", [("remainder (int8)", 1)]),
    ("kahan", "kahan", [("compensation (bf16)", 2)]),
    ("stochastic", "stochastic", []),
]
STATE_DTYPES = [("fp32", FP32), ("bf16", BF16), ("int8", torch.int8)]


def moment_state(sname, sdt):
    """The moments' (buffer, bytes per parameter) of a state dtype: int8 keeps 8-bit codes of
    both moments and, per block of 32 elements, two FP32 scales."""
    if sdt == torch.int8:
        return [("exp_avg (int8 codes)", 1), ("exp_avg_sq (uint8 codes)", 1),
                ("moment_scales (2 fp32 per 32 elements)", 0.25)]
    return [(f"exp_avg ({sname})", sdt.itemsize), (f"exp_avg_sq ({sname})", sdt.itemsize)]


def make_rows(device, fusedamp_kw: dict) -> list[Row]:
    rows = []
    # torch baseline
    why = torch_fused_bf16_ok(device)
    if why is None:
        rows.append(Row("torch AdamW fused", "torch", "torch.optim.AdamW", dict(fused=True),
                        [("exp_avg (bf16)", 2), ("exp_avg_sq (bf16)", 2)], baseline=True,
                        state_dtype_text="bf16 (param dtype)",
                        note="plain BF16 round-to-nearest weights, no master copy; torch keeps "
                             "the moments in the parameter dtype"))
    else:
        rows.append(Row("torch AdamW foreach", "torch", "torch.optim.AdamW", dict(foreach=True),
                        [("m", 2), ("v", 2)], passes=TORCH_FOREACH_PASSES, temps={"t": 2},
                        baseline=True, state_dtype_text="bf16 (param dtype)",
                        note=f"fused=True failed on {device} ({why}); foreach instead"))
    # torch-optimi, Kahan summation
    optimi, why = _try_import("optimi")
    impls = ["foreach"] if device == "cpu" else ["triton", "foreach"]
    for impl in impls:
        kw = dict(kahan_sum=True, foreach=True, triton=False) if impl == "foreach" else \
            dict(kahan_sum=True, triton=True)
        rows.append(Row(f"optimi AdamW kahan ({impl})", "optimi", "optimi.AdamW", kw,
                        [("m", 2), ("v", 2), ("c", 2)], state_dtype_text="bf16 (param dtype)",
                        passes=OPTIMI_FOREACH_PASSES if impl == "foreach" else None,
                        unavailable=why,
                        note="m, v, c = exp_avg, exp_avg_sq, kahan_comp, all zeros_like(param) "
                             "(BF16); debiased-beta formulation of Adam"))
    # torchao, stochastic rounding
    ao, why = _try_import("torchao.optim")
    factory = "torchao.optim._AdamW"
    if ao is not None and not hasattr(ao, "_AdamW"):
        if hasattr(ao, "AdamW"):
            factory = "torchao.optim.AdamW"
        else:
            why = "torchao.optim has no _AdamW/AdamW in this version"
    rows.append(Row("torchao AdamW bf16-SR", "torchao", factory, dict(bf16_stochastic_round=True),
                    [("exp_avg (bf16)", 2), ("exp_avg_sq (bf16)", 2)], unavailable=why,
                    state_dtype_text="bf16 (param dtype)",
                    note="FP32 math, BF16 moments (zeros_like(param)), stochastic rounding of "
                         "the weight; torch.compile per parameter shape, one fused kernel per "
                         "parameter assumed"))
    # Other libraries' 8-bit AdamW: both keep BF16 weights updated in place (no master bits)
    # and two 8-bit codes per element with one FP32 absmax per block of 256 and a 256-entry
    # dynamic quantization map; a different algorithm from fusedamp's blocks of 32.
    eight = [("exp_avg (uint8 codes)", 1), ("exp_avg_sq (uint8 codes)", 1),
             ("absmax (2 fp32 per 256 elements)", 2 * 4 / 256)]
    bnb, why = _try_import("bitsandbytes")
    rows.append(Row("bitsandbytes AdamW8bit", "bitsandbytes", "bitsandbytes.optim.AdamW8bit",
                    {}, eight, unavailable=why, state_dtype_text="8-bit (blocks of 256)",
                    note="plain BF16 round-to-nearest weights; dynamic-map 8-bit moments"))
    ao8, why = _try_import("torchao.optim")
    if ao8 is not None and not hasattr(ao8, "AdamW8bit"):
        why = "torchao.optim has no AdamW8bit in this version"
    rows.append(Row("torchao AdamW8bit", "torchao", "torchao.optim.AdamW8bit", {}, eight,
                    unavailable=why, state_dtype_text="8-bit (blocks of 256)",
                    note="plain BF16 round-to-nearest weights; dynamic-map 8-bit moments as "
                         "tensor subclasses, torch.compile per parameter shape"))
    # fusedamp
    fa, why = _try_import("fusedamp")
    stats = fusedamp_kw.get("skip_nonfinite", True)
    extra = [("grad_stats_ read of g (skip_nonfinite)", 2)] if stats else []
    for label, mw, own in FUSEDAMP_MODES:
        for sname, sdt in STATE_DTYPES:
            kw = dict(master_weights=mw, state_dtype=sdt)
            kw.update(fusedamp_kw)
            # FP32 masters adopt edits of the weight by default: the step reads it too.
            adopts = mw is True and kw.get("adopt_param_edits", True)
            reads = [("weight read to adopt edits (adopt_param_edits)", 2)] if adopts else []
            rows.append(Row(f"fusedamp {label} / {sname} state", "fusedamp",
                            "fusedamp.optim.AdamW", kw,
                            own + moment_state(sname, sdt),
                            extra_passes=list(extra) + reads, unavailable=why,
                            state_dtype_text=sname))
    return rows


def fp32_reference_row() -> Row:
    return Row("FP32 reference (torch AdamW fused, FP32 params)", "torch", "torch.optim.AdamW",
               dict(fused=True),
               [("exp_avg (fp32)", 4), ("exp_avg_sq (fp32)", 4)], param_dtype=FP32,
               state_dtype_text="fp32")


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


def build_row(row, params, hyper, seed=None):
    """Builds the optimizer; a stochastic-rounding fusedamp row also gets the seed, under the
    name its constructor uses (rounding_seed or seed). Returns (optimizer, {name: seed})."""
    extra = {}
    if seed is not None and row.family == "fusedamp" and row.kwargs.get(
            "master_weights") == "stochastic" and not row.unavailable:
        mod, _, name = row.factory.rpartition(".")
        try:
            names = inspect.signature(getattr(importlib.import_module(mod), name)).parameters
        except (TypeError, ValueError):
            names = {}
        for arg in ("rounding_seed", "seed"):
            if arg in names and arg not in row.kwargs:
                extra[arg] = seed
                break
    return row.build(params, hyper, extra), extra


def _short(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
    return s[:ERR_CHARS]


# ----------------------------------------------------------------------------- timing
def _split(flat, shapes, dtype, device):
    out, off = [], 0
    for s in shapes:
        n = math.prod(s)
        out.append(flat[off:off + n].view(s).to(device=device, dtype=dtype, copy=True))
        off += n
    return out


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_row(row: Row, size: Size, w, g, device, hyper, reps, warmup) -> dict:
    params = [torch.nn.Parameter(t) for t in _split(w, size.shapes, row.param_dtype, device)]
    grads = _split(g, size.shapes, row.param_dtype, device)
    pristine = [x.clone() for x in grads]
    for p, gr in zip(params, grads):
        p.grad = gr
    opt = row.build(params, hyper)

    def restore():
        torch._foreach_copy_(grads, pristine)

    restore()
    _sync(device)
    t0 = time.perf_counter()
    opt.step()  # state allocation (and compilation for torchao)
    _sync(device)
    first = time.perf_counter() - t0
    for _ in range(warmup):
        restore()
        opt.step()
    probe = max(params, key=lambda t: t.numel())
    before = probe.detach().clone()
    times = []
    for _ in range(reps):
        restore()
        _sync(device)
        t0 = time.perf_counter()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
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
                print(f"{label} {fmt_t(r['median_s']):>8} ms   first step "
                      f"{r['first_step_s']:.2f} s", file=sys.stderr, flush=True)
            except Exception as e:  # record and go on
                failures.append({"row": row.key, "size": size.name, "error": _short(e)})
                print(f"{label} failed: {_short(e)}", file=sys.stderr, flush=True)
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


# ----------------------------------------------------------------------------- accuracy
def _amp_models():
    sys.path.insert(0, str(REPO / "examples" / "python"))
    import amp_models
    return amp_models


class Task:
    """One model, its data and its evaluation; batches come from a generator seeded per run."""

    def __init__(self, name, device, batch):
        self.am = am = _amp_models()
        self.name, self.device, self.batch = name, device, batch
        if name == "digits-cnn":
            (self.xtr, self.ytr), (self.xte, self.yte) = am.digits_data(device)
        elif name == "char-gpt":
            self.context = 64
            self.train, self.val, self.vocab = am.char_data(device, self.context)
        else:
            raise ValueError(name)

    def model(self):
        am = self.am
        return am.DigitsCNN() if self.name == "digits-cnn" else am.CharGPT(self.vocab,
                                                                              self.context)

    def next_batch(self, gen, dtype):
        if self.name == "digits-cnn":
            ix = torch.randint(0, len(self.xtr), (self.batch,), generator=gen).to(self.device)
            return self.xtr[ix].to(dtype), self.ytr[ix]
        return self.am.char_batch(self.train, self.batch, self.context, gen)

    def loss(self, model, x, y):
        logits = model(x)
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model, dtype):
        model.eval()
        try:
            if self.name == "digits-cnn":
                logits = model(self.xte.to(dtype)).float()
                return {"eval_loss": torch.nn.functional.cross_entropy(logits, self.yte).item(),
                        "accuracy": (logits.argmax(1) == self.yte).float().mean().item()}
            loss, ppl = self.am.char_eval(model, self.val, self.context)
            return {"eval_loss": loss, "perplexity": ppl}
        finally:
            model.train()


def train_one(task: Task, row: Row, steps, hyper, seed, device) -> dict:
    torch.manual_seed(seed)
    model = task.model().to(device)  # FP32 init, identical for every row
    dtype = row.param_dtype
    model.to(dtype)
    params = list(model.parameters())
    opt, seeded = build_row(row, params, hyper, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    losses, t0 = [], time.perf_counter()
    for i in range(steps):
        if i == 1:  # the first step allocates the state (and compiles, for torchao)
            _sync(device)
            t0 = time.perf_counter()
        x, y = task.next_batch(gen, dtype)
        loss = task.loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    _sync(device)
    wall = time.perf_counter() - t0
    curve = [float(v) for v in torch.stack(losses).float().cpu().tolist()]
    tail = curve[-20:]
    out = {"row": row.key, "model": task.name, "steps": steps,
           "final_train_loss": sum(tail) / len(tail),
           "ms_per_step": 1e3 * wall / max(steps - 1, 1),
           "state_bytes_measured": measured_state_bytes(opt),
           "nonfinite_loss": not all(math.isfinite(v) for v in curve), "loss_curve": curve}
    if seeded:
        out["seed_kwargs"] = seeded
    out.update(task.evaluate(model, dtype))
    return out


def run_accuracy(args, rows, device, hyper):
    results, failures = [], []
    acc_rows = [fp32_reference_row()] + rows
    for name in args.models:
        task = Task(name, device, args.digits_batch if name == "digits-cnn" else args.char_batch)
        for row in acc_rows:
            label = f"{name:>10} | {row.key:<36}"
            if row.unavailable:
                failures.append({"row": row.key, "model": name, "error": row.unavailable})
                print(f"{label} skipped: {row.unavailable}", file=sys.stderr, flush=True)
                continue
            try:
                r = train_one(task, row, args.steps, hyper, args.seed, device)
                results.append(r)
                extra = f"  acc {r['accuracy']:.3f}" if "accuracy" in r else ""
                print(f"{label} train {r['final_train_loss']:.4f}  eval {r['eval_loss']:.4f}"
                      f"{extra}  ({r['ms_per_step']:.1f} ms/step)", file=sys.stderr, flush=True)
            except Exception as e:
                failures.append({"row": row.key, "model": name, "error": _short(e)})
                print(f"{label} failed: {_short(e)}", file=sys.stderr, flush=True)
            gc.collect()
    return results, failures, acc_rows


# ----------------------------------------------------------------------------- machine
def machine_info(device) -> dict:
    """bench_step's machine record (it imports fusedamp to name its module and commit); when
    that fails, torch's side of it and the reason."""
    try:
        import bench_step
        return bench_step.machine_info(device)
    except Exception as e:
        return {"date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "torch": torch.__version__, "device": device,
                "fusedamp_module": f"unavailable ({_short(e)})"}


def library_versions() -> dict:
    out = {"torch": torch.__version__}
    for dist, mod in [("torch-optimi", "optimi"), ("torchao", "torchao"),
                      ("bitsandbytes", "bitsandbytes"),
                      ("fusedamp", "fusedamp"), ("triton", "triton")]:
        m, why = _try_import(mod)
        out[dist] = (_version(dist, m) or getattr(m, "__version__", "?")) if m else why
    return out


# ----------------------------------------------------------------------------- report
def row_table(rows, hyper):
    return [{"row": r.key, "family": r.family, "constructor": r.ctor_text(hyper),
             "param_dtype": str(r.param_dtype).replace("torch.", ""),
             "state_dtype": r.state_dtype_text, "state": [list(s) for s in r.state],
             "state_bytes_per_param": r.state_bytes(),
             "moved_bytes_per_param_one_pass": r.moved_one_pass(),
             "moved_bytes_per_param_implemented": r.moved_as_implemented(),
             "implementation": r.implementation_text(), "baseline": r.baseline,
             "note": r.note, "unavailable": r.unavailable} for r in rows]


def _md_machine(info):
    return ["| machine | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in info.items()]


def write_markdown(path, doc):
    device = doc["device"]
    L = [f"# fusedamp master-weight modes — {device}", ""]
    for part in ("timing", "accuracy"):
        if part in doc:
            L.append(f"{part.capitalize()} part produced by `{doc[part]['command']}` on "
                     f"{doc[part]['machine']['date_utc']}.")
    L += ["", "BF16 parameters and BF16 gradients throughout, no loss scaler. See the docstring "
          "of benchmarks/bench_master_modes.py for the method.", "",
          "## Libraries", "", "| library | version |", "| --- | --- |"]
    L += [f"| {k} | {v} |" for k, v in doc["libraries"].items()]
    L += ["", "## Rows", "", "| row | constructor | moments | note |", "| --- | --- | --- | --- |"]
    for r in doc["rows"]:
        note = r["note"] + (f" **Not run: {r['unavailable']}**" if r["unavailable"] else "")
        L.append(f"| {r['row']} | `{r['constructor']}` | {r['state_dtype']} | {note} |")

    if "timing" in doc:
        t = doc["timing"]
        base = next((r["row"] for r in doc["rows"] if r["baseline"]), "?")
        L += ["", "## Step time", "", *_md_machine(t["machine"]), "",
              f"Hyper-parameters: {t['hyper_parameters']}. Median step time in ms over "
              f"{t['reps']} repetitions after {t['warmup']} warm-up steps (p10–p90 in the "
              f"detail table); × base = time / time of `{base}` at the same size (> 1: slower). "
              "A row that did not run shows its error.", ""]
        sizes = [s["name"] for s in t["sizes"]]
        L += ["| size | tensors | parameters | shape source |", "| --- | --: | --: | --- |"]
        L += [f"| {s['name']} | {s['tensors']:,} | {s['parameters']:,} | {s['shape_source']} |"
              for s in t["sizes"]]
        L += ["", "| row | " + " | ".join(f"{s} ms | × base" for s in sizes) + " |",
              "| --- | " + " | ".join("--: | --:" for _ in sizes) + " |"]
        res = {(r["row"], r["size"]): r for r in t["results"]}
        fail = {(f["row"], f["size"]): f["error"] for f in t["failures"]}
        described = {r["row"]: r["state_bytes_per_param"] for r in doc["rows"]}
        errors, mismatch = {}, False
        for row in doc["rows"]:
            if not any((row["row"], s) in res or (row["row"], s) in fail for s in sizes):
                continue
            cells = []
            for s in sizes:
                r = res.get((row["row"], s))
                if r:
                    vb = r.get("vs_baseline")
                    mark = ""
                    want = described.get(row["row"])
                    if want is not None and abs(r["state_bytes_measured"] - want) > 0.05:
                        mark, mismatch = " ‡", True
                    cells += [fmt_t(r["median_s"]) + mark, f"{vb:.2f}" if vb else "—"]
                else:
                    err = fail.get((row["row"], s), "not run")
                    n = errors.setdefault(err, len(errors) + 1)
                    cells += [f"error [{n}]", "—"]
            L.append(f"| {row['row']} | " + " | ".join(cells) + " |")
        if mismatch:
            L += ["", "‡ optimizer.state holds a different number of bytes per parameter than "
                  "the row describes (see the detail and bytes tables): the requested master "
                  "mode or state dtype is not what ran."]
        if errors:
            L += [""] + [f"[{n}] {e}" + "  " for e, n in errors.items()]
        L += ["", "Detail: p10–p90 of the step time; first step = state allocation (and "
              "torch.compile for torchao), seconds; state B/param measured = bytes of the tensors "
              "in optimizer.state after the steps, per parameter; changed = the largest weight "
              "tensor changed during the timed steps; GB/s = bytes moved as implemented (table "
              "below) × parameters / median time: the rate at which the row moves its bytes "
              "(a kernel at the memory limit cannot raise it; one below it is bound by work).",
              "", "| size | row | time ms | p10–p90 ms | first step s | state B/param measured | "
              "changed | GB/s |", "| --- | --- | --: | --: | --: | --: | --- | --: |"]
        for r in t["results"]:
            gbps = (f"{r['achieved_bytes_per_s'] / 1e9:.1f}" if "achieved_bytes_per_s" in r
                    else "—")
            L.append(f"| {r['size']} | {r['row']} | {fmt_t(r['median_s'])} | "
                     f"{fmt_t(r['p10_s'])}–{fmt_t(r['p90_s'])} | {r['first_step_s']:.2f} | "
                     f"{r['state_bytes_measured']:.2f} | "
                     f"{'yes' if r['weight_changed'] else '**no**'} | {gbps} |")

    L += ["", "## Bytes per parameter", "",
          "state = optimizer state besides the weight (from each row's description; "
          "**measured** in the detail table above where it differs); moved, one pass = "
          "grad read (2) + weight read and write (2 + 2) + every state buffer read and written, "
          "what one fused kernel must move; moved, as implemented = counted from the passes the "
          "implementation runs (same as one pass for single-kernel rows, plus extra passes).", "",
          "| row | state buffers | state B/param | moved B/param, one pass | "
          "moved B/param, as implemented | implementation |",
          "| --- | --- | --: | --: | --: | --- |"]
    measured = {}
    for r in doc.get("timing", {}).get("results", []):
        measured.setdefault(r["row"], r["state_bytes_measured"])
    for r in doc["rows"]:
        st = ", ".join(f"{n} {b}" for n, b in r["state"])
        sb = f"{r['state_bytes_per_param']}"
        m = measured.get(r["row"])
        if m is not None and abs(m - r["state_bytes_per_param"]) > 0.05:
            sb += f" (**measured {m:.2f}**)"
        L.append(f"| {r['row']} | {st} | {sb} | {r['moved_bytes_per_param_one_pass']} | "
                 f"{r['moved_bytes_per_param_implemented']} | {r['implementation']} |")

    if "accuracy" in doc:
        a = doc["accuracy"]
        L += ["", "## Accuracy", "", *_md_machine(a["machine"]), "",
              f"{a['steps']} steps per run, seed {a['seed']}; hyper-parameters "
              f"{a['hyper_parameters']} for every row and model; batch: digits "
              f"{a['batch']['digits-cnn']} images, char-GPT {a['batch']['char-gpt']} × 64 "
              "characters. train loss = mean of the last 20 steps; "
              "eval = held-out set (digits: 297 test images; char-GPT: 8 validation batches). "
              "Δ = row − FP32 reference; ms/step = wall time of a training step (forward, "
              "backward, optimizer), first step excluded.", ""]
        res = {(r["row"], r["model"]): r for r in a["results"]}
        fail = {(f["row"], f["model"]): f["error"] for f in a["failures"]}
        ref = a["reference"]
        described = {r["row"]: r["state_bytes_per_param"] for r in doc["rows"]}
        errors, mismatch = {}, False
        for model in a["models"]:
            rr = res.get((ref, model))
            acc = model == "digits-cnn"
            L += [f"### {model}", "",
                  "| row | train loss | Δ train | eval loss | Δ eval | " +
                  ("test acc | Δ acc | " if acc else "") + "ms/step |",
                  "| --- | --: | --: | --: | --: | " + ("--: | --: | " if acc else "") + "--: |"]
            for row in a["rows"]:
                r = res.get((row, model))
                if r is None:
                    err = fail.get((row, model))
                    if err:
                        n = errors.setdefault(err, len(errors) + 1)
                        L.append(f"| {row} | error [{n}] | " + " | ".join(
                            "—" for _ in range(6 if acc else 4)) + " |")
                    continue

                def d(k, fmt="+.4f"):
                    return format(r[k] - rr[k], fmt) if rr and k in rr else "—"
                cells = [f"{r['final_train_loss']:.4f}", d("final_train_loss"),
                         f"{r['eval_loss']:.4f}", d("eval_loss")]
                if acc:
                    cells += [f"{100 * r['accuracy']:.1f}%",
                              (f"{100 * (r['accuracy'] - rr['accuracy']):+.1f}" if rr else "—")]
                cells.append(f"{r['ms_per_step']:.1f}")
                flag = " (non-finite loss)" if r["nonfinite_loss"] else ""
                want = described.get(row)
                if want is not None and abs(r.get("state_bytes_measured", want) - want) > 0.05:
                    flag += " ‡"
                    mismatch = True
                L.append(f"| {row}{flag} | " + " | ".join(cells) + " |")
            L.append("")
        if mismatch:
            L += ["‡ optimizer.state after training holds a different number of bytes per "
                  "parameter than the row describes: the requested master mode or state dtype "
                  "is not what ran.", ""]
        L += [f"[{n}] {e}" + "  " for e, n in errors.items()]
    Path(path).write_text("\n".join(L).rstrip() + "\n")


def print_summary(doc):
    if "timing" in doc:
        t = doc["timing"]
        print("\nstep time (ms; × baseline)")
        for r in t["results"]:
            vb = r.get("vs_baseline")
            print(f"  {r['size']:>14}  {r['row']:<36} {fmt_t(r['median_s']):>8}  "
                  f"{'' if vb is None else f'{vb:5.2f}x'}")
        for f in t["failures"]:
            print(f"  {f['size']:>14}  {f['row']:<36} ERROR {f['error'][:120]}")
    print("\nbytes per parameter (state; moved one pass; moved as implemented)")
    for r in doc["rows"]:
        print(f"  {r['row']:<48} {r['state_bytes_per_param']:>3} "
              f"{r['moved_bytes_per_param_one_pass']:>4} "
              f"{r['moved_bytes_per_param_implemented']:>4}")
    if "accuracy" in doc:
        a = doc["accuracy"]
        print("\naccuracy")
        for r in a["results"]:
            acc = f"  acc {r['accuracy']:.3f}" if "accuracy" in r else ""
            print(f"  {r['model']:>10}  {r['row']:<48} train {r['final_train_loss']:.4f}  "
                  f"eval {r['eval_loss']:.4f}{acc}")
        for f in a["failures"]:
            print(f"  {f['model']:>10}  {f['row']:<48} ERROR {f['error'][:120]}")


# ----------------------------------------------------------------------------- main
def _parse_kw(items):
    out = {}
    for it in items or []:
        k, _, v = it.partition("=")
        try:
            out[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k] = v
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    part = ap.add_mutually_exclusive_group()
    part.add_argument("--accuracy", action="store_true", help="run the accuracy part only")
    part.add_argument("--all", action="store_true", help="step time and accuracy")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: shrunk sizes, few repetitions, few training steps; "
                         "files only with an explicit --out")
    ap.add_argument("--sizes", nargs="*", help=f"of {list(all_sizes())} (default: resnet50 "
                    f"gpt2-124M; with --quick the /{QUICK_SHRINK} versions)")
    ap.add_argument("--rows", nargs="*", help="substrings; keep rows matching any")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 10 CPU, "
                    "50 CUDA; 3 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="(default 2 CPU, 10 CUDA; 1 quick)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: 1 for the step time, all cores for accuracy)")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps per accuracy run (default 200; 30 with --quick)")
    ap.add_argument("--models", nargs="*", default=["digits-cnn", "char-gpt"],
                    choices=["digits-cnn", "char-gpt"])
    ap.add_argument("--digits-batch", type=int, default=64, help="images per step")
    ap.add_argument("--char-batch", type=int, default=16, help="sequences of 64 characters "
                    "per step")
    ap.add_argument("--acc-lr", type=float, default=1e-4,
                    help="learning rate of every accuracy run (default 1e-4: plain BF16 stalls)")
    ap.add_argument("--acc-wd", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fusedamp-kw", nargs="*", metavar="KEY=VALUE",
                    help="extra fusedamp.optim.AdamW arguments (Python literals), e.g. "
                         "skip_nonfinite=False")
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/results)")
    args = ap.parse_args(argv)

    device = args.device
    cuda = device == "cuda"
    do_timing = not args.accuracy
    do_accuracy = args.accuracy or args.all
    if args.reps is None:
        args.reps = 3 if args.quick else (50 if cuda else 10)
    if args.warmup is None:
        args.warmup = 1 if args.quick else (10 if cuda else 2)
    if args.steps is None:
        args.steps = 30 if args.quick else 200
    sizes_by_name = all_sizes()
    names = args.sizes or ([f"resnet50/{QUICK_SHRINK}", f"gpt2-124M/{QUICK_SHRINK}"]
                           if args.quick else ["resnet50", "gpt2-124M"])
    unknown = [n for n in names if n not in sizes_by_name]
    if unknown:
        ap.error(f"unknown size(s) {unknown}; choose from {list(sizes_by_name)}")
    sizes = [sizes_by_name[n] for n in names]

    fusedamp_kw = _parse_kw(args.fusedamp_kw)
    rows = make_rows(device, fusedamp_kw)
    if args.rows:
        rows = [r for r in rows if r.baseline or any(s in r.key for s in args.rows)]
    command = "python3 " + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:])
    libs = library_versions()

    out_dir = Path(args.out) if args.out else (None if args.quick else HERE / "results")
    tag = device_tag(device)
    doc = {}
    if out_dir is not None and (out_dir / f"master_modes_{tag}.json").exists():
        try:
            doc = json.loads((out_dir / f"master_modes_{tag}.json").read_text())
        except (OSError, ValueError):
            doc = {}
    doc.update(device=device, libraries=libs)

    hyper = {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}
    if do_timing:
        torch.set_num_threads(args.threads or 1)
        info = machine_info(device)
        results, failures = run_timing(args, rows, sizes, device, hyper)
        if hasattr(os, "getloadavg"):
            info["load_average_at_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        doc["timing"] = {
            "machine": info, "command": command, "reps": args.reps, "warmup": args.warmup,
            "hyper_parameters": hyper, "grad_std": GRAD_STD, "weight_std": 0.02,
            "fusedamp_extra_kwargs": fusedamp_kw,
            "sizes": [{"name": s.name, "tensors": len(s.shapes), "parameters": s.numel,
                       "shape_source": s.source} for s in sizes],
            "results": results, "failures": failures}
    if do_accuracy:
        torch.set_num_threads(args.threads or os.cpu_count())
        info = machine_info(device)
        acc_hyper = {"lr": args.acc_lr, "betas": list(BETAS), "eps": EPS,
                     "weight_decay": args.acc_wd}
        t0 = time.perf_counter()
        results, failures, acc_rows = run_accuracy(args, rows, device, acc_hyper)
        info["wall_s"] = round(time.perf_counter() - t0, 1)
        doc["accuracy"] = {
            "machine": info, "command": command, "steps": args.steps, "seed": args.seed,
            "models": args.models, "hyper_parameters": acc_hyper,
            "batch": {"digits-cnn": args.digits_batch, "char-gpt": args.char_batch},
            "fusedamp_extra_kwargs": fusedamp_kw,
            "reference": acc_rows[0].key, "rows": [r.key for r in acc_rows],
            "results": results, "failures": failures}
        ref = acc_rows[0]
        rows_doc = row_table([ref] + rows, hyper)
    else:
        rows_doc = row_table(rows, hyper)
    # Merge the row descriptions: this run's, plus the earlier ones that the other part's
    # results still refer to (the FP32 reference first).
    old = {r["row"]: r for r in doc.get("rows", [])}
    new = {r["row"]: r for r in rows_doc}
    used = set(new)
    for part in ("timing", "accuracy"):
        for r in doc.get(part, {}).get("results", []) + doc.get(part, {}).get("failures", []):
            used.add(r["row"])
    keys = list(dict.fromkeys([k for k in old if k in used] + list(new)))
    keys.sort(key=lambda k: not k.startswith("FP32 reference"))
    doc["rows"] = [new.get(k) or old[k] for k in keys]
    print_summary(doc)
    if out_dir is None:
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"master_modes_{tag}.json").write_text(json.dumps(doc, indent=1) + "\n")
    write_markdown(out_dir / f"master_modes_{tag}.md", doc)
    print(f"wrote {out_dir}/master_modes_{tag}.{{json,md}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
