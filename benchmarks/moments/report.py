"""moment_formats.py's report: the formats, the training tables per model, the diagnostic and
the block-size tables, then the reading (moments/reading.py), as markdown."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from moments.diagnostic import BAD_DIRECTION
from moments.formats import BF16, BLOCKS, FP32, M_CODES, V_CODES, Storage, pairs
from moments.reference import BOUND_MARGIN, adam_bound
from moments.runs import diag_mean, update_error, worst_sds


def num(x, fmt=".4f"):
    """A number for a table: — for none, a diverged run's order of magnitude."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if abs(x) >= 1e4:  # a diverged run: the order of magnitude is the information
        return format(x, "+.1e" if fmt.startswith("+") else ".1e")
    return format(x, fmt)


def loss_cell(x):
    """A loss, in exponent form below 0.1."""
    return num(x) if math.isnan(x) or abs(x) >= 0.1 else f"{x:.3e}"


def _pm(mean, sd):
    """mean ± sd, the sd to the mean's precision."""
    if math.isnan(mean) or abs(mean) >= 1e4:
        return f"{num(mean)} ± {num(sd, '.0e')}"
    if abs(mean) >= 0.1:
        return f"{mean:.4f} ± {num(sd)}"
    return f"{mean:.3e} ± {num(sd, '.1e')}"


def pct(x):
    """A share in %, with two significant digits where it is below 0.1 %."""
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
                     num(r["train_loss_delta_sds"], "+.1f"),
                     _pm(r["heldout_loss"], r["heldout_loss_sd"]),
                     num(r["heldout_loss_delta_sds"], "+.1f")]
            if acc:
                cells.append(f"{100 * r['accuracy']:.1f}%")
            cells += [num(r["update_rel_rms"], ".2g"), num(100 * r["sqrt_v_bias"], "+.2f") + " %",
                      f"{pct(r['sqrt_v_high'])} / {pct(r['sqrt_v_low'])} / "
                      f"{pct(r['v_lost'])}",
                      f"{r['max_abs_direction']:.3g}", pct(r["out_of_bound_share"])]
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
              f"Elements with a gradient of exactly 0 at the checkpoints: {pct(zero_g)} %.", "",
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
            sub = " / ".join("—" if mean(f) is None else pct(mean(f))
                             for f in ("m_scale_subnormal", "v_scale_subnormal"))
            mx = max(x["formats"][key]["max_abs_direction"] for x in ds)
            L.append(f"| {key} | {mean('m_rel_rms'):.2e} | {pct(mean('m_zeroed'))} | "
                     f"{mean('v_rel_rms'):.2e} | {pct(mean('v_zeroed'))} | {sub} | "
                     f"{mean('dir_rel_rms'):.2e} | {pct(mean('dir_bad'))} | "
                     f"{pct(mean('bad_with_zero_gradient'))} | "
                     f"{pct(mean('dir_out_of_bound'))} | {mx:.3g} |")
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
                     f"{update_error(summ, key):.3g} | {num(worst_sds(summ, key), '.2g')} | "
                     f"{max(r['max_abs_direction'] for r in rows):.3g} | "
                     f"{diag_mean(diag, key, 'dir_rel_rms'):.2e} | "
                     f"{pct(diag_mean(diag, key, 'v_zeroed'))} |")
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
