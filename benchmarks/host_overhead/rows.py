"""The host-overhead benchmark's rows (a torch side against a fusedamp side, and the target the
row is held to) and their measurement: every side at one N built, then timed in turns."""
from __future__ import annotations

import gc
import statistics
from dataclasses import dataclass

import torch

from harness.timing import quartiles, time_in_turns
from host_overhead.sides import (LOSS_SCALE, Side, Skip, fusedamp_op, fusedamp_whole_step,
                                 torch_fused_adamw, torch_norm_and_check, torch_unscale,
                                 torch_whole_step)

OP_TARGET = 0.8         # each op <= 0.8x its torch counterpart, per tensor
STEP_TARGET = 0.5       # the whole step <= 0.5x torch's bare _fused_adamw_, per tensor
# The sides' order in each timing round: shuffled by this seed (harness.timing.turns).
ORDER_SEED = 13


@dataclass
class Row:
    title: str
    torch: Side
    fusedamp: Side
    target: str                   # "op", "step" or "reference" (shown, held to no target)
    note: str = ""


TORCH_ADAMW_OP = Side("torch_fused_adamw", "`torch._fused_adamw_`", "FP32", torch_fused_adamw)
TORCH_STEP = Side("torch_step", "torch.amp.GradScaler + torch.optim.AdamW(fused=True)", "FP32",
                  torch_whole_step(clip=False))
TORCH_STEP_CLIP = Side("torch_step_clip", "torch.amp.GradScaler + unscale_ + "
                       "clip_grad_norm_(foreach=True) + torch.optim.AdamW(fused=True)", "FP32",
                       torch_whole_step(clip=True))
MIXED_DTYPE = "FP16 params + FP32 masters"
MIXED = dict(param_dtype=torch.float16, master_weights=True,
             scalars=dict(found_inf=0.0, inv_scale=1.0 / LOSS_SCALE))

TORCH_UNSCALE = Side("torch_unscale", "`_amp_foreach_non_finite_check_and_unscale_`",
                     "FP16 grads", torch_unscale)
ADAMW_MIXED_NOTE = "inv_scale + found_inf; torch: grad_scale + found_inf"

ROWS = [
    Row("unscale op", TORCH_UNSCALE,
        Side("fusedamp_unscale", "`fusedamp.ops.unscale_and_check_`", "FP16 grads",
             fusedamp_op("unscale_and_check_", **MIXED)), "op"),
    Row("unscale op, through torch.ops", TORCH_UNSCALE,
        Side("fusedamp_unscale_boxed", "`torch.ops.fusedamp.unscale_and_check_`", "FP16 grads",
             fusedamp_op("unscale_and_check_", via_torch_ops=True, **MIXED)), "reference",
        "torch's boxed path for custom operators"),
    Row("AdamW op, mixed precision", TORCH_ADAMW_OP,
        Side("fusedamp_adam_mixed", "`fusedamp.ops.adam_step_`", MIXED_DTYPE,
             fusedamp_op("adam_step_", **MIXED)), "op", ADAMW_MIXED_NOTE),
    Row("AdamW op, mixed precision, through torch.ops", TORCH_ADAMW_OP,
        Side("fusedamp_adam_mixed_boxed", "`torch.ops.fusedamp.adam_step_`", MIXED_DTYPE,
             fusedamp_op("adam_step_", via_torch_ops=True, **MIXED)), "reference",
        ADAMW_MIXED_NOTE + "; torch's boxed path for custom operators"),
    Row("AdamW op, FP32", TORCH_ADAMW_OP,
        Side("fusedamp_adam_fp32", "`fusedamp.ops.adam_step_`", "FP32, no masters",
             fusedamp_op("adam_step_", param_dtype=torch.float32,
                         scalars=dict(found_inf=0.0, inv_scale=1.0 / LOSS_SCALE))), "op"),
    Row("grad stats",
        Side("torch_norm_check", "`_foreach_norm` + the check (inv_scale 1)", "FP16 grads",
             torch_norm_and_check),
        Side("fusedamp_grad_stats", "`fusedamp.ops.grad_stats_`", "FP16 grads",
             fusedamp_op("grad_stats_", param_dtype=torch.float16,
                         scalars=dict(found_inf=0.0, grad_sum_sq=0.0))), "op",
        "torch has no single op: its pair"),
    Row("whole AMP step", TORCH_STEP,
        Side("fusedamp_step", "fusedamp.GradScaler + fusedamp.optim.AdamW", MIXED_DTYPE,
             fusedamp_whole_step(clip=False)), "step"),
    Row("whole AMP step, telemetry off", TORCH_STEP,
        Side("fusedamp_step_no_telemetry", "fusedamp.GradScaler(telemetry=False) + "
             "fusedamp.optim.AdamW", MIXED_DTYPE, fusedamp_whole_step(clip=False,
                                                                   telemetry=False)), "step"),
    Row("whole AMP step, clipping", TORCH_STEP_CLIP,
        Side("fusedamp_step_clip", "fusedamp.GradScaler + fusedamp.optim.AdamW("
             "max_grad_norm=1.0)", MIXED_DTYPE, fusedamp_whole_step(clip=True)), "step"),
    Row("whole AMP step, new gradients each call",
        Side("torch_step_new_grads", "torch.amp.GradScaler + torch.optim.AdamW(fused=True)",
             "FP32", torch_whole_step(clip=False, new_grads=True)),
        Side("fusedamp_step_new_grads", "fusedamp.GradScaler + fusedamp.optim.AdamW",
             MIXED_DTYPE, fusedamp_whole_step(clip=False, new_grads=True)), "step",
        "each parameter gets a new gradient tensor before each call, as after "
        "zero_grad(set_to_none=True) and a backward; the other rows refill the same tensors"),
    Row("whole AMP step, lean", TORCH_STEP,
        Side("fusedamp_step_lean", "fusedamp.GradScaler + fusedamp.optim.AdamW("
             "adopt_param_edits=False, write_back_grads=False)",
             MIXED_DTYPE, fusedamp_whole_step(clip=False, lean=True)), "step"),
    Row("whole AMP step, lean, clipping", TORCH_STEP_CLIP,
        Side("fusedamp_step_lean_clip", "fusedamp.GradScaler + fusedamp.optim.AdamW("
             "adopt_param_edits=False, write_back_grads=False, max_grad_norm=1.0)",
             MIXED_DTYPE, fusedamp_whole_step(clip=True, lean=True)), "step"),
]


