"""The host-overhead benchmark's table: ns per tensor and µs per call of each side, their ratio
and the target, with each row's sides named once."""
from __future__ import annotations

from harness.results import table
from host_overhead.rows import OP_TARGET, ORDER_SEED, STEP_TARGET


def ns_cell(side, field="ns_per_tensor", scale=1.0, digits=0):
    if field not in side:
        return "—"
    return f"{side[field] / scale:,.{digits}f}"


def side_name(side):
    return f"{side['label']} ({side['dtype']})"


def markdown(info, results, args, command):
    cuda = args.device == "cuda"
    per_side = ["ns/tensor", "µs/call"] + (["event µs/call"] if cuda else [])
    head = (["row", "N"] + [f"torch {h}" for h in per_side] + [f"fusedamp {h}" for h in per_side]
            + ["fusedamp/torch", "target (per tensor)", "met"])
    rows, legend, skipped = [], {}, {}  # legend and skipped: each once, not once per N
    for r in results:
        legend.setdefault(r["row"], f"- **{r['row']}**: {side_name(r['torch'])} vs "
                          f"{side_name(r['fusedamp'])}"
                          + (f"; {r['note']}" if r["note"] else ""))
        cells = [r["row"], f"{r['tensors']:,}"]
        for name in ("torch", "fusedamp"):
            side = r[name]
            cells += [ns_cell(side), ns_cell(side, "ns_per_call", 1e3, 1)]
            if cuda:
                cells.append(ns_cell(side, "event_ns_per_call", 1e3, 1))
            if "skipped" in side:
                skipped.setdefault(f"- {name} {side['label']}: {side['skipped']}")
        cells.append(f"{r['ratio']:.2f}" if "ratio" in r else "—")
        t = r.get("target")
        cells += ([f"{t['ratio']:.2f} ≤ {t['limit']} × {t['against']}",
                   "yes" if t["met"] else "no"] if t else ["—", "—"])
        rows.append(cells)
    lines = table(head, ["l" if h in ("row", "target (per tensor)", "met") else "r"
                         for h in head], rows, compact=True)
    timing = ("wall time of issuing one call; event: its CUDA-event time" if cuda
              else "wall time of one call")
    out = [f"# Host overhead per tensor: fusedamp vs torch ({info['device']})", "",
           f"`{command}`", "",
           f"{args.numel}-element tensors, torch threads {info['torch_threads']}, median of "
           f"{args.reps} calls after {args.warmup} warm-up calls ({timing}); the sides are "
           "called in turn, one call each per round, in a new random order each round (seed "
           f"{ORDER_SEED}). Gradients refilled from a pristine copy "
           "before each call, outside the timed region. Targets, "
           f"per tensor: an op ≤ {OP_TARGET} × its torch counterpart; a whole step ≤ "
           f"{STEP_TARGET} × torch's bare `_fused_adamw_` at the same N.", "", *lines, "",
           "Rows:", *legend.values(), ""]
    if skipped:
        out += ["Not measured:", *skipped, ""]
    out += ["Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), ""]
    return "\n".join(out)
