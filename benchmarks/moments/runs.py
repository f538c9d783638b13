"""moment_formats.py's runs and what it concludes from them: one training run per task, storage
and seed; the summary over seeds against FP32; the ranking of the B=32 pairs and the choice of
the block size."""
from __future__ import annotations

import math
import statistics
import time

import torch

from harness.results import mean_sd as _mean_sd
from moments.diagnostic import diagnose
from moments.formats import BLOCKS, FP32, Storage, pairs
from moments.reference import ReferenceAdamW
from moments.tasks import make_task


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


def worst_sds(summary, key):
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
    ok = [s for s in pairs(32) if worst_sds(summary, s.key) <= limit]
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
                and worst_sds(summary, key) <= limit
                and update_error(summary, key) <= tolerance * base):
            break
        best = b
    return best
