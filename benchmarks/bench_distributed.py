"""ZeRO-1 on CPU ranks with fusedamp's optimizers: torch's FSDP2 against DDP + ZeRO.

    PYTHONPATH=python python3 benchmarks/bench_distributed.py [--ranks 2,4] [--steps 20]

The question it answers: which of torch's engines to pair with fusedamp's optimizers, at what
cost in step time, bytes communicated and state per rank. One run trains the same BF16 model
on the same data with each of

  ddp+zero  DistributedDataParallel on fusedamp.convert_module(model, bf16) +
            fusedamp.distributed.ZeroRedundancyOptimizer (torch's ZeRO-1 with
            optimizer_class=fusedamp.optim.AdamW, master_weights=True, whose statistics pass is
            all-reduced so that clipping and skips are global);
  ddp+zero-bv  the same with parameters_as_bucket_view=True (one broadcast per rank, not one
            per parameter), which needs one dtype: its norm layers in BF16 too (the model of
            fsdp2, so that forward and backward are the same work and the step-time difference
            is the engines');
  fsdp2     fully_shard on every block and the root (reshard_after_forward=False,
            MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)) + fusedamp.optim.AdamW
            (the FP32 sharded parameters are the master weights);
  fsdp2-bf16r  the same with reduce_dtype=bf16 (the gradients reduce-scattered in BF16);

on each world size of --ranks (Gloo, spawned processes, one torch thread each), all of them
in the same processes, their timed steps interleaved. Per engine and world size: the median
training step (forward + backward + optimizer step, between two barriers), the bytes each rank
hands to torch.distributed collectives per step, the optimizer state per rank, and the losses
(a check that they all did the same training). Writes benchmarks/results/distributed_cpu.md
and .json (--out to change). The engines are built in ranks/engines.py, run by
ranks/rank_main.py, counted by ranks/collectives.py and reported by ranks/report.py.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import harness
from harness import results as res
from harness.machine import library_built_utc, machine_info, working_tree
from ranks.engines import ENGINES
from ranks.rank_main import launch
from ranks.report import markdown, megabytes
from ranks.summary import pooled, summarise

# The ranks import the package and the demo's models from this checkout (spawned processes
# start from this sys.path).
harness.use_paths("python", "examples")


def main(argv=None):
    ap = res.parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4", help="world sizes, comma-separated (default 2,4)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per engine (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per engine first")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds of timed steps")
    ap.add_argument("--repeats", type=int, default=1,
                    help="launches per world size; their timed steps are pooled (default 1)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    res.add_output(ap, default=harness.RESULTS / "distributed_cpu",
                   help_out="path of the results without .md/.json")
    a = ap.parse_args(argv)
    worlds = [int(w) for w in a.ranks.split(",")]
    for w in worlds:
        if a.batch % w:
            ap.error(f"--batch {a.batch} does not split evenly over {w} ranks")
    args = dict(res.recorded(a), engines=[e for e in a.engines.split(",") if e],
                argv=" ".join(sys.argv[1:] if argv is None else argv))
    unknown = set(args["engines"]) - set(ENGINES)
    if unknown:
        ap.error(f"unknown engines {sorted(unknown)}; choose from {ENGINES}")
    # Gloo picks an interface by the host name; loopback is what the ranks share here.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    machine = code_and_machine()
    t0 = time.perf_counter()
    results = []
    for w in worlds:
        launches = []
        for i in range(a.repeats):
            print(f"{w} ranks, launch {i + 1} of {a.repeats} ...", flush=True)
            launches.append(launch(w, args))
        result = summarise(w, pooled(launches))
        result["per_launch"] = [summarise(w, ranks)["rows"] for ranks in launches]
        for name, r in result["rows"].items():
            print(f"  {name:12s} {r['step_ms_median']:8.1f} ms  "
                  f"x{r['ratio_vs_ddp_zero'] or 0:.2f}  "
                  f"{megabytes(max(r['payload_bytes_per_rank']))}/step  loss {r['loss_last']:.4f}",
                  flush=True)
        for name, err in result["errors"].items():
            print(f"  {name:12s} FAILED: {err}", flush=True)
        results.append(result)
    machine["load_average_after"] = os.getloadavg()
    wall_s = time.perf_counter() - t0
    text = markdown(results, machine, args, wall_s)  # marks the rows whose losses agree
    if not a.no_files:
        out = os.path.abspath(a.out)
        res.write_results(os.path.dirname(out), os.path.basename(out), {
            "machine": machine, "args": args, "wall_s": wall_s, "results": results}, text)
    print(text)
    return 0


def code_and_machine():
    """The machine record with what identifies the code that ran: the commit and, where the
    tree differs from it, a digest of the changes, and when the library was built."""
    info = machine_info("cpu")
    info.update(working_tree(), fusedamp_library_built=library_built_utc(),
                load_average_before=os.getloadavg())
    return info


if __name__ == "__main__":
    sys.exit(main())
