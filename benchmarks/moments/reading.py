"""moment_formats.py's reading: the recommendation and what it rests on, in sentences carrying
this run's numbers."""
from __future__ import annotations

import statistics

from harness.results import mean_sd as _mean_sd
from moments.formats import BF16, BLOCKS, FP32, M_CODES, V_CODES, Storage, pairs
from moments.report import loss_cell, num, pct
from moments.runs import diag_mean, update_error, worst_sds


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
                parts.append(f"{model} train {loss_cell(r['train_loss'])} "
                             f"({num(r['train_loss_delta_sds'], '+.1f')} σ), held-out "
                             f"{loss_cell(r['heldout_loss'])} "
                             f"({num(r['heldout_loss_delta_sds'], '+.1f')} σ)")
        return "; ".join(parts)

    def paired(k, model, field="heldout_loss"):
        """Mean ± sd over seeds of the per-seed difference from FP32 (same seed)."""
        by = {(r["model"], r["storage"], r["seed"]): r[field] for r in doc["results"]}
        d = [by[(model, k, s)] - by[(model, FP32.key, s)] for s in doc["seeds"]
             if (model, k, s) in by]
        mean, sd = _mean_sd(d)
        return f"{num(mean, '+.4f')} ± {num(sd, '.4f')}"

    def dirs(k):
        return f"{dmean(k, 'dir_rel_rms'):.2g}"

    def share(k, field="v_zeroed"):
        return pct(dmean(k, field))

    def max_d(keys):
        return f"{max(r['max_abs_direction'] for r in summ if r['storage'] in keys):.3g}"

    def worst(keys):
        return num(max(worst_sds(summ, k) for k in keys), ".2g")

    def upd(k):
        return num(update_error(summ, k), ".2g")

    def bias(k, model):
        r = srow(model, k)
        return num(100 * r["sqrt_v_bias"], "+.1f") + " %" if r else "—"

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
        f"{m} {pct(statistics.fmean(x['zero_gradient_share'] for x in diag[m]))} %"
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
                f"{mc} {num(srow(m, key(mc, pair32.v))['update_rel_rms'], '.2g')}"
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
