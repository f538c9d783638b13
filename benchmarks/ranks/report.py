"""bench_distributed.py's report: the setting, the method, the table per engine and world size,
the launches apart, the plausibility of the byte counts, whether the engines trained the same
model, and the reading with this run's numbers."""
from __future__ import annotations

from harness.machine import CPU_FLAGS
from harness.results import row_line, table
from ranks.engines import ENGINES
from ranks.summary import REFERENCES

# Agreement of the engines' losses: they differ only by where BF16 rounding happens (FSDP2
# reduces FP32 gradients; the others reduce BF16 gradients; the norm layers are FP32 in the
# ddp+zero row only), which over a few tens of steps moves a loss by far less than this.
LOSS_TOLERANCE = 0.02
RATIO_KEYS = tuple(key for _, key in REFERENCES)


def megabytes(b):
    return f"{b / 1e6:.2f} MB"


def _range(values, fmt=megabytes):
    lo, hi = min(values), max(values)
    return fmt(lo) if abs(hi - lo) <= 0.005 * max(hi, 1) else f"{fmt(lo)}–{fmt(hi)}"


def _ratios(r):
    return ["—" if r[k] is None else f"{r[k]:.2f}" for k in RATIO_KEYS]


def markdown(results, machine, args, wall_s):
    lines = _setting(results, machine, args, wall_s) + _method(args) + _table(results)
    if args["repeats"] > 1:
        lines += _launches(results, args["repeats"])
    lines += _plausibility(results) + _agreement(results)
    lines += ["", "## Reading", ""] + _reading(results) + [
        "", "This VM is shared and noisy: single steps vary by more than 10 % from one to the "
        "next, and a ratio within about ±5 % of 1 is not a difference this run can resolve "
        "(compare the p25–p75 columns). Gloo on loopback moves bytes through memory copies and "
        "TCP on the same two cores that compute, so every byte communicated here costs "
        "compute time; on NCCL/GPUs the traffic overlaps differently and these ratios do not "
        "carry over. The byte and state columns do not depend on the machine.", "",
        "Not measured here, but part of the choice: torch's ZeroRedundancyOptimizer class "
        "itself steps a local fusedamp.optim.AdamW over this rank's parameters only, so that "
        "optimizer's max_grad_norm would clip by the norm of one rank's partition and its "
        "inf/NaN skip would skip one rank's partition, not the step "
        "(tests/python/test_zero.py shows both); fusedamp.distributed.ZeroRedundancyOptimizer "
        "and fusedamp's FSDP2 path all-reduce [found_inf, sum_sq] so that every rank clips by "
        "the global norm and skips alike (the one small all_reduce a step in their rows, beside "
        "DDP's gradient all-reduce for ddp+zero)."]
    return "\n".join(lines) + "\n"


def _setting(results, ms, args, wall_s):
    flags = ", ".join(ms["cpu_flags"]) or "none of " + ", ".join(CPU_FLAGS)
    first = next((r for r in results if r["params_by_dtype"]), results[0])
    params = next(iter(first["rows"].values()), {}).get("params", 0)
    dirty = (f" plus uncommitted changes to {', '.join(ms['uncommitted_changes'])} (sha256 "
             f"{ms['uncommitted_sha256']}… of `git diff HEAD` and those untracked files): the "
             "working tree as it was, with "
             f"the library built from it at {ms['fusedamp_library_built']}"
             if ms["uncommitted_changes"] else "")
    return [
        "# Distributed ZeRO-1 on CPU ranks: FSDP2 vs DDP + ZeRO", "",
        "`" + " ".join(["PYTHONPATH=python python3 benchmarks/bench_distributed.py"]
                       + ([args["argv"]] if args["argv"] else [])) + "`", "",
        f"Commit {ms['commit']}{dirty}; {ms['date_utc']}; {ms['cpu']}, {ms['cpu_cores']} cores "
        f"({flags}); torch {ms['torch']}, Gloo, one torch thread per rank; load average "
        f"{ms['load_average_before'][0]:.2f} before the run, "
        + ", ".join(f"{r['load_average_after'][0]:.2f} after the {r['world']}-rank launch"
                    for r in results)
        + f" (other work shares this VM); whole run {wall_s:.0f} s. "
        f"World sizes {', '.join(str(r['world']) for r in results)}: this is a shared 2-core "
        "VM, so 4 ranks oversubscribe it two to one (each rank gets about half a core and "
        "step times include the ranks waiting for each other's cores); the 4-rank rows "
        "measure the engines under that contention, not a 4-core machine.", "",
        f"Model: the demo's character GPT (examples/python/amp_models.py: CharGPT, dim "
        f"{args['dim']}, {args['layers']} blocks, {args['heads']} heads, context "
        f"{args['context']}), {params:,} parameters"
        + (f" ({', '.join(f'{n:,} {d}' for d, n in first['params_by_dtype'].items())} after "
           f"fusedamp.convert_module; {megabytes(first['model_bytes'])} of weights)"
           if first["params_by_dtype"] else "")
        + f". Global batch {args['batch']} sequences, split evenly over the ranks; the same "
        "batches in the same order for every engine; AdamW lr 1e-3, betas (0.9, 0.999), eps "
        "1e-8, weight decay 0.01, FP32 master weights and moments, BF16 compute, no loss "
        "scaling (fusedamp.GradScaler disabled) and no clipping. All engines start from the same "
        "BF16-rounded weights.", ""]


