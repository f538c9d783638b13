"""The reference AdamW of moment_formats.py: plain PyTorch, FP32 weights and arithmetic, whose
moments are stored in a Storage between steps (see moment_formats.py's docstring), with the
exact moments kept alongside to measure the error the storage accumulates."""
from __future__ import annotations

import math

import torch

from moments.formats import FP32
from moments.tasks import teacher_forced_difference

BETAS = (0.9, 0.999)
EPS = 1e-8
WD = 0.01
ALIGN = 256                  # every block size studied divides it
# Rounding alone (BF16's 2^-9, a code's step) lifts updates at the bound a little above it (at
# step 1 every |update| / lr is exactly the bound, 1); half as much again is a blow-up.
BOUND_MARGIN = 1.5


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
    """AdamW whose moments are stored in `storage` between steps (moment_formats.py's
    docstring)."""

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
