"""The master-weight modes benchmark's report: the rows, the step time against the baseline,
the bytes per parameter and the accuracy, as markdown and as a summary on stdout."""
from __future__ import annotations

from pathlib import Path

from harness.results import machine_table, table
from harness.timing import fmt_ms as fmt_t

def row_table(rows, hyper):
    return [{"row": r.key, "family": r.family, "constructor": r.ctor_text(hyper),
             "param_dtype": str(r.param_dtype).replace("torch.", ""),
             "state_dtype": r.state_dtype_text, "state": [list(s) for s in r.state],
             "state_bytes_per_param": r.state_bytes(),
             "moved_bytes_per_param_one_pass": r.moved_one_pass(),
             "moved_bytes_per_param_implemented": r.moved_as_implemented(),
             "implementation": r.implementation_text(), "baseline": r.baseline,
             "note": r.note, "unavailable": r.unavailable} for r in rows]


def _mismatch(measured, described):
    """optimizer.state holds other bytes per parameter than the row describes."""
    return described is not None and abs(measured - described) > 0.05


def write_markdown(path, doc):
    device = doc["device"]
    L = [f"# fusedamp master-weight modes — {device}", ""]
    for part in ("timing", "accuracy"):
        if part in doc:
            L.append(f"{part.capitalize()} part produced by `{doc[part]['command']}` on "
                     f"{doc[part]['machine']['date_utc']}.")
    L += ["", "BF16 parameters and BF16 gradients throughout, no loss scaler. See the docstring "
          "of benchmarks/bench_master_modes.py for the method.", "", "## Libraries", ""]
    L += table(["library", "version"], "ll", doc["libraries"].items())
    L += ["", "## Rows", ""]
    L += table(["row", "constructor", "moments", "note"], "llll",
               [[r["row"], f"`{r['constructor']}`", r["state_dtype"],
                 r["note"] + (f" **Not run: {r['unavailable']}**" if r["unavailable"] else "")]
                for r in doc["rows"]])
    if "timing" in doc:
        L += _timing_section(doc)
    L += _bytes_section(doc)
    if "accuracy" in doc:
        L += _accuracy_section(doc)
    Path(path).write_text("\n".join(L).rstrip() + "\n")


def _timing_section(doc):
    t = doc["timing"]
    base = next((r["row"] for r in doc["rows"] if r["baseline"]), "?")
    L = ["", "## Step time", "", *machine_table(t["machine"]), "",
         f"Hyper-parameters: {t['hyper_parameters']}. Median step time in ms over "
         f"{t['reps']} repetitions after {t['warmup']} warm-up steps (p10–p90 in the "
         f"detail table); × base = time / time of `{base}` at the same size (> 1: slower). "
         "A row that did not run shows its error.", ""]
    sizes = [s["name"] for s in t["sizes"]]
    L += table(["size", "tensors", "parameters", "shape source"], "lrrl",
               [[s["name"], f"{s['tensors']:,}", f"{s['parameters']:,}", s["shape_source"]]
                for s in t["sizes"]])
    res = {(r["row"], r["size"]): r for r in t["results"]}
    fail = {(f["row"], f["size"]): f["error"] for f in t["failures"]}
    described = {r["row"]: r["state_bytes_per_param"] for r in doc["rows"]}
    errors, mismatch, rows = {}, False, []
    for row in doc["rows"]:
        if not any((row["row"], s) in res or (row["row"], s) in fail for s in sizes):
            continue
        cells = [row["row"]]
        for s in sizes:
            r = res.get((row["row"], s))
            if r:
                vb = r.get("vs_baseline")
                mark = ""
                if _mismatch(r["state_bytes_measured"], described.get(row["row"])):
                    mark, mismatch = " ‡", True
                cells += [fmt_t(r["median_s"]) + mark, f"{vb:.2f}" if vb else "—"]
            else:
                n = errors.setdefault(fail.get((row["row"], s), "not run"), len(errors) + 1)
                cells += [f"error [{n}]", "—"]
        rows.append(cells)
    L += [""] + table(["row"] + [f"{s} ms | × base" for s in sizes], "l" + "r" * (2 * len(sizes)),
                      rows)
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
          "(a kernel at the memory limit cannot raise it; one below it is bound by work).", ""]
    L += table(["size", "row", "time ms", "p10–p90 ms", "first step s", "state B/param measured",
                "changed", "GB/s"], "llrrrrlr",
               [[r["size"], r["row"], fmt_t(r["median_s"]),
                 f"{fmt_t(r['p10_s'])}–{fmt_t(r['p90_s'])}", f"{r['first_step_s']:.2f}",
                 f"{r['state_bytes_measured']:.2f}", "yes" if r["weight_changed"] else "**no**",
                 f"{r['achieved_bytes_per_s'] / 1e9:.1f}" if "achieved_bytes_per_s" in r
                 else "—"] for r in t["results"]])
    return L


