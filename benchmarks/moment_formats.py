#!/usr/bin/env python3
"""8-bit storage formats for AdamW's two moments: which element code and which block size the
fused kernels should implement, decided by training the demo's models with each one.

    PYTHONPATH=python:examples/python:benchmarks python3 benchmarks/moment_formats.py
    PYTHONPATH=python:examples/python:benchmarks python3 benchmarks/moment_formats.py --quick

Optimizer. A reference AdamW in plain PyTorch (FP32 weights and arithmetic; betas (0.9, 0.999),
eps 1e-8, weight decay 0.01, torch's update formula; checked against torch.optim.AdamW at the
start of every run). The moments live in flat FP32 buffers in which every parameter's segment
starts on a multiple of 256 elements, so a block of B elements (B dividing 256) never spans two
tensors and a tensor's last block is partial (the zeros after it change no block maximum). Within
a step the new moments are formed from the stored (dequantized) ones and the FP32 gradient, the
update reads them in FP32, and only then are they stored: quantized and dequantized in place.
That is what a fused kernel does when it loads a block, updates it in registers and writes it
back, so the quantization error enters through the next step's moments.

Formats, each block with one scale stored in FP16, rounded up to the next FP16 value (rounding to
nearest could put the scale below the block's maximum and a small block's scale at zero; rounded
up, every code stays in range and a nonzero block keeps a nonzero scale):
  exp_avg (int8, codes -127..127, u = m / absmax of the block):
    lin       q = round(127 u)
    softsign  q = round(127 c(u)), c(u) = 2u / (1 + |u|)      (twice lin's resolution near 0)
    sqrt      q = round(127 c(u)), c(u) = sign(u) |u|^(1/2)   (resolution grows towards 0)
  exp_avg_sq (uint8, codes 0..255), stored as x = v^p with the block maximum of x as scale,
  q = round(255 x / max x), dequantized as (q / 255 max x)^(1/p):
    lin       p = 1
    sqrt      p = 1/2  (sqrt(v) linearly: the quantity the update divides by)
    4th-root  p = 1/4
Baselines: FP32 moments (the reference) and BF16 moments (round to nearest, what fusedamp's
state_dtype=torch.bfloat16 stores). Storage per element of a moment: 4, 2, or 1 + 2/B bytes.

Runs. Stage 1: FP32, BF16 and the nine (exp_avg, exp_avg_sq) pairs at B = 32; stage 2: the two
best pairs of stage 1 (rank_pairs) at B = 64, 128, 256; stage 3: the recommended pair and block
size (choose_block) with its scale stored as BF16 instead of FP16 (same bytes; not a format
asked for: it measures what FP16's range costs). Each on the digits CNN (lr 2e-3, batch 64) and
the character GPT (dim 128, 2 blocks, context 64, batch 16, lr 1e-3) of
examples/python/amp_models.py, several seeds (seed = initial weights and batch order, the same
for every format, so runs with the same seed are paired). Reported: training loss (mean of the
last 20 steps), held-out loss (digits: the 297 test images, also accuracy; char-GPT: 8 fixed
validation batches of 32), mean ± sample standard deviation over seeds, the difference of the
means from FP32's in units of FP32's seed-to-seed standard deviation; the update error, against
the update exact moments kept alongside in FP32 would give on the run's own gradients; how far
the stored sqrt(v) has drifted from the exact one by the end; the largest |update| / lr seen,
and the share of element-steps whose |update| / lr exceeds 1.5 times what exact Adam can reach
at that step (adam_bound): such steps are made by the storage, not by the gradients.

Diagnostic. During the FP32 run of the first seed, at a few checkpoints, the exact moments are
put through every format once and compared with the exact ones: relative RMS error, the share
of nonzero values stored as 0, and the error of the update direction m / (sqrt(v) + eps) (bias
corrected) the next step would take from them with its own gradient, against the exact one.

Writes benchmarks/results/moment_formats_<device>.{json,md}; --quick is a smoke run that writes
files only with --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "examples" / "python"))
sys.path.insert(0, str(REPO / "python"))
from amp_models import (CharGPT, DigitsCNN, char_batch, char_data, char_eval,  # noqa: E402
                        char_loss, digits_data, digits_eval, digits_loss)
from bench_step import device_tag, machine_info  # noqa: E402

BETAS = (0.9, 0.999)
EPS = 1e-8
WD = 0.01
ALIGN = 256                  # every block size studied divides it
BLOCKS = (32, 64, 128, 256)
M_CODES = ("lin", "softsign", "sqrt")
V_CODES = ("lin", "sqrt", "4th-root")
V_POWER = {"lin": 1.0, "sqrt": 0.5, "4th-root": 0.25}
# An error of half an Adam step in an element's update changes the step, not its last digits.
BAD_DIRECTION = 0.5
# Rounding alone (BF16's 2^-9, a code's step) lifts updates at the bound a little above it (at
# step 1 every |update| / lr is exactly the bound, 1); half as much again is a blow-up.
BOUND_MARGIN = 1.5


# ----------------------------------------------------------------------------- formats
SCALE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def block_scale(absmax, scale):
    """absmax as stored: rounded up to FP16 (saturating at its largest) or BF16, or FP32 as it
    is; returned in FP32."""
    if scale == "fp32":
        return absmax
    dtype = SCALE_DTYPES[scale]
    top = torch.finfo(dtype).max
    s = absmax.clamp(max=top).to(dtype)
    low = (s.float() < absmax) & (s < top)
    s = torch.where(low, torch.nextafter(s, torch.full_like(s, math.inf)), s)
    return s.float()


def _compand(code, u):
    if code == "lin":
        return u
    if code == "softsign":
        return 2 * u / (1 + u.abs())
    if code == "sqrt":
        return u.sign() * u.abs().sqrt()
    raise ValueError(code)


def _expand(code, c):
    if code == "lin":
        return c
    if code == "softsign":
        return c / (2 - c.abs())
    if code == "sqrt":
        return c * c.abs()
    raise ValueError(code)


def roundtrip_m(x, code, block, scale="fp16"):
    """exp_avg through int8 storage: codes -127..127 of c(m / absmax), one absmax per block
    (FP16; BF16 or FP32 to tell the code's error from the FP16 scale's)."""
    xb = x.view(-1, block)
    scale = block_scale(xb.abs().amax(1, keepdim=True), scale)
    u = xb / torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(127 * _compand(code, u)).clamp_(-127, 127)
    return (_expand(code, q / 127) * scale).view(-1)


def _power(x, p):
    if p == 1.0:
        return x
    if p == 0.5:
        return x.sqrt()
    if p == 0.25:
        return x.sqrt().sqrt()
    return x.pow(p)


def _unpower(y, p):
    if p == 1.0:
        return y
    if p == 0.5:
        return y * y
    if p == 0.25:
        y = y * y
        return y * y
    return y.pow(1 / p)


def roundtrip_v(x, code, block, scale="fp16"):
    """exp_avg_sq through uint8 storage: codes 0..255 of v**p / max(v**p), one max per block."""
    p = V_POWER[code]
    yb = _power(x, p).view(-1, block)
    scale = block_scale(yb.amax(1, keepdim=True), scale)
    u = yb / torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(255 * u).clamp_(0, 255)
    return _unpower(q / 255 * scale, p).view(-1)


@dataclass(frozen=True)
class Storage:
    """How the two moments are stored: "fp32", "bf16", or an 8-bit code with block size."""
    m: str
    v: str
    block: int | None = None
    scale: str = "fp16"                 # both moments' block scales ...
    m_scale: str | None = None          # ... or exp_avg's, where it differs

    @property
    def key(self):
        if self.m == self.v and self.m in ("fp32", "bf16"):
            return self.m.upper()
        return (f"m {self.m} / v {self.v}" + (f", B={self.block}" if self.block else "")
                + self._scale_text())

    @property
    def scale_of_m(self):
        return self.m_scale or self.scale

    def _scale_text(self):
        if self.scale_of_m != self.scale:
            return (f", {self.scale_of_m.upper()} scale for m"
                    + ("" if self.scale == "fp16" else f", {self.scale.upper()} for v"))
        return "" if self.scale == "fp16" else f", {self.scale.upper()} scale"

    def element_bytes(self, code):
        return {"fp32": 4.0, "bf16": 2.0}.get(code, 1 + 2 / (self.block or 1))

    @property
    def bytes_per_param(self):
        """Storage of both moments per parameter (codes plus their share of the FP16 scales)."""
        return self.element_bytes(self.m) + self.element_bytes(self.v)

    def store_m(self, x):
        if self.m == "fp32":
            return x
        if self.m == "bf16":
            return x.bfloat16().float()
        return roundtrip_m(x, self.m, self.block, self.scale_of_m)

    def store_v(self, x):
        if self.v == "fp32":
            return x
        if self.v == "bf16":
            return x.bfloat16().float()
        return roundtrip_v(x, self.v, self.block, self.scale)

    def as_dict(self):
        return {"key": self.key, "exp_avg": self.m, "exp_avg_sq": self.v, "block": self.block,
                "scale": self.scale, "m_scale": self.m_scale,
                "bytes_per_param": self.bytes_per_param}


FP32 = Storage("fp32", "fp32")
BF16 = Storage("bf16", "bf16")


def pairs(block):
    return [Storage(m, v, block) for m in M_CODES for v in V_CODES]


# ----------------------------------------------------------------------------- optimizer
def adam_bound(t):
    """The largest |m_hat| / sqrt(v_hat) exact Adam can reach at step t, whatever the gradients:
    Cauchy-Schwarz on the two moving averages (gradients growing by beta2 / beta1 per step
    attain it; eps only lowers it). 1 at t = 1, 2.2 at t = 100, 7.27 in the limit, not the
    (1 - beta1) / sqrt(1 - beta2) = 3.16 of a lone gradient."""
    b1, b2 = BETAS
    r = b1 * b1 / b2
    return ((1 - b1) / math.sqrt(1 - b2) * math.sqrt((1 - r ** t) / (1 - r))
            * math.sqrt(1 - b2 ** t) / (1 - b1 ** t))


def adam_direction(m, v, t):
    """The bias-corrected AdamW update divided by -lr (torch's formula)."""
    bc1, bc2 = 1 - BETAS[0] ** t, 1 - BETAS[1] ** t
    return (m / bc1) / (v.sqrt() / math.sqrt(bc2) + EPS)


class ReferenceAdamW:
    """AdamW whose moments are stored in `storage` between steps (see the module docstring)."""

    def __init__(self, named_params, lr, storage, weight_decay=WD):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.lr, self.wd, self.storage = lr, weight_decay, storage
        self.segments, off = [], 0
        for p in self.params:
            self.segments.append((off, p.numel()))
            off += -(-p.numel() // ALIGN) * ALIGN
        self.m, self.v, self.g = (torch.zeros(off) for _ in range(3))
        self.real = torch.zeros(off, dtype=torch.bool)
        for o, n in self.segments:
            self.real[o:o + n] = True
        self.t = 0
        self.max_dir = torch.zeros(())
        self.out_of_bound = torch.zeros((), dtype=torch.long)
        # The moments exact arithmetic would hold on this run's own gradients: the error the
        # storage has accumulated, which one quantization of exact moments does not show.
        self.shadow = storage != FP32
        if self.shadow:
            self.m_exact, self.v_exact = torch.zeros(off), torch.zeros(off)
            self.dir_err_sq = torch.zeros((), dtype=torch.float64)
            self.dir_ref_sq = torch.zeros((), dtype=torch.float64)

    @torch.no_grad()
    def step(self, probe=None):
        self.t += 1
        for p, (o, n) in zip(self.params, self.segments):
            if p.grad is None:
                self.g[o:o + n].zero_()
            else:
                self.g[o:o + n].copy_(p.grad.reshape(-1))
        if probe is not None:  # sees the stored moments of step t - 1 and step t's gradient
            probe(self)
        b1, b2 = BETAS
        self.m.mul_(b1).add_(self.g, alpha=1 - b1)
        self.v.mul_(b2).addcmul_(self.g, self.g, value=1 - b2)
        d = adam_direction(self.m, self.v, self.t)
        if self.shadow:
            self.m_exact.mul_(b1).add_(self.g, alpha=1 - b1)
            self.v_exact.mul_(b2).addcmul_(self.g, self.g, value=1 - b2)
            d_exact = adam_direction(self.m_exact, self.v_exact, self.t)
            self.dir_err_sq += (d - d_exact).square().sum()
            self.dir_ref_sq += d_exact.square().sum()
        a = d.abs()
        torch.maximum(self.max_dir, a.max(), out=self.max_dir)
        self.out_of_bound += (a > BOUND_MARGIN * adam_bound(self.t)).sum()
        for p, (o, n) in zip(self.params, self.segments):
            p.mul_(1 - self.lr * self.wd).add_(d[o:o + n].view_as(p), alpha=-self.lr)
        self.m.copy_(self.storage.store_m(self.m))
        self.v.copy_(self.storage.store_v(self.v))

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def drift(self):
        """The stored moments against the exact ones on the same gradients, after the last
        step: the update's relative RMS error over all steps, and sqrt(v) stored / exact (its
        geometric mean, and the shares of elements 10 % above, 10 % below or at 0)."""
        if not self.shadow:
            return {"update_rel_rms": 0.0, "sqrt_v_bias": 0.0, "sqrt_v_high": 0.0,
                    "sqrt_v_low": 0.0, "v_lost": 0.0}
        live = self.real & (self.v_exact > 0)
        ratio = (self.v[live] / self.v_exact[live]).sqrt()
        n = max(1, int(live.sum()))
        pos = ratio[ratio > 0]
        return {"update_rel_rms": (self.dir_err_sq / self.dir_ref_sq).sqrt().item(),
                "sqrt_v_bias": pos.log().mean().exp().item() - 1 if len(pos) else math.nan,
                "sqrt_v_high": (ratio > 1.1).sum().item() / n,
                "sqrt_v_low": ((ratio < 1 / 1.1) & (ratio > 0)).sum().item() / n,
                "v_lost": (ratio == 0).sum().item() / n}


# ----------------------------------------------------------------------------- tasks
@dataclass
class TaskSpec:
    model: str
    lr: float
    batch: int
    steps: int


def make_task(spec, seed):
    """(model, next_batch(), loss_fn, evaluate() -> dict) with seed's weights and batches."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    if spec.model == "digits-cnn":
        (xtr, ytr), (xte, yte) = digits_data("cpu")
        model = DigitsCNN()

        def batch():
            ix = torch.randint(0, len(xtr), (spec.batch,), generator=g)
            return xtr[ix], ytr[ix]

        def evaluate():
            loss, acc = digits_eval(model, xte, yte)
            return {"heldout_loss": loss, "accuracy": acc}

        return model, batch, digits_loss, evaluate
    if spec.model == "char-gpt":
        context = 64
        train, val, vocab = char_data("cpu", context)
        model = CharGPT(vocab, context, dim=128, layers=2, heads=4)

        def batch():
            return char_batch(train, spec.batch, context, g)

        def evaluate():
            model.eval()
            loss, _ = char_eval(model, val, context)
            model.train()
            return {"heldout_loss": loss}

        return model, batch, char_loss, evaluate
    raise ValueError(spec.model)


def teacher_forced_difference(spec, make_ours, make_ref, steps=5):
    """The largest weight difference after `steps` steps of a reference optimizer
    (make_ours(model)) and a torch one over copies of the weights (make_ref(params)), both
    given the reference model's gradients (teacher-forced: biases ahead of BatchNorm get
    gradients at rounding-noise level, so two free-running copies part within steps however
    exact the optimizer)."""
    model, batch, loss_fn, _ = make_task(spec, seed=0)
    twin = [p.detach().clone().requires_grad_() for p in model.parameters()]
    ours, ref = make_ours(model), make_ref(twin)
    for _ in range(steps):
        loss_fn(model, *batch()).backward()
        for p, q in zip(model.parameters(), twin):
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
        ours.zero_grad()
        ref.zero_grad()
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), twin))


def self_check(spec):
    """The reference optimizer with FP32 storage against torch.optim.AdamW."""
    err = teacher_forced_difference(
        spec, lambda model: ReferenceAdamW(model.named_parameters(), spec.lr, FP32),
        lambda params: torch.optim.AdamW(params, lr=spec.lr, betas=BETAS, eps=EPS,
                                         weight_decay=WD, foreach=False))
    if err > 1e-6:
        raise SystemExit(f"reference AdamW differs from torch.optim.AdamW by {err:g} on "
                         f"{spec.model}")
    return err


# ----------------------------------------------------------------------------- diagnostic
def _rel_rms(a, b):
    den = b.square().sum()
    return ((a - b).square().sum() / den).sqrt().item() if den > 0 else 0.0


FP16_MIN_NORMAL = 2.0 ** -14


def _subnormal_scales(y, block):
    """Share of the nonzero blocks of y >= 0 whose maximum is below FP16's smallest normal
    number: their FP16 scale has fewer than 11 significant bits, or is the smallest subnormal."""
    mx = y.view(-1, block).amax(1)
    nz = mx > 0
    return ((mx < FP16_MIN_NORMAL) & nz).sum().item() / max(1, nz.sum().item())


def _by_tensor(opt, mask, top=3):
    """The parameters holding the most elements of mask: [(name, count, share of the tensor)]."""
    counts = [(n, int(mask[o:o + k].sum().item()), k)
              for n, (o, k) in zip(opt.names, opt.segments)]
    counts = sorted((c for c in counts if c[1]), key=lambda c: -c[1])[:top]
    return [(n, c, c / k) for n, c, k in counts]


def diagnose(opt, storages):
    """Each storage applied to the exact stored moments of step t - 1, and the update direction
    of step t from them, against the exact one."""
    m, v, g, real, t = opt.m, opt.v, opt.g, opt.real, opt.t
    b1, b2 = BETAS
    d = adam_direction(b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g, t)
    n_real = real.sum().item()
    m_nz, v_nz = (m != 0) & real, (v > 0) & real
    g_zero = (g == 0) & real
    out = {"step": t - 1, "max_abs_direction_exact": d.abs().max().item(),
           "zero_gradient_share": g_zero.sum().item() / n_real}
    rows = {}
    for s in storages:
        mq, vq = s.store_m(m), s.store_v(v)
        dq = adam_direction(b1 * mq + (1 - b1) * g, b2 * vq + (1 - b2) * g * g, t)
        err = (dq - d).abs()
        bad = (err > BAD_DIRECTION) & real
        v_lost = (vq == 0) & v_nz
        n_bad = bad.sum().item()
        rows[s.key] = {
            # the blow-up's signature: v stored as 0, m not, and no gradient to refill v
            "bad_with_zero_gradient": (bad & g_zero).sum().item() / n_bad if n_bad else 0.0,
            "v_zeroed_by_tensor": _by_tensor(opt, v_lost),
            "bad_by_tensor": _by_tensor(opt, bad),
            "m_rel_rms": _rel_rms(mq, m), "v_rel_rms": _rel_rms(vq, v),
            "m_zeroed": ((mq == 0) & m_nz).sum().item() / max(1, m_nz.sum().item()),
            "v_zeroed": ((vq == 0) & v_nz).sum().item() / max(1, v_nz.sum().item()),
            "dir_rel_rms": _rel_rms(dq, d),
            "dir_bad": n_bad / n_real,
            "dir_out_of_bound": ((dq.abs() > BOUND_MARGIN * adam_bound(t)) & real).sum().item()
            / n_real,
            "max_abs_direction": dq.abs().max().item()}
        if s.block:
            if s.m in M_CODES and s.scale_of_m == "fp16":
                rows[s.key]["m_scale_subnormal"] = _subnormal_scales(m.abs(), s.block)
            if s.v in V_CODES and s.scale == "fp16":
                rows[s.key]["v_scale_subnormal"] = _subnormal_scales(
                    _power(v, V_POWER[s.v]), s.block)
    out["formats"] = rows
    return out


def diagnostic_storages():
    out = [BF16]
    out += [Storage(c, "fp32", 32) for c in M_CODES]   # one moment quantized, the other exact:
    out += [Storage("fp32", c, 32) for c in V_CODES]   # whose error the direction error is
    for scale in ("bf16", "fp32"):  # and how much of it FP16's range for the scale causes
        out += [Storage(c, "fp32", 32, scale) for c in M_CODES]
        out += [Storage("fp32", c, 32, scale) for c in V_CODES]
    for b in BLOCKS:
        out += pairs(b)
    return out


# ----------------------------------------------------------------------------- runs
def train(spec, storage, seed, checkpoints=(), diag_storages=()):
    model, batch, loss_fn, evaluate = make_task(spec, seed)
    opt = ReferenceAdamW(model.named_parameters(), spec.lr, storage)
    losses, diags = [], []
    t0 = time.perf_counter()
    for step in range(spec.steps):
        loss = loss_fn(model, *batch())
        loss.backward()
        probe = None
        if step in checkpoints:  # opt.t == step: moments of `step` steps, gradient of the next
            def probe(o):
                diags.append(diagnose(o, diag_storages))
        opt.step(probe)
        opt.zero_grad()
        losses.append(loss.detach())
    wall = time.perf_counter() - t0
    losses = torch.stack(losses).tolist()
    finite = all(math.isfinite(x) for x in losses)
    r = {"model": spec.model, "storage": storage.key, "seed": seed, "steps": spec.steps,
         "train_loss": statistics.fmean(losses[-20:]) if finite else math.nan,
         "loss_curve_every_10": losses[::10], "nonfinite_loss": not finite,
         "max_abs_direction": opt.max_dir.item(),
         "out_of_bound_share": opt.out_of_bound.item() / (spec.steps * opt.real.sum().item()),
         "ms_per_step": 1e3 * wall / spec.steps, "params": int(opt.real.sum().item())}
    r.update(opt.drift())
    r.update(evaluate())
    if diags:
        r["diagnostic"] = diags
    return r


def _mean_sd(vals):
    """Mean and sample sd; NaN for both where a run diverged (statistics.stdev raises on it)."""
    if not all(math.isfinite(x) for x in vals):
        return math.nan, math.nan
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else math.nan


def _nan_inf(x):
    return math.inf if math.isnan(x) else x


def summarize(results, spec_models, storages):
    """Per model and storage: mean and sample sd over seeds; difference from FP32 in FP32 sds."""
    out = []
    for model in spec_models:
        base = [r for r in results if r["model"] == model and r["storage"] == FP32.key]
        for s in storages:
            rs = [r for r in results if r["model"] == model and r["storage"] == s.key]
            if not rs:
                continue
            row = {"model": model, "storage": s.key, "bytes_per_param": s.bytes_per_param,
                   "bytes_exp_avg": s.element_bytes(s.m),
                   "bytes_exp_avg_sq": s.element_bytes(s.v), "seeds": len(rs)}
            for k in ("train_loss", "heldout_loss", "accuracy"):
                if k not in rs[0]:
                    continue
                vals, ref = [r[k] for r in rs], [r[k] for r in base]
                row[k], row[k + "_sd"] = _mean_sd(vals)
                ref_mean, ref_sd = _mean_sd(ref)
                delta = row[k] - ref_mean
                row[k + "_delta"] = delta
                row[k + "_delta_sds"] = (delta / ref_sd if ref_sd and math.isfinite(ref_sd)
                                         else math.nan)
            # NaN: the update itself went non-finite, the largest there is
            row["max_abs_direction"] = max(_nan_inf(r["max_abs_direction"]) for r in rs)
            row["nonfinite_seeds"] = sum(not math.isfinite(r["train_loss"])
                                         or not math.isfinite(r["heldout_loss"]) for r in rs)
            row["out_of_bound_share"] = statistics.fmean(r["out_of_bound_share"] for r in rs)
            row["ms_per_step"] = statistics.fmean(r["ms_per_step"] for r in rs)
            for k in ("update_rel_rms", "sqrt_v_bias", "sqrt_v_high", "sqrt_v_low", "v_lost"):
                row[k] = statistics.fmean(_nan_inf(r[k]) for r in rs)
            out.append(row)
    return out


def _worst_sds(summary, key):
    rows = [r for r in summary if r["storage"] == key]
    vals = [abs(r[k]) for r in rows for k in ("train_loss_delta_sds", "heldout_loss_delta_sds")
            if k in r]
    return max(vals) if vals and all(math.isfinite(x) for x in vals) else math.inf


def diag_mean(diag_by_model, key, field):
    """Mean of a diagnostic field over the checkpoints and models."""
    vals = [c["formats"][key][field] for ds in diag_by_model.values() for c in ds]
    return statistics.fmean(vals) if vals else math.nan


def update_error(summary, key):
    """The update's relative RMS error in training (against exact moments on the same
    gradients), mean over the models."""
    vals = [r["update_rel_rms"] for r in summary if r["storage"] == key]
    return statistics.fmean(vals) if vals else math.inf


def rank_pairs(summary, limit):
    """The B=32 pairs whose training and held-out losses all lie within `limit` FP32 sds of
    FP32's, best first by the update error in training: the loss test is blunt at a few seeds;
    the update error, summed over every step of every seed, is not. (All pairs, by the same
    order, if none passes.)"""
    ok = [s for s in pairs(32) if _worst_sds(summary, s.key) <= limit]
    return sorted(ok or pairs(32), key=lambda s: update_error(summary, s.key)), bool(ok)


def choose_block(summary, pair, limit, tolerance):
    """The largest B such that it and every smaller B keep the losses within `limit` FP32 sds
    and the update error in training within `tolerance` times B=32's. B=32 to 256 saves 0.11
    of 2.125 bytes per parameter (5 %): bytes are not worth more than that in accuracy."""
    base = update_error(summary, Storage(pair.m, pair.v, 32).key)
    best = 32
    for b in BLOCKS:
        key = Storage(pair.m, pair.v, b).key
        if not (any(r["storage"] == key for r in summary)
                and _worst_sds(summary, key) <= limit
                and update_error(summary, key) <= tolerance * base):
            break
        best = b
    return best


# ----------------------------------------------------------------------------- report
def _f(x, fmt=".4f"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if abs(x) >= 1e4:  # a diverged run: the order of magnitude is the information
        return format(x, "+.1e" if fmt.startswith("+") else ".1e")
    return format(x, fmt)


def _loss(x):
    return _f(x) if math.isnan(x) or abs(x) >= 0.1 else f"{x:.3e}"


def _pm(mean, sd):
    """mean ± sd, the sd to the mean's precision."""
    if math.isnan(mean) or abs(mean) >= 1e4:
        return f"{_f(mean)} ± {_f(sd, '.0e')}"
    if abs(mean) >= 0.1:
        return f"{mean:.4f} ± {_f(sd)}"
    return f"{mean:.3e} ± {_f(sd, '.1e')}"