def _method(args):
    return [
        "Engines: **ddp+zero** = DistributedDataParallel on fusedamp.convert_module(model, "
        "bf16) (BF16 weights, FP32 norm layers) + fusedamp.distributed.ZeroRedundancyOptimizer "
        "(torch's ZeroRedundancyOptimizer with optimizer_class=fusedamp.optim.AdamW, "
        "master_weights=True, parameters_as_bucket_view=False: each parameter broadcast by its "
        "owner; fusedamp's subclass all-reduces the local step's [found_inf, sum_sq] so that "
        "clipping and skips are global, one small all_reduce a step), DDP's gradients averaged "
        "by torch's allreduce_hook (the same all-reduce as DDP's built-in one, made through "
        "dist.all_reduce so it can be counted); **ddp+zero-bv** = the same with "
        "parameters_as_bucket_view=True (each rank's parameters are views of one bucket, "
        "broadcast in one call), which takes one dtype: its norm layers in BF16 as well, the "
        "model fsdp2 trains (FSDP2's policy runs the norm layers in BF16 too), so that forward "
        "and backward are the same work as fsdp2's: the like-for-like reference for it; "
        "**fsdp2** = fully_shard on every block and the root (reshard_after_forward=False, "
        "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)) + fusedamp.optim.AdamW on "
        "the FP32 shards; **fsdp2-bf16r** = the same with reduce_dtype=bf16 (the gradients "
        "reduce-scattered in BF16).", "",
        f"Step time: forward + backward + optimizer step between a barrier before and one after "
        f"(the slowest rank's time), {args['warmup']} untimed warm-up steps per engine, then "
        f"{args['steps']} timed steps per engine in {args['rounds']} interleaved rounds (rotating "
        "order)" + (f", in each of {args['repeats']} launches per world size"
                    if args["repeats"] > 1 else "")
        + "; the median over steps, with the 25th–75th percentile. Ratios: the engine's median "
        "/ the ddp+zero row's and / the ddp+zero-bv row's at the same world size (> 1: slower). "
        "Fwd+bwd: the median of the forward and backward alone (the slowest rank), which "
        "includes FSDP2's all-gather and reduce-scatter and DDP's all-reduce.", "",
        "Bytes communicated: torch.distributed's collective functions (all_reduce, broadcast, "
        "reduce, all_gather, all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor, "
        "_all_gather_base, _reduce_scatter_base, all_to_all(_single), gather, scatter and the "
        "coalesced forms) are wrapped on torch.distributed, distributed_c10d and every loaded "
        "torch.distributed / fusedamp module before the engines are built; during the timed "
        "steps each call adds the size of the full tensor it works on (all-reduce / broadcast: "
        "the tensor; all-gather: the gathered output; reduce-scatter: the unreduced input) on "
        "the calling rank. **payload** is that sum per rank per step. **wire** is a model "
        "derived from the same calls: the bytes a rank sends, averaged over ranks, under a "
        "bandwidth-optimal algorithm ((N−1)/N of the payload for all-gather, reduce-scatter "
        "and broadcast, 2(N−1)/N for all-reduce), whatever Gloo does. Barriers are not "
        "counted. The wrappers cost about 3 µs a call (argument binding), 0.2 ms a step for "
        "ddp+zero's 56 calls and less for the others.", "",
        "State bytes per rank: the tensors in the ZeroRedundancyOptimizer's local optimizer "
        "(`opt.optim.state`: master_param, moments, step) for the ddp+zero rows; the local "
        "shards of the state DTensors (moments, step) for fsdp2, whose FP32 masters are the "
        "sharded parameters themselves: the column \"+ masters\" adds them, so it compares "
        "like with like.", ""]


