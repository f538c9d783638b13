"""The step benchmark's report: torch's step time over fusedamp's per size, the targets, the
telemetry's cost, every configuration's time and bandwidth (markdown), and the ratios as a
plot."""
from __future__ import annotations

from pathlib import Path

from harness.results import machine_table, ratio_cell, table
from harness.timing import fmt_ms as fmt_t
from step.configs import Config


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


def write_markdown(path, info, copy, sizes, results, rat, targets, command):
    L = [f"# fusedamp step benchmark — {info['device']}", "",
         f"Produced by `{command}` on {info['date_utc']}.", ""]
    L += machine_table(info)
    L += [f"| memory copy reference | {copy['gbps']:.1f} GB/s ({copy['tensor_mib']} MiB "
          f"tensor.copy_, read + write, median of {copy['reps']}) |", "", "## Sizes", ""]
    L += table(["size", "tensors", "parameters", "shape source"], "lrrl",
               [[s.name, f"{len(s.shapes):,}", f"{s.numel:,}", s.source] for s in sizes])
    L += ["", "## Step time torch / fusedamp (> 1: fusedamp faster)", "",
          "Median step time of the torch configuration divided by fusedamp's, same size, same "
          "run. **bold < 1.00** = fusedamp slower. Host ratio in parentheses where it differs "
          "(GPU only: CPU wall time of issuing the step).", ""]
    L += ratio_table(rat, [s.name for s in sizes], info["device"] == "cuda")
    if targets:
        L += ["", "## Targets", ""]
        L += table(["target", "size", "fusedamp", "ratio", "met"], "lllrl",
                   [[t["target"], t["size"], t["fusedamp"], f"{t['ratio']:.2f}",
                     "yes" if t["met"] else "**no**"] for t in targets])
    cost = telemetry_cost(results)
    if cost:
        L += ["", "## Telemetry's cost", "",
              "Median step time of the default (GradScaler telemetry on) over the same step "
              "with `GradScaler(telemetry=False)`, same size, same run, minus 1.", ""]
        L += table(["size", "configuration", "telemetry cost"], "llr",
                   [[c["size"], c["config"], f"{100 * c['cost']:+.1f}%"] for c in cost])
    slower = [r for r in rat if r["ratio"] < 1.0]
    L += ["", "## Flags: fusedamp slower than torch", ""]
    L += [f"- {r['size']}: {r['fusedamp']} vs {r['torch']}: {r['ratio']:.2f}" for r in slower] \
        or ["- none"]
    L += ["", "## All configurations", "",
          "time = median step time (p10–p90), ms; host = median host time per step, ms; "
          "B/param = bytes moved per parameter counted from the kernels (see BYTES_PER_PARAM in "
          "step/configs.py); GB/s = B/param × parameters / time; % copy = that bandwidth as a "
          "fraction of the memory copy above.", ""]
    L += table(["size", "configuration", "reps", "time ms", "p10–p90 ms", "host ms", "B/param",
                "GB/s", "% copy"], "llrrrrrrr",
               [[r["size"], r["config"], r["reps"], fmt_t(r["median_s"]),
                 f"{fmt_t(r['p10_s'])}–{fmt_t(r['p90_s'])}", fmt_t(r["host_median_s"]),
                 r["bytes_per_param"], f"{r['gbps']:.1f}",
                 f"{100 * r['gbps'] / copy['gbps']:.0f}%"] for r in results])
    Path(path).write_text("\n".join(L) + "\n")


def ratio_table(rat, size_names, host_ratio):
    """torch / fusedamp per configuration pair (rows) and size (columns), bold where fusedamp
    is slower; with host_ratio, the ratio of host times in parentheses."""
    rmap = {(r["fusedamp"], r["torch"], r["size"]): r for r in rat}
    rows = []
    for fa, tb in dict.fromkeys((r["fusedamp"], r["torch"]) for r in rat):
        cells = [fa, tb]
        for s in size_names:
            r = rmap.get((fa, tb, s))
            cell = ratio_cell(r and r["ratio"], bold_below=1.0)
            if r is not None and host_ratio:
                cell += f" ({r['host_ratio']:.2f})"
            cells.append(cell)
        rows.append(cells)
    return table(["fusedamp", "vs torch"] + size_names, "ll" + "r" * len(size_names), rows)


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