def _pct(x):
    if x == 0:
        return "0"
    return f"{100 * x:.2g}" if 100 * x < 0.1 else f"{100 * x:.2f}"


def write_markdown(path, doc):
    info = doc["machine"]
    flags = ", ".join(info.get("cpu_flags", [])) or "—"
    tasks = doc["tasks"]
    summ, diag, c = doc["summary"], doc["diagnostic"], doc["choice"]
    last = max(t["steps"] for t in tasks)
    L = ["# 8-bit Adam moment formats — " + doc["device"], "",
         f"`{doc['command']}`", "",
         f"{info['date_utc']}; commit {info.get('fusedamp_commit', '?')}; {info['cpu']}, "
         f"{info['cpu_cores']} cores (flags: {flags}; torch CPU capability "
         f"{info['cpu_capability']}), {info['torch_threads']} torch threads; torch "
         f"{info['torch']}, Python {info['python']}; whole run {doc['wall_s'] / 60:.1f} min.", "",
         "Method: see the docstring of benchmarks/moment_formats.py. Reference AdamW in plain "
         "PyTorch, FP32 weights and arithmetic, betas (0.9, 0.999), eps 1e-8, weight decay "
         "0.01, no gradient clipping; the moments are replaced by their stored (quantized, "
         "dequantized) values after every step. "
         + "; ".join(f"{t['model']}: lr {t['lr']}, batch {t['batch']}, {t['steps']} steps"
                     for t in tasks)
         + f"; seeds {doc['seeds']} (the same weights and batches for every format). "
         "Reference optimizer vs torch.optim.AdamW, 5 steps on the same gradients, largest "
         "weight difference: "
         + ", ".join(f"{k} {v:.1e}" for k, v in doc["self_check"].items()) + ".", "",
         "## Formats", "",
         "| moment | code | element | dequantized |", "| --- | --- | --- | --- |",
         "| exp_avg | lin | int8 round(127 u), u = m / absmax | 127ths × absmax |",
         "| exp_avg | softsign | int8 round(127 c), c = 2u / (1 + \\|u\\|) | c / (2 − \\|c\\|) "
         "× absmax |",
         "| exp_avg | sqrt | int8 round(127 c), c = sign(u) \\|u\\|^½ | c\\|c\\| × absmax |",
         "| exp_avg_sq | lin | uint8 round(255 v / max v) | q / 255 × max v |",
         "| exp_avg_sq | sqrt | uint8 round(255 √v / max √v) | (q / 255 × max √v)² |",
         "| exp_avg_sq | 4th-root | uint8 round(255 v^¼ / max v^¼) | (q / 255 × max v^¼)⁴ |",
         "",
         "One scale (absmax, or max of the stored quantity) per block of B consecutive "
         "elements of a parameter, stored in FP16 rounded up: 1 + 2/B bytes per element and "
         "moment (B=32: 1.0625; 64: 1.03125; 128: 1.0156; 256: 1.0078); BF16: 2; FP32: 4. "
         "Rows marked \"BF16 scale\" store the same two bytes as BF16 (rounded up), for both "
         "moments or for exp_avg only: not formats asked for, a measure of what FP16's range "
         "costs. Stage 1: every pair at B=32; stage 2: the best "
         f"{len(c['swept'])} by the rule of the reading at B = 64, 128, 256; then the "
         "recommendation with BF16 scales.", ""]

    L += ["## Training", "",
          "Mean ± sample sd over the seeds. Δ/σ = (mean − FP32's mean) / FP32's seed-to-seed "
          "sd (negative: lower loss than FP32). update error = relative RMS error, over all "
          "steps and elements, of the update against the one exact moments would give on the "
          "run's own gradients (kept alongside in FP32); √v stored / exact = geometric mean "
          "over the elements after the last step, minus 1; √v off = shares of elements whose "
          "stored √v is > 10 % above, > 10 % below the exact one, or 0 while the exact one is "
          "not. max \\|d\\| = the largest \\|update\\| / lr of any element in any step of any "
          "seed (inf: it became NaN); > bound = share of element-steps with \\|update\\| / lr "
          f"above {BOUND_MARGIN:g}× what exact Adam can reach at that step (1 at step 1, "
          f"{adam_bound(last):.2f} at step {last}; adam_bound in the script), which only the "
          "storage can cause.", ""]
    for t in tasks:
        model = t["model"]
        acc = model == "digits-cnn"
        rows = [r for r in summ if r["model"] == model]
        params = next((r["params"] for r in doc["results"] if r["model"] == model), 0)
        L += [f"### {model} ({params:,} parameters, {t['steps']} steps)", "",
              "| storage | bytes/element m + v | train loss | Δ/σ | held-out loss | Δ/σ | "
              + ("test acc | " if acc else "") + "update error | √v stored / exact | √v off "
              "+10 % / −10 % / 0 (%) | max \\|d\\| | > bound (%) |",
              "| --- | --: | --: | --: | --: | --: | " + ("--: | " if acc else "")
              + "--: | --: | --: | --: | --: |"]
        for r in rows:
            cells = [f"{r['bytes_exp_avg']:.5g} + {r['bytes_exp_avg_sq']:.5g} = "
                     f"{r['bytes_per_param']:.5g}",
                     _pm(r["train_loss"], r["train_loss_sd"]),
                     _f(r["train_loss_delta_sds"], "+.1f"),
                     _pm(r["heldout_loss"], r["heldout_loss_sd"]),
                     _f(r["heldout_loss_delta_sds"], "+.1f")]
            if acc:
                cells.append(f"{100 * r['accuracy']:.1f}%")
            cells += [_f(r["update_rel_rms"], ".2g"), _f(100 * r["sqrt_v_bias"], "+.2f") + " %",
                      f"{_pct(r['sqrt_v_high'])} / {_pct(r['sqrt_v_low'])} / "
                      f"{_pct(r['v_lost'])}",
                      f"{r['max_abs_direction']:.3g}", _pct(r["out_of_bound_share"])]
            flag = (f" (non-finite loss in {r['nonfinite_seeds']} of {r['seeds']} seeds)"
                    if r["nonfinite_seeds"] else "")
            L.append(f"| {r['storage']}{flag} | " + " | ".join(cells) + " |")
        L.append("")

    L += ["## Diagnostic: exact moments stored once, and the update they give", "",
          "On the FP32 run of seed " + str(doc["seeds"][0]) + ", at steps "
          + "; ".join(f"{m} {', '.join(str(x['step']) for x in ds)}" for m, ds in diag.items())
          + ": each format applied to the exact moments; mean over those checkpoints (max for "
          "max \\|d\\|). rel RMS = ‖stored − exact‖ / ‖exact‖ over all elements; →0 = share of "
          "nonzero values stored as 0; subnormal scales = share of nonzero blocks whose FP16 "
          "scale is subnormal (fewer significant bits); direction = the next step's update / "
          "lr, formed as the kernel forms it (stored moments mixed with the next gradient), "
          "against the exact one: rel RMS error, share of elements off by more than "
          f"{BAD_DIRECTION}, the share of those whose gradient was exactly 0, share beyond "
          f"{BOUND_MARGIN:g}× exact Adam's bound, largest \\|d\\| (exact: the FP32 row). Rows "
          "with fp32 on one side quantize only the other moment (B=32). One quantization of "
          "exact moments: the drift of moments re-quantized every step is in the training "
          "tables (update error, √v stored / exact).", ""]
    show = [FP32.key, BF16.key]
    for scale in ("fp16", "bf16", "fp32"):
        show += [Storage(m, "fp32", 32, scale).key for m in M_CODES]
        show += [Storage("fp32", v, 32, scale).key for v in V_CODES]
    show += [s.key for s in pairs(32)]
    swept = [k for k in c["swept"]]
    for k in swept:
        s = next(s for s in pairs(32) if s.key == k)
        show += [Storage(s.m, s.v, b).key for b in BLOCKS[1:]]
    for model, ds in diag.items():
        zero_g = statistics.fmean(x["zero_gradient_share"] for x in ds)
        L += [f"### {model}", "",
              f"Elements with a gradient of exactly 0 at the checkpoints: {_pct(zero_g)} %.", "",
              "| storage | m rel RMS | m →0 (%) | v rel RMS | v →0 (%) | subnormal scales m / v "
              f"(%) | direction rel RMS | off > {BAD_DIRECTION} (%) | of them g = 0 (%) | "
              "> bound (%) | max \\|d\\| |",
              "| --- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |"]
        for key in show:
            if key == FP32.key:
                mx = max(x["max_abs_direction_exact"] for x in ds)
                L.append(f"| FP32 (exact) | 0 | 0 | 0 | 0 | — | 0 | 0 | — | 0 | {mx:.3g} |")
                continue

            def mean(field):
                vals = [x["formats"][key].get(field) for x in ds]
                return statistics.fmean(vals) if None not in vals else None
            sub = " / ".join("—" if mean(f) is None else _pct(mean(f))
                             for f in ("m_scale_subnormal", "v_scale_subnormal"))
            mx = max(x["formats"][key]["max_abs_direction"] for x in ds)
            L.append(f"| {key} | {mean('m_rel_rms'):.2e} | {_pct(mean('m_zeroed'))} | "
                     f"{mean('v_rel_rms'):.2e} | {_pct(mean('v_zeroed'))} | {sub} | "
                     f"{mean('dir_rel_rms'):.2e} | {_pct(mean('dir_bad'))} | "
                     f"{_pct(mean('bad_with_zero_gradient'))} | "
                     f"{_pct(mean('dir_out_of_bound'))} | {mx:.3g} |")
        L += ["", "Where nonzero v is stored as 0 (last checkpoint, B=32, v alone quantized; "
              "tensor: elements, share of the tensor):", ""]
        final = ds[-1]["formats"]
        for code in V_CODES:
            for scale in ("fp16", "fp32"):
                key = Storage("fp32", code, 32, scale).key
                where = ", ".join(f"{n} {k:,} ({100 * f:.1f} %)"
                                  for n, k, f in final[key]["v_zeroed_by_tensor"]) or "nowhere"
                L.append(f"- {key}: {where}")
        L.append("")

    L += ["## Block size", "",
          "Training (both models; update error: mean over them; worst \\|Δ\\|/σ: the largest "
          "over both models and both losses) and diagnostic (direction error and nonzero v "
          "stored as 0: mean over checkpoints and models).", "",
          "| storage | bytes/param | update error | worst \\|Δ\\|/σ | max \\|d\\| | "
          "direction rel RMS | v →0 (%) |", "| --- | --: | --: | --: | --: | --: | --: |"]
    for k in swept:
        s = next(s for s in pairs(32) if s.key == k)
        for b in BLOCKS:
            key = Storage(s.m, s.v, b).key
            rows = [r for r in summ if r["storage"] == key]
            if not rows:
                continue
            L.append(f"| {key} | {Storage(s.m, s.v, b).bytes_per_param:.5g} | "
                     f"{update_error(summ, key):.3g} | {_f(_worst_sds(summ, key), '.2g')} | "
                     f"{max(r['max_abs_direction'] for r in rows):.3g} | "
                     f"{diag_mean(diag, key, 'dir_rel_rms'):.2e} | "
                     f"{_pct(diag_mean(diag, key, 'v_zeroed'))} |")
    L += ["", "Diagnostic direction rel RMS error of every pair by block size (mean over "
          "checkpoints and models):", "",
          "| pair | " + " | ".join(f"B={b}" for b in BLOCKS) + " |",
          "| --- | " + " | ".join("--:" for _ in BLOCKS) + " |"]
    for s in pairs(32):
        cells = [f"{diag_mean(diag, Storage(s.m, s.v, b).key, 'dir_rel_rms'):.2e}"
                 for b in BLOCKS]
        L.append(f"| m {s.m} / v {s.v} | " + " | ".join(cells) + " |")
    L += ["", "## Reading", ""] + doc["reading"]
    Path(path).write_text("\n".join(L).rstrip() + "\n")