def _table(results):
    rows = []
    for res in results:
        for name in ENGINES:
            r = res["rows"].get(name)
            if r is None:
                if name in res["errors"]:
                    rows.append(f"| {name} | {res['world']} | failed: {res['errors'][name]} "
                                "| | | | | | | | | |")
                continue
            calls = ", ".join(f"{k} {v:g}" for k, v in sorted(r["calls_per_step"].items()))
            rows.append([name, res["world"], f"{r['step_ms_median']:.1f}",
                         f"{r['step_ms_p25']:.0f}–{r['step_ms_p75']:.0f}",
                         f"{r['fwd_bwd_ms_median']:.1f}", *_ratios(r),
                         _range(r["payload_bytes_per_rank"]), _range(r["wire_bytes_per_rank"]),
                         calls, _range(r["state_bytes_per_rank"]),
                         _range(r["state_and_master_bytes_per_rank"])])
    head = ["engine", "ranks", "step ms (median)", "p25–p75 ms", "fwd+bwd ms",
            "ratio vs ddp+zero", "ratio vs ddp+zero-bv", "payload per rank per step",
            "wire per rank per step", "collective calls per step", "state per rank",
            "state + masters per rank"]
    return table(head, "lrrrrrrrrlrr", compact=True) + [
        r if isinstance(r, str) else row_line(r) for r in rows] + [
        "", "A range (a–b) means the ranks differ: ZeroRedundancyOptimizer assigns whole "
        "parameters to ranks, so its shards are uneven.", ""]


def _launches(results, repeats):
    lines = [f"Each world size was launched {repeats} times; the table pools their timed "
             "steps. Each launch on its own (median ms; ratio vs ddp+zero / vs ddp+zero-bv), "
             "a measure of how far this VM moves between launches:", ""]
    rows = []
    for res in results:
        for name in ENGINES:
            if name not in res["rows"]:
                continue
            cells = []
            for per_launch in res["per_launch"]:
                r = per_launch.get(name)
                cells.append("—" if r is None else
                             " / ".join([f"{r['step_ms_median']:.1f} ms"] + _ratios(r)))
            rows.append([name, res["world"]] + cells)
    return lines + table(["engine", "ranks"] + [f"launch {i + 1}" for i in range(repeats)],
                         "lr" + "l" * repeats, rows, compact=True) + [""]


def _plausibility(results):
    lines = ["## Plausibility of the byte counts", "",
             "Against the converted model's weight bytes W (BF16 weights + FP32 norm layers) and "
             "its parameter count P. Expected payload per step: ddp+zero W (all-reduce of the "
             "gradients, as DDP's buckets say) + W (each parameter broadcast by its owner), "
             "ddp+zero-bv the same on the all-BF16 model, 2·P + 2·P (each rank's bucket "
             "broadcast once), each plus fusedamp's 16-byte all-reduce; fsdp2 2·P (BF16 "
             "all-gather, every parameter cast by the policy) + 4·P (FP32 reduce-scatter; "
             "fsdp2-bf16r 2·P, BF16) plus fusedamp's 16-byte all-reduce, each padded per "
             "shard.", ""]
    rows = []
    for res in results:
        w_bytes = res["model_bytes"]
        if not w_bytes or not res["rows"]:
            continue
        params = next(iter(res["rows"].values()))["params"]
        expect = {"ddp+zero": "≈ 2.00", "ddp+zero-bv": f"≈ {4 * params / w_bytes:.2f} (4·P / W)",
                  "fsdp2": f"≈ {6 * params / w_bytes:.2f} (6·P / W)",
                  "fsdp2-bf16r": f"≈ {4 * params / w_bytes:.2f} (4·P / W)"}
        for name in ENGINES:
            r = res["rows"].get(name)
            if r is not None:
                rows.append([name, res["world"],
                             f"{max(r['payload_bytes_per_rank']) / w_bytes:.3f}", expect[name],
                             r.get("ddp_bucket_sizes") or "—"])
    return lines + table(["engine", "ranks", "payload / W", "expected", "DDP bucket bytes"],
                         "lrrlr", rows, compact=True)


