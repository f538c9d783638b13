"""bench_distributed.py's numbers from the ranks' records: several launches pooled, and per engine
the step time (each step's slowest rank), the traffic and state per rank, the losses, and the
ratios to the reference engines."""
from __future__ import annotations

import json
import os
import statistics

from harness.timing import quartiles

# The engines every row's step time is divided by, and the key of that ratio: DDP + fusedamp's
# ZeroRedundancyOptimizer on the converted model, and on the all-BF16 model with one bucket
# per rank (the model fsdp2 trains: its norm layers in BF16 too).
REFERENCES = (("ddp+zero", "ratio_vs_ddp_zero"), ("ddp+zero-bv", "ratio_vs_ddp_zero_bv"))


def pooled(launches):
    """The ranks' results of several launches as one: their timed steps and traffic added up;
    losses, weights and state from the first launch (the training is the same each time)."""
    ranks = json.loads(json.dumps(launches[0]))
    for later in launches[1:]:
        for mine, theirs in zip(ranks, later):
            for name, e in mine["engines"].items():
                t = theirs["engines"].get(name)
                if t is None:  # failed in a later launch: keep the first launch's numbers
                    continue
                e["step_s"] += t["step_s"]
                e["fwd_bwd_s"] += t["fwd_bwd_s"]
                for key in ("payload", "wire"):
                    e["comm"][key] += t["comm"][key]
                for call, n in t["comm"]["calls"].items():
                    e["comm"]["calls"][call] = e["comm"]["calls"].get(call, 0) + n
            for name, err in theirs["errors"].items():
                mine["errors"].setdefault(name, err)
    return ranks


def summarise(world, ranks):
    """Per engine: the step time (each step's slowest rank, then the median over steps), the
    traffic per rank per step, the state per rank, the losses averaged over the ranks."""
    first = ranks[0]
    rows = {}
    for name, e in first["engines"].items():
        per_rank = [r["engines"][name] for r in ranks]
        steps = [max(ts) for ts in zip(*(p["step_s"] for p in per_rank))]
        fb = [max(ts) for ts in zip(*(p["fwd_bwd_s"] for p in per_rank))]
        p25, p75 = quartiles(steps)
        n_timed = len(steps)
        payload = [p["comm"]["payload"] / n_timed for p in per_rank]
        wire = [p["comm"]["wire"] / n_timed for p in per_rank]
        losses = [sum(ls) / world for ls in zip(*(p["losses"] for p in per_rank))]
        rows[name] = {
            "world": world, "engine": name, "timed_steps": n_timed,
            "step_ms_median": 1e3 * statistics.median(steps),
            "step_ms_p25": 1e3 * p25, "step_ms_p75": 1e3 * p75,
            "fwd_bwd_ms_median": 1e3 * statistics.median(fb),
            "payload_bytes_per_rank": payload, "wire_bytes_per_rank": wire,
            "calls_per_step": {k: v / n_timed for k, v in per_rank[0]["comm"]["calls"].items()},
            "state_bytes_per_rank": [p["state_bytes"] for p in per_rank],
            "state_and_master_bytes_per_rank": [p["state_and_master_bytes"] for p in per_rank],
            "loss_first": losses[0], "loss_last": losses[-1],
            "val_loss": first["engines"][name]["val_loss"],
            "weights_rel_diff_vs_reference": first["engines"][name]["weights_rel_diff_vs_first"],
            "params": e["params"],
            "ddp_bucket_sizes": e.get("ddp_bucket_sizes"),
        }
    for ref_name, key in REFERENCES:
        ref = rows.get(ref_name)
        for r in rows.values():
            r[key] = r["step_ms_median"] / ref["step_ms_median"] if ref else None
    return {"world": world, "rows": rows, "errors": first["errors"],
            "reference": next(iter(first["engines"]), None),
            "load_average_after": os.getloadavg(),
            "model_bytes": first.get("model_bytes"),
            "params_by_dtype": first.get("params_by_dtype")}