def reading(doc):
    """The recommendation and what it rests on, with this run's numbers."""
    c = doc["choice"]
    summ, diag = doc["summary"], doc["diagnostic"]
    models = [t["model"] for t in doc["tasks"]]
    pair32 = Storage(c["exp_avg"], c["exp_avg_sq"], 32)
    chosen = Storage(c["exp_avg"], c["exp_avg_sq"], c["block"])
    n_runs = len(doc["seeds"]) * len(models)

    def key(m, v, b=32, scale="fp16", m_scale=None):
        return Storage(m, v, b, scale, m_scale).key

    def dmean(k, field):
        return diag_mean(diag, k, field)

    def srow(model, k):
        return next((r for r in summ if r["model"] == model and r["storage"] == k), None)

    def has(k):
        return any(r["storage"] == k for r in summ)

    def losses(k):
        parts = []
        for model in models:
            r = srow(model, k)
            if r:
                parts.append(f"{model} train {_loss(r['train_loss'])} "
                             f"({_f(r['train_loss_delta_sds'], '+.1f')} σ), held-out "
                             f"{_loss(r['heldout_loss'])} "
                             f"({_f(r['heldout_loss_delta_sds'], '+.1f')} σ)")
        return "; ".join(parts)

    def paired(k, model, field="heldout_loss"):
        """Mean ± sd over seeds of the per-seed difference from FP32 (same seed)."""
        by = {(r["model"], r["storage"], r["seed"]): r[field] for r in doc["results"]}
        d = [by[(model, k, s)] - by[(model, FP32.key, s)] for s in doc["seeds"]
             if (model, k, s) in by]
        mean, sd = _mean_sd(d)
        return f"{_f(mean, '+.4f')} ± {_f(sd, '.4f')}"

    def dirs(k):
        return f"{dmean(k, 'dir_rel_rms'):.2g}"

    def share(k, field="v_zeroed"):
        return _pct(dmean(k, field))

    def max_d(keys):
        return f"{max(r['max_abs_direction'] for r in summ if r['storage'] in keys):.3g}"

    def worst(keys):
        return _f(max(_worst_sds(summ, k) for k in keys), ".2g")

    def upd(k):
        return _f(update_error(summ, k), ".2g")

    def bias(k, model):
        r = srow(model, k)
        return _f(100 * r["sqrt_v_bias"], "+.1f") + " %" if r else "—"

    def short(k):
        return k.split(", B=")[0]

    runner = c["ranking"][1] if len(c["ranking"]) > 1 else None
    L = [f"- **Recommendation: exp_avg `{chosen.m}`, exp_avg_sq `{chosen.v}`, B = "
         f"{chosen.block}, FP16 scales**: {chosen.bytes_per_param:.4g} bytes per parameter "
         f"for both moments (FP32 8, BF16 4). Losses: {losses(chosen.key)}. FP32: "
         f"{losses(FP32.key)}. BF16: {losses(BF16.key)}. Update error in training "
         f"{upd(chosen.key)} (BF16 {upd(BF16.key)}); largest \\|update\\| / lr "
         f"{max_d([chosen.key])} (FP32 {max_d([FP32.key])})."
         + (f" Runner-up: `{short(runner)}` (update error {upd(runner)} at B=32)."
            if runner else "")]
    if runner and runner in c["swept"] and c["by_rule"]:
        r2 = next(s for s in pairs(32) if s.key == runner)
        big = [b for b in BLOCKS[1:] if has(key(r2.m, r2.v, b))]

        def at(m, v):
            return ", ".join(f"{upd(key(m, v, b))} ({max_d([key(m, v, b)])})" for b in big)
        L[0] += (" Should the kernels need blocks larger than 32, update error (largest "
                 "\\|update\\| / lr) at B = " + "/".join(str(b) for b in big) + ": runner-up "
                 f"{at(r2.m, r2.v)}; recommendation {at(pair32.m, pair32.v)}.")
    rule = ("Rule (rank_pairs, choose_block): of the B=32 pairs whose training and held-out "
            f"losses lie within {c['limit']:g} FP32 sds of FP32's on every model, the one with "
            "the smallest update error in training; then the largest B that, with every "
            f"smaller B, stays within {c['limit']:g} sds and within {c['tolerance']:g}× "
            "B=32's update error. The pairs that pass, by update error (B=32): " + ", ".join(
                f"`{short(k)}` {upd(k)}" for k in c["ranking"]) + ".")
    if not c["by_rule"]:
        rule += " The pair was given on the command line (--pair)."
    elif not c["within_noise"]:
        rule += " **No pair met the loss test; the update error decided alone.**"
    L.append("- " + rule)

    v_keys = {v: [key(m, v) for m in M_CODES] for v in V_CODES}
    zero_g = ", ".join(
        f"{m} {_pct(statistics.fmean(x['zero_gradient_share'] for x in diag[m]))} %"
        for m in models if m in diag)
    nonfinite = {v: sum(r["nonfinite_seeds"] for r in summ if r["storage"] in v_keys[v])
                 for v in V_CODES}
    L.append(
        "- exp_avg_sq decides first, through its zeros. Quantized alone (B=32), share of "
        "nonzero v stored as 0 and one-step direction error: " + "; ".join(
            f"{v} {share(key('fp32', v))} %, {dirs(key('fp32', v))}" for v in V_CODES)
        + ". An element whose v is stored as 0 while its m is not, and whose next gradient is "
          f"exactly 0 (dead ReLU units, absent tokens: {zero_g} of the elements at the "
          "checkpoints), moves by m / eps lr. In training, over the three exp_avg codes: worst "
          "loss Δ " + ", ".join(f"{v} {worst(v_keys[v])} σ" for v in V_CODES)
        + "; largest \\|update\\| / lr " + ", ".join(f"{v} {max_d(v_keys[v])}" for v in V_CODES)
        + "; runs with a non-finite loss " + ", ".join(
            f"{v} {nonfinite[v]} of {n_runs * len(M_CODES)}" for v in V_CODES) + ".")
    L.append(
        "- The pairing: with v `sqrt` (B=32), exp_avg " + "; ".join(
            f"{m}: worst Δ {worst([key(m, 'sqrt')])} σ, largest \\|update\\| / lr "
            f"{max_d([key(m, 'sqrt')])}" for m in M_CODES)
        + ". The smallest value a code keeps, relative to its block's largest, in the update's "
          "units (m, and √v): m `lin` 1/254, `softsign` 1/508, `sqrt` 1/254² = 1.5e-5; v `lin` "
          "1/√510 = 1/22.6, `sqrt` 1/510, `4th-root` 1/510² = 3.8e-6. Where v's code loses "
          "values that m's code keeps, v = 0 meets m ≠ 0; `4th-root` covers every m code.")
    sweep_text = "; ".join(
        f"`{short(k)}` " + ", ".join(
            f"{upd(key(s.m, s.v, b))} ({max_d([key(s.m, s.v, b)])})" for b in BLOCKS
            if has(key(s.m, s.v, b)))
        for k in c["swept"] for s in [next(s for s in pairs(32) if s.key == k)])
    L.append(
        f"- exp_avg, with v `{pair32.v}` (B=32): update error " + ", ".join(
            f"{m} {upd(key(m, pair32.v))}" for m in M_CODES)
        + "; one-step direction error " + ", ".join(
            f"{m} {dirs(key(m, pair32.v))}" for m in M_CODES)
        + "; largest \\|update\\| / lr " + ", ".join(
            f"{m} {max_d([key(m, pair32.v)])}" for m in M_CODES)
        + ". Per model, the update error at B=32: " + "; ".join(
            f"{m}: " + ", ".join(
                f"{mc} {_f(srow(m, key(mc, pair32.v))['update_rel_rms'], '.2g')}"
                for mc in M_CODES) for m in models)
        + ". By block size B = " + "/".join(str(b) for b in BLOCKS) + ", update error "
          "(largest \\|update\\| / lr): " + sweep_text + ". The update error is an RMS: rare "
          "elements moved by far too much dominate it, and larger blocks make them likelier "
          "where exp_avg keeps values v loses.")
    L.append(
        f"- Block size, `{pair32.m}` / `{pair32.v}`, B = " + "/".join(str(b) for b in BLOCKS)
        + ": update error " + ", ".join(upd(key(pair32.m, pair32.v, b)) for b in BLOCKS)
        + "; one-step direction error " + ", ".join(
            dirs(key(pair32.m, pair32.v, b)) for b in BLOCKS)
        + "; nonzero v stored as 0 " + ", ".join(
            f"{share(key(pair32.m, pair32.v, b))} %" for b in BLOCKS)
        + "; worst loss Δ " + ", ".join(f"{worst([key(pair32.m, pair32.v, b)])} σ"
                                        for b in BLOCKS)
        + "; bytes per parameter " + ", ".join(
            f"{Storage(pair32.m, pair32.v, b).bytes_per_param:.4g}" for b in BLOCKS)
        + ": the scales' bytes are 0.11 per parameter between B=32 and 256.")
    drift_rows = ([("BF16", BF16.key)]
                  + [(f"v {v}", key(pair32.m, v)) for v in V_CODES[1:]]
                  + [(f"v {chosen.v}, {sc}", k) for sc, k in (
                      ("BF16 scale", key(chosen.m, chosen.v, chosen.block, "bf16")),
                      ("BF16 scale for m", key(chosen.m, chosen.v, chosen.block, "fp16",
                                               "bf16"))) if has(k)])
    L.append(
        "- Then the drift, common to every format here, BF16 included. A stored v falls by at "
        "most 1 − β2 = 0.1 % a step (its square root 0.05 %, its fourth root 0.025 %): less "
        "than half a code step at any code (at the top code, in v: `lin` 0.2 %, `sqrt` "
        "0.39 %, `4th-root` 0.78 %; BF16 0.2–0.39 %) and, for the roots, less than one step "
        "of an FP16 scale rounded up (0.05–0.1 %). Re-rounded to nearest every step, v stays "
        "where it was where gradients shrink. √v stored / exact after the last step ("
        + " / ".join(models) + "), and the paired difference of the held-out loss from FP32 "
        "(same seed; mean ± sd over seeds): " + "; ".join(
            f"{name} " + " / ".join(bias(k, m) for m in models) + ", "
            + " / ".join(paired(k, m) for m in models) for name, k in drift_rows)
        + f" (exp_avg `{pair32.m}`). A stored v too large is a step too small, one too small "
          "a step too large; on char-gpt the held-out loss follows the drift's sign, and "
          "roughly its size. "
          "Among the formats that do not blow up, the loss test therefore ranks step sizes, "
          "not storage errors, and the update error decides. Stochastic rounding, outside "
          "this study, is what lets a stored v sink by 0.1 % a step on average.")
    bf16_both = key(chosen.m, chosen.v, chosen.block, "bf16")
    bf16_m = key(chosen.m, chosen.v, chosen.block, "fp16", "bf16")
    L.append(
        "- The FP16 scale: share of blocks with a subnormal FP16 scale (B=32), exp_avg "
        f"{share(key(M_CODES[0], 'fp32'), 'm_scale_subnormal')} %; exp_avg_sq " + ", ".join(
            f"{v} {share(key('fp32', v), 'v_scale_subnormal')} %" for v in V_CODES)
        + ". Nonzero values stored as 0 with an FP16 / BF16 / FP32 scale: exp_avg " + ", ".join(
            f"{m} " + " / ".join(share(key(m, 'fp32', 32, sc), 'm_zeroed')
                                 for sc in ("fp16", "bf16", "fp32")) + " %" for m in M_CODES)
        + "; exp_avg_sq " + ", ".join(
            f"{v} " + " / ".join(share(key('fp32', v, 32, sc)) for sc in ("fp16", "bf16", "fp32"))
            + " %" for v in V_CODES)
        + ". The moments of a trained model are small (most exp_avg blocks of the digits CNN "
          "fall below FP16's normal range), and linear v stores g². The recommendation with the "
          "same two bytes as a BF16 scale: " + "; ".join(
              f"{name}: losses {losses(k)}, update error {upd(k)}, largest \\|update\\| / lr "
              f"{max_d([k])}" for name, k in (("for both moments", bf16_both),
                                              ("for exp_avg only", bf16_m)) if has(k))
        + f" (FP16 scales: update error {upd(chosen.key)}).")
    if has(bf16_m):
        gain = update_error(summ, bf16_m) < 0.9 * update_error(summ, chosen.key)
        L[-1] += (" Keeping the small m that an FP16 scale zeroes "
                  + ("lowers the update error by more than 10 %: a BF16 scale for exp_avg is "
                     "worth its conversion." if gain else
                     "does not lower the update error by 10 % or more: those m are small "
                     "beside √v, and FP16 scales are enough for these models."))
    L.append(
        f"- Limits: {len(doc['seeds'])} seeds, so σ is itself uncertain (a Δ of 1–2 σ is not a "
        "difference); two small models, the CNN trained to a loss near 0; the quantization is "
        "simulated in PyTorch (round to nearest, FP32 arithmetic) as a kernel would do it, "
        "and not timed.")
    return L