def _bytes_section(doc):
    L = ["", "## Bytes per parameter", "",
         "state = optimizer state besides the weight (from each row's description; "
         "**measured** in the detail table above where it differs); moved, one pass = "
         "grad read (2) + weight read and write (2 + 2) + every state buffer read and written, "
         "what one fused kernel must move; moved, as implemented = counted from the passes the "
         "implementation runs (same as one pass for single-kernel rows, plus extra passes).", ""]
    measured = {}
    for r in doc.get("timing", {}).get("results", []):
        measured.setdefault(r["row"], r["state_bytes_measured"])
    rows = []
    for r in doc["rows"]:
        sb = f"{r['state_bytes_per_param']}"
        m = measured.get(r["row"])
        if m is not None and _mismatch(m, r["state_bytes_per_param"]):
            sb += f" (**measured {m:.2f}**)"
        rows.append([r["row"], ", ".join(f"{n} {b}" for n, b in r["state"]), sb,
                     r["moved_bytes_per_param_one_pass"],
                     r["moved_bytes_per_param_implemented"], r["implementation"]])
    return L + table(["row", "state buffers", "state B/param", "moved B/param, one pass",
                      "moved B/param, as implemented", "implementation"], "llrrrl", rows)


def _accuracy_section(doc):
    a = doc["accuracy"]
    L = ["", "## Accuracy", "", *machine_table(a["machine"]), "",
         f"{a['steps']} steps per run, seed {a['seed']}; hyper-parameters "
         f"{a['hyper_parameters']} for every row and model; batch: digits "
         f"{a['batch']['digits-cnn']} images, char-GPT {a['batch']['char-gpt']} × 64 "
         "characters. train loss = mean of the last 20 steps; "
         "eval = held-out set (digits: 297 test images; char-GPT: 8 validation batches). "
         "Δ = row − FP32 reference; ms/step = wall time of a training step (forward, "
         "backward, optimizer), first step excluded.", ""]
    res = {(r["row"], r["model"]): r for r in a["results"]}
    fail = {(f["row"], f["model"]): f["error"] for f in a["failures"]}
    described = {r["row"]: r["state_bytes_per_param"] for r in doc["rows"]}
    errors, mismatch = {}, False
    for model in a["models"]:
        rr = res.get((a["reference"], model))
        acc = model == "digits-cnn"
        rows = []
        for row in a["rows"]:
            r = res.get((row, model))
            if r is None:
                err = fail.get((row, model))
                if err:
                    n = errors.setdefault(err, len(errors) + 1)
                    rows.append([row, f"error [{n}]"] + ["—"] * (6 if acc else 4))
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
            if _mismatch(r.get("state_bytes_measured", want), want):
                flag += " ‡"
                mismatch = True
            rows.append([row + flag] + cells)
        head = ["row", "train loss", "Δ train", "eval loss", "Δ eval"] + \
            (["test acc", "Δ acc"] if acc else []) + ["ms/step"]
        L += [f"### {model}", ""] + table(head, "l" + "r" * (len(head) - 1), rows) + [""]
    if mismatch:
        L += ["‡ optimizer.state after training holds a different number of bytes per "
              "parameter than the row describes: the requested master mode or state dtype "
              "is not what ran.", ""]
    return L + [f"[{n}] {e}" + "  " for e, n in errors.items()]


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