def _agreement(results):
    lines = ["", "## Do the engines train the same model?", "",
             "Training loss averaged over the ranks at the first and the last step (the same "
             "global batches for every engine), the loss of the final weights on one held-out "
             "batch, and the relative L2 distance of the final weights from the reference's "
             f"(the first engine run: {ENGINES[0]} unless left out). Agreement: every loss "
             f"within {100 * LOSS_TOLERANCE:.0f} % of the reference's.", ""]
    rows = []
    for res in results:
        base = res["rows"].get(res["reference"])
        for name in ENGINES:
            r = res["rows"].get(name)
            if r is None:
                continue
            ok = base is not None and all(
                abs(r[k] - base[k]) <= LOSS_TOLERANCE * abs(base[k])
                for k in ("loss_first", "loss_last", "val_loss"))
            r["losses_agree"] = ok
            rows.append([name, res["world"], f"{r['loss_first']:.4f}", f"{r['loss_last']:.4f}",
                         f"{r['val_loss']:.4f}", f"{r['weights_rel_diff_vs_reference']:.2e}",
                         "yes" if ok else "**no**"])
    return lines + table(["engine", "ranks", "first loss", "last loss", "held-out loss",
                          "weights vs reference (rel. L2)", "agrees"], "lrrrrrl", rows,
                         compact=True)


def _faster(name, ratio, ms, ref_name, ref_ms):
    if ratio > 1:
        return f"{ref_name} is faster by {100 * (ratio - 1):.0f} % ({ms - ref_ms:.1f} ms per step)"
    return f"{name} is faster by {100 * (1 - ratio):.0f} % ({ref_ms - ms:.1f} ms per step)"


def _reading(results):
    """The honest reading, from the numbers of this run."""
    lines = []
    for res in results:
        rows, w = res["rows"], res["world"]
        base, like = rows.get("ddp+zero"), rows.get("ddp+zero-bv")
        if base is None:
            continue
        if like is not None:
            lines.append(
                f"- {w} ranks, the two ddp+zero rows (one broadcast per parameter on the "
                "converted model, or one bucket per rank on the all-BF16 model): "
                f"{like['step_ms_median']:.1f} vs {base['step_ms_median']:.1f} ms, "
                f"{like['ratio_vs_ddp_zero']:.2f}x: what the bucket view and the BF16 norm "
                "layers save or cost, plus this run's noise.")
        for name in ("fsdp2", "fsdp2-bf16r"):
            if name not in rows and name not in res["errors"]:
                continue  # not asked for
            r = rows.get(name)
            if r is None:
                lines.append(f"- {w} ranks, {name}: failed ({res['errors'].get(name)}).")
                continue
            parts = []
            for (ref_name, key), ref in zip(REFERENCES, (base, like)):
                if ref is None:
                    continue
                ratio = r[key]
                verdict = "within 10 %" if abs(ratio - 1) <= 0.10 else "**not** within 10 %"
                faster = _faster(name, ratio, r["step_ms_median"], ref_name, ref["step_ms_median"])
                parts.append(f"{ratio:.2f}x {ref_name}'s step time ({verdict}: {faster}; "
                             f"p25–p75 {r['step_ms_p25']:.0f}–{r['step_ms_p75']:.0f} ms vs "
                             f"{ref['step_ms_p25']:.0f}–{ref['step_ms_p75']:.0f} ms)")
            bytes_ratio = max(r["payload_bytes_per_rank"]) / max(base["payload_bytes_per_rank"])
            wire_ratio = max(r["wire_bytes_per_rank"]) / max(base["wire_bytes_per_rank"])
            state_ratio = (max(r["state_and_master_bytes_per_rank"]) /
                           max(base["state_and_master_bytes_per_rank"]))
            lines.append(
                f"- {w} ranks, {name}: " + "; ".join(parts) + ". It hands "
                f"{bytes_ratio:.2f}x ddp+zero's bytes to collectives per step ({wire_ratio:.2f}x "
                "on the wire model) and keeps "
                f"{state_ratio:.2f}x its state + FP32 masters on its most loaded rank.")
    return lines