# ----------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--digits-steps", type=int, default=600)
    ap.add_argument("--char-steps", type=int, default=600)
    ap.add_argument("--digits-lr", type=float, default=2e-3)
    ap.add_argument("--char-lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", nargs="*", default=["digits-cnn", "char-gpt"],
                    choices=["digits-cnn", "char-gpt"])
    ap.add_argument("--limit", type=float, default=2.0,
                    help="loss test: |Δ| at most this many FP32 sds (default 2)")
    ap.add_argument("--tolerance", type=float, default=1.1,
                    help="block test: direction error at most this times B=32's (default 1.1)")
    ap.add_argument("--pair", nargs=2, metavar=("EXP_AVG", "EXP_AVG_SQ"),
                    help="skip the rule, sweep the block size of this pair")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 seeds, 40 steps")
    ap.add_argument("--resume", action="store_true", help="keep the runs an interrupted run "
                    "with the same seeds and tasks left in the temporary folder")
    ap.add_argument("--out", default=None, help="output folder (default benchmarks/results)")
    ap.add_argument("--render", metavar="JSON", help="rewrite the markdown, the block choice "
                    "and the reading of an earlier run's JSON file, running nothing")
    args = ap.parse_args(argv)
    if args.render:
        path = Path(args.render)
        doc = json.loads(path.read_text())
        storages = [Storage(d["exp_avg"], d["exp_avg_sq"], d["block"], d["scale"],
                            d.get("m_scale")) for d in doc["storages"]]
        doc["summary"] = summarize(doc["results"], [t["model"] for t in doc["tasks"]],
                                   storages)
        c = doc["choice"]  # the block rule may have changed; every block size's data is here
        c["block"] = choose_block(doc["summary"], Storage(c["exp_avg"], c["exp_avg_sq"], 32),
                                  c["limit"], c["tolerance"])
        doc["reading"] = reading(doc)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        write_markdown(path.with_suffix(".md"), doc)
        print(f"wrote {path.with_suffix('.md')}", file=sys.stderr)
        return 0
    if args.quick:
        args.seeds, args.digits_steps, args.char_steps = 2, 40, 40
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    specs = {"digits-cnn": TaskSpec("digits-cnn", args.digits_lr, 64, args.digits_steps),
             "char-gpt": TaskSpec("char-gpt", args.char_lr, 16, args.char_steps)}
    specs = [specs[m] for m in args.models]
    seeds = list(range(args.seeds))
    check = {s.model: self_check(s) for s in specs}
    diag_storages = diagnostic_storages()
    results, diag = [], {}

    # Every finished run is kept in a scratch file, so a failure late in a quarter-hour run
    # (or an interrupted one) costs only what --resume cannot find there.
    partial = Path(tempfile.gettempdir()) / f"moment_formats_{device_tag('cpu')}.partial.json"
    setup = {"seeds": seeds, "tasks": [vars(s) for s in specs]}
    if args.resume and partial.exists():
        saved = json.loads(partial.read_text())
        if saved["setup"] == setup:
            results, diag = saved["results"], saved["diagnostic"]
            t_start -= saved["elapsed_s"]
            print(f"resuming: {len(results)} runs from {partial}")

    def run(storage):
        for spec in specs:
            for seed in seeds:
                if any(r["model"] == spec.model and r["storage"] == storage.key
                       and r["seed"] == seed for r in results):
                    continue
                cps = ()
                if storage == FP32 and seed == seeds[0]:
                    cps = tuple(sorted({spec.steps // 10, spec.steps // 2, spec.steps - 1}))
                r = train(spec, storage, seed, cps, diag_storages)
                if "diagnostic" in r:
                    diag[spec.model] = r.pop("diagnostic")
                results.append(r)
                print(f"  {spec.model:>10} {storage.key:<32} seed {seed}  train "
                      f"{r['train_loss']:.4f}  held-out {r['heldout_loss']:.4f}  max|d| "
                      f"{r['max_abs_direction']:.3g}  {r['ms_per_step']:.1f} ms/step  "
                      f"[{time.perf_counter() - t_start:.0f} s]", flush=True)
                partial.write_text(json.dumps(
                    {"setup": setup, "results": results, "diagnostic": diag,
                     "elapsed_s": time.perf_counter() - t_start}))

    models = [s.model for s in specs]
    stage1 = [FP32, BF16] + pairs(32)
    for s in stage1:
        run(s)
    ranking, ok = rank_pairs(summarize(results, models, stage1), args.limit)
    if args.pair:
        pair = Storage(args.pair[0], args.pair[1], 32)
        if pair not in pairs(32):
            ap.error(f"--pair: exp_avg of {M_CODES}, exp_avg_sq of {V_CODES}")
        swept = [pair]
    else:  # the runner-up too: near-ties between the best two are to be expected
        pair, swept = ranking[0], ranking[:2]
    sweep = [Storage(s.m, s.v, b) for s in swept for b in BLOCKS[1:]]
    for s in sweep:
        run(s)
    block = choose_block(summarize(results, models, stage1 + sweep), pair, args.limit,
                         args.tolerance)
    # Not formats asked for: the same two bytes as a BF16 scale, FP32's range with 8
    # significant bits, to measure what FP16's range costs the chosen format; for both
    # moments, and for exp_avg alone (v's roots stay in FP16's normal range, m does not).
    alt = [Storage(pair.m, pair.v, block, "bf16"),
           Storage(pair.m, pair.v, block, "fp16", m_scale="bf16")]
    for s in alt:
        run(s)
    storages = stage1 + sweep + alt
    summary = summarize(results, models, storages)

    info = machine_info("cpu")
    wall = time.perf_counter() - t_start
    command = ("PYTHONPATH=python:examples/python:benchmarks python3 "
               + " ".join([os.path.relpath(__file__, REPO)] + sys.argv[1:] if argv is None
                          else [os.path.relpath(__file__, REPO)] + list(argv)))
    doc = {"device": "cpu", "command": command, "machine": info, "wall_s": wall,
           "seeds": seeds, "self_check": check,
           "tasks": [vars(s) for s in specs],
           "hyper_parameters": {"betas": list(BETAS), "eps": EPS, "weight_decay": WD},
           "storages": [s.as_dict() for s in storages],
           "choice": {"exp_avg": pair.m, "exp_avg_sq": pair.v, "block": block,
                      "by_rule": not args.pair, "within_noise": ok, "limit": args.limit,
                      "tolerance": args.tolerance, "swept": [s.key for s in swept],
                      "ranking": [s.key for s in ranking]},
           "summary": summary, "diagnostic": diag, "results": results}
    doc["reading"] = reading(doc)
    print("\n".join(doc["reading"]))
    print(f"whole run {wall / 60:.1f} min")
    out = Path(args.out) if args.out else (None if args.quick else HERE / "results")
    partial.unlink(missing_ok=True)
    if out is None:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    tag = device_tag("cpu")
    (out / f"moment_formats_{tag}.json").write_text(json.dumps(doc, indent=1) + "\n")
    write_markdown(out / f"moment_formats_{tag}.md", doc)
    print(f"wrote {out}/moment_formats_{tag}.{{json,md}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