# ----------------------------------------------------------------------------- timing
FAILURES = (Skip, RuntimeError, TypeError, ValueError, AttributeError)


def skipped(e):
    """Why a side has no number: a Skip's reason, or the first line of what failed (an older
    build without an op or an argument)."""
    if isinstance(e, Skip):
        return {"skipped": str(e)}
    return {"skipped": f"failed: {type(e).__name__}: {str(e).splitlines()[0]}"}


def time_sides(timed: dict, device, reps, warmup):
    """{key: (wall ns, CUDA-event ns or None) of each call} of the built sides, called in
    turns, one call each per round in a new seeded order (harness.timing.time_in_turns): every
    side sees the same machine and, in turn, every predecessor's cache state (in a fixed cycle
    the fusedamp step would always follow torch's Python loop, its telemetry-off twin the
    fusedamp step itself, with the engine's code still hot). The wall time is what issuing the
    call costs the host; the garbage collector is off while timing."""
    return time_in_turns({k: t.call for k, t in timed.items()}, reps, warmup, order=ORDER_SEED,
                         reset={k: t.reset for k, t in timed.items()}, device=device,
                         gc_off=True)


def build_and_warm(side: Side, device, n, numel):
    """The side's Timed, called once (a side that cannot run fails here, not mid-timing)."""
    timed = side.build(device, n, numel)
    timed.reset()
    timed.call()
    return timed


def run(device, tensors, numel, reps, warmup, log):
    results = []
    for n in tensors:
        sides = list({side.key: side for row in ROWS
                      for side in (row.torch, row.fusedamp)}.values())
        timed, measured = {}, {}
        for side in sides:
            log(f"  N={n}: building {side.key}")
            try:
                timed[side.key] = build_and_warm(side, device, n, numel)
            except FAILURES as e:
                measured[side.key] = skipped(e)
        log(f"  N={n}: timing {len(timed)} sides, {reps} rounds")
        for key, (wall, event) in time_sides(timed, device, reps, warmup).items():
            ns = statistics.median(wall)
            p25, p75 = quartiles(wall)
            measured[key] = {"ns_per_call": ns, "ns_per_tensor": ns / n,
                             "ns_per_call_p25": p25, "ns_per_call_p75": p75}
            if event is not None:
                measured[key]["event_ns_per_call"] = statistics.median(event)
        del timed
        gc.collect()
        bare_adamw = measured.get(TORCH_ADAMW_OP.key, {})
        for row in ROWS:
            results.append(row_result(row, n, measured, bare_adamw))
    return results


def row_result(row, n, measured, bare_adamw):
    """One row of the table: both sides, the ratio, and the target it is held to."""
    fa, th = measured[row.fusedamp.key], measured[row.torch.key]
    out = {"row": row.title, "tensors": n, "note": row.note,
           "torch": dict(th, key=row.torch.key, label=row.torch.label, dtype=row.torch.dtype),
           "fusedamp": dict(fa, key=row.fusedamp.key, label=row.fusedamp.label,
                            dtype=row.fusedamp.dtype)}
    if "ns_per_tensor" in fa and "ns_per_tensor" in th:
        out["ratio"] = fa["ns_per_tensor"] / th["ns_per_tensor"]
    if row.target == "op" and "ratio" in out:
        out["target"] = {"against": f"torch's {row.torch.label}", "limit": OP_TARGET,
                         "ratio": out["ratio"], "met": out["ratio"] <= OP_TARGET}
    elif row.target == "step" and "ns_per_tensor" in fa and "ns_per_tensor" in bare_adamw:
        ratio = fa["ns_per_tensor"] / bare_adamw["ns_per_tensor"]
        out["target"] = {"against": f"torch's bare {TORCH_ADAMW_OP.label}", "limit": STEP_TARGET,
                         "ratio": ratio,
                         "met": ratio <= STEP_TARGET}
    return out
