"""ZeRO-1 on CPU ranks: fusedamp's ShardedOptimizer against torch's FSDP2 and DDP + ZeRO.

    PYTHONPATH=python python3 benchmarks/bench_distributed.py [--ranks 2,4] [--steps 20]

The question it answers: can fusedamp.distributed.ShardedOptimizer be retired in favour of
torch's own engines? One run trains the same BF16 model on the same data with each of

  sharded   fusedamp.convert_module(model, bf16) + fusedamp.distributed.ShardedOptimizer
            ("adamw", master_weights=True), no DDP wrapper;
  sharded-bf16  the same, its norm layers in BF16 too (the model of fsdp2 and ddp+zero-bv),
            so that forward and backward are the same work and the step-time difference is
            the engines';
  fsdp2     fully_shard on every block and the root (reshard_after_forward=False,
            MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)) + fusedamp.optim.AdamW
            (the FP32 sharded parameters are the master weights);
  fsdp2-bf16r  the same with reduce_dtype=bf16 (the gradients reduce-scattered in BF16, as
            sharded does: its bytes on the wire);
  ddp+zero  DistributedDataParallel on the converted BF16 model (the model of sharded) +
            fusedamp.distributed.ZeroRedundancyOptimizer (torch's ZeRO-1 with
            optimizer_class=fusedamp.optim.AdamW, master_weights=True, whose statistics pass is
            all-reduced so that clipping and skips are global);
  ddp+zero-bv  the same with parameters_as_bucket_view=True (one broadcast per rank, not one
            per parameter), which needs one dtype: its norm layers in BF16 too;

on each world size of --ranks (Gloo, spawned processes, one torch thread each), all of them
in the same processes, their timed steps interleaved. Per engine and world size: the median
training step (forward + backward + optimizer step, between two barriers), the bytes each rank
hands to torch.distributed collectives per step, the optimizer state per rank, and the losses
(a check that they all did the same training). Writes benchmarks/results/distributed_cpu.md
and .json (--out to change).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples", "python"))
sys.path.insert(0, os.path.join(ROOT, "python"))

ENGINES = ("sharded", "sharded-bf16", "fsdp2", "fsdp2-bf16r", "ddp+zero", "ddp+zero-bv")
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
# Agreement of the engines' losses: they differ only by where BF16 rounding happens (FSDP2
# reduces FP32 gradients; the others reduce BF16 gradients; the norm layers are FP32 in the
# sharded row only), which over a few tens of steps moves a loss by far less than this.
LOSS_TOLERANCE = 0.02


# ------------------------------------------------------------------------ collective counting
# What a collective carries, from its arguments: the argument holding the full-size tensor(s)
# and, per rank, the fraction of that size a bandwidth-optimal algorithm must send (averaged over
# the ranks; an all-reduce is a reduce-scatter plus an all-gather, hence 2(N-1)/N). The first
# number is measured; the second is a model of the wire that does not depend on which
# algorithm Gloo picks.
_ALL_REDUCE = lambda n: 2 * (n - 1) / n  # noqa: E731
_ONE_PASS = lambda n: (n - 1) / n  # noqa: E731
_COLLECTIVES = {
    "all_reduce": ("tensor", 1, _ALL_REDUCE),
    "all_reduce_coalesced": ("tensors", 1, _ALL_REDUCE),
    "broadcast": ("tensor", 1, _ONE_PASS),
    "reduce": ("tensor", 1, _ONE_PASS),
    "all_gather": ("tensor_list", 1, _ONE_PASS),
    "all_gather_into_tensor": ("output_tensor", 1, _ONE_PASS),
    "_all_gather_base": ("output_tensor", 1, _ONE_PASS),
    "all_gather_coalesced": ("output_tensor_lists", 1, _ONE_PASS),
    "reduce_scatter": ("input_list", 1, _ONE_PASS),
    "reduce_scatter_tensor": ("input", 1, _ONE_PASS),
    "_reduce_scatter_base": ("input", 1, _ONE_PASS),
    "all_to_all_single": ("input", 1, _ONE_PASS),
    "all_to_all": ("input_tensor_list", 1, _ONE_PASS),
    "gather": ("tensor", "world", _ONE_PASS),
    "scatter": ("tensor", "world", _ONE_PASS),
}


def _nbytes(x):
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return x.numel() * x.element_size() if hasattr(x, "element_size") else 0


class CollectiveCounter:
    """Counts what the torch.distributed collectives are given while ``key`` is set.

    The functions are replaced on torch.distributed, on distributed_c10d and on every loaded
    torch.distributed / fusedamp module that imported one by name, so a call is seen however
    the engine spells it. Only the outermost call counts: the deprecated spellings
    (_all_gather_base, all_gather_object, ...) call the current ones."""

    def __init__(self, world):
        self.world = world
        self.key = None
        self.totals = {}  # key -> {"payload": bytes, "wire": bytes, "calls": {name: n}}
        self._depth = threading.local()
        self._originals = {}

    def install(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name in _COLLECTIVES:
            fn = getattr(c10d, name, None)
            if fn is not None:
                self._originals[name] = fn
        wrapped = {name: self._wrap(name, fn) for name, fn in self._originals.items()}
        by_id = {id(fn): wrapped[name] for name, fn in self._originals.items()}
        modules = [dist, c10d] + [m for n, m in list(sys.modules.items()) if m is not None and (
            n.startswith("torch.distributed") or n.startswith("fusedamp"))]
        for module in modules:
            for attr, value in list(vars(module).items()):
                if id(value) in by_id:
                    setattr(module, attr, by_id[id(value)])

    def _wrap(self, name, fn):
        arg, scale, wire = _COLLECTIVES[name]
        sig = inspect.signature(fn)

        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if self.key is not None and depth == 0:
                bound = sig.bind_partial(*args, **kwargs).arguments
                size = _nbytes(bound.get(arg, args[0] if args else None))
                if scale == "world":
                    size *= self.world
                t = self.totals.setdefault(self.key, {"payload": 0, "wire": 0.0, "calls": {}})
                t["payload"] += size
                t["wire"] += size * wire(self.world)
                t["calls"][name] = t["calls"].get(name, 0) + 1
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        counted.__wrapped__ = fn
        return counted


# ------------------------------------------------------------------------------ the ranks
def _model(vocab, args):
    import torch
    from amp_models import CharGPT

    torch.manual_seed(0)  # the same initial weights for every engine and rank
    return CharGPT(vocab, context=args["context"], dim=args["dim"], layers=args["layers"],
                   heads=args["heads"])


def _build(name, vocab, args, mesh):
    """(module to call, optimizer, module whose weights are the model) for engine ``name``."""
    import torch
    import torch.distributed as dist

    import fusedamp

    model = _model(vocab, args)
    if name in ("sharded", "sharded-bf16"):
        from fusedamp.distributed import ShardedOptimizer

        fusedamp.convert_module(model, torch.bfloat16)
        if name == "sharded-bf16":
            model.to(torch.bfloat16)  # what ddp+zero has to do; see there
        opt = ShardedOptimizer(model.parameters(), "adamw", master_weights=True, **ADAMW)
        return model, opt, model
    if name.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # The other engines start from the BF16-rounded initial weights (their FP32 masters
        # are made from the converted model); so does this one, so that all of them train
        # from the same point and their losses can be compared step for step.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        # fsdp2-bf16r reduce-scatters the gradients in BF16, as sharded does.
        reduce_dtype = torch.bfloat16 if name.endswith("-bf16r") else torch.float32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        opt = fusedamp.optim.AdamW(model.parameters(), master_weights=True, **ADAMW)
        return model, opt, model
    if name.startswith("ddp+zero"):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel as DDP

        from fusedamp.distributed import ZeroRedundancyOptimizer

        fusedamp.convert_module(model, torch.bfloat16)
        if name.endswith("-bv"):
            # torch's flat bucket views take parameters of one dtype (ValueError: "only
            # supports using the same dense type for all parameters"), and the converted model
            # keeps its norm layers in FP32: they go to BF16 too (the converted model's casts
            # follow), as FSDP2's policy casts them. Their FP32 masters stay in the optimizer.
            model.to(torch.bfloat16)
        net = DDP(model)
        # DDP's built-in all-reduce runs in C++, out of reach of the Python wrappers that count
        # bytes; torch's allreduce_hook is the same averaging all-reduce of each bucket made
        # through dist.all_reduce (one Python call per bucket, a few per step).
        net.register_comm_hook(dist.group.WORLD, allreduce_hook)
        # Without the bucket view ZeRO broadcasts every parameter on its own (54 calls a step
        # here); with it, one bucket per rank, which an all-BF16 model allows.
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=fusedamp.optim.AdamW,
                                      parameters_as_bucket_view=name.endswith("-bv"),
                                      master_weights=True, **ADAMW)
        return net, opt, model
    raise ValueError(name)


def _state_bytes(name, opt, model):
    """(optimizer state, state + FP32 master weights) held by this rank, in bytes."""
    import fusedamp.distributed as fd

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    if name.startswith("sharded"):  # its state holds the masters of its shard
        b = fd.optimizer_state_bytes(opt)
        return b, b
    if name.startswith("ddp+zero"):  # the local fusedamp optimizer's state holds master_param
        b = sum(v.nbytes for s in opt.optim.state.values() for v in s.values()
                if hasattr(v, "nbytes"))
        return b, b
    # FSDP2: the moments are DTensors laid out like the parameters; the FP32 parameter shards
    # are the masters, held by the model rather than the optimizer.
    b = sum(local(v).nbytes for s in opt.state.values() for v in s.values()
            if hasattr(v, "nbytes"))
    return b, b + sum(local(p).nbytes for p in model.parameters())


def _full_weights(name, model):
    import torch

    with torch.no_grad():
        return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).float().reshape(-1)
                          for p in model.parameters()])


def _rank_main(rank, world, init_file, args, out_dir):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    import fusedamp
    import fusedamp.distributed  # noqa: F401  (loaded before the collectives are wrapped)
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.optim  # noqa: F401
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: F401
    from amp_models import char_batch, char_data

    # Two cores for up to four ranks: more threads per rank would only fight over them.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (world,))
    counter = CollectiveCounter(world)
    counter.install()

    train, val, vocab = char_data("cpu", args["context"])
    batch, context = args["batch"], args["context"]
    rows = batch // world

    def global_batch(step, data=train, seed=10_000):
        # One global batch per step index, the same in every engine; each rank takes its rows.
        return char_batch(data, batch, context, torch.Generator().manual_seed(seed + step))

    engines, errors = {}, {}
    for name in args["engines"]:
        try:
            engines[name] = _build(name, vocab, args, mesh)
        except Exception as e:  # noqa: BLE001  (reported in the results)
            errors[name] = f"build: {type(e).__name__}: {e}"
        _agree(dist, torch, errors, name)
    scaler = fusedamp.GradScaler("cpu", enabled=False)  # BF16: no loss scaling anywhere

    def train_step(name, step):
        net, opt, _ = engines[name]
        x, y = global_batch(step)
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        t0 = time.perf_counter()
        loss = F.cross_entropy(net(x).float().reshape(-1, vocab), y.reshape(-1))
        scaler.scale(loss).backward()
        t1 = time.perf_counter()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), t1 - t0

    steps_done = {n: 0 for n in engines}
    losses = {n: [] for n in engines}
    times = {n: [] for n in engines}
    fwd_bwd = {n: [] for n in engines}

    def run(name, timed):
        if name in errors:
            return
        try:
            dist.barrier()
            counter.key = name if timed else None
            t0 = time.perf_counter()
            loss, fb = train_step(name, steps_done[name])
            dist.barrier()  # a step ends when the slowest rank is done
            elapsed = time.perf_counter() - t0
            counter.key = None
            steps_done[name] += 1
            losses[name].append(loss.item())
            if timed:
                times[name].append(elapsed)
                fwd_bwd[name].append(fb)
        except Exception as e:  # noqa: BLE001
            counter.key = None
            errors[name] = f"step {steps_done[name]}: {type(e).__name__}: {e}"
        _agree(dist, torch, errors, name)

    for name in list(engines):
        for _ in range(args["warmup"]):
            run(name, timed=False)
    # Interleaved rounds in a rotating order: the VM's speed drifts over a run by more than
    # the engines differ, and this spreads the drift evenly over them.
    order = [n for n in args["engines"] if n in engines]
    per_round = math.ceil(args["steps"] / args["rounds"])
    for r in range(args["rounds"]):
        turn = order[r % len(order):] + order[:r % len(order)]
        for name in turn:
            for _ in range(min(per_round, args["steps"] - len(times[name]))):
                run(name, timed=True)

    # After training: one held-out batch, the whole of it on every rank, and the weights.
    x_val, y_val = global_batch(0, data=val, seed=20_000)
    out = {"rank": rank, "world": world, "errors": errors, "engines": {}}
    reference = None
    for name in order:
        if name in errors:
            continue
        net, opt, model = engines[name]
        # Before the held-out forward: FSDP2 without resharding after forward would leave the
        # gathered BF16 weights registered on the modules in place of the FP32 shards.
        state, state_and_masters = _state_bytes(name, opt, model)
        weights = _full_weights(name, model)
        if reference is None:
            reference = weights
        with torch.no_grad():
            val_loss = F.cross_entropy(model(x_val).float().reshape(-1, vocab),
                                       y_val.reshape(-1)).item()
        out["engines"][name] = {
            "step_s": times[name], "fwd_bwd_s": fwd_bwd[name], "losses": losses[name],
            "val_loss": val_loss, "state_bytes": state,
            "state_and_master_bytes": state_and_masters,
            "comm": counter.totals.get(name, {"payload": 0, "wire": 0.0, "calls": {}}),
            "timed_steps": len(times[name]),
            "weights_rel_diff_vs_first": ((weights - reference).norm() /
                                          reference.norm()).item(),
            "params": int(sum(p.numel() for p in model.parameters())),
        }
        if name.startswith("ddp+zero"):
            # DDP's own record of its buckets: the bytes its all-reduce must carry per step,
            # an independent check of the counted all_reduce payload.
            data = net._get_ddp_logging_data()
            out["engines"][name]["ddp_bucket_sizes"] = data.get("bucket_sizes")
    if "sharded" in out["engines"]:
        model = engines["sharded"][2]
        out["model_bytes"] = int(sum(p.nbytes for p in model.parameters()))
        out["params_by_dtype"] = {}
        for p in model.parameters():
            key = str(p.dtype).replace("torch.", "")
            out["params_by_dtype"][key] = out["params_by_dtype"].get(key, 0) + p.numel()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def _agree(dist, torch, errors, name):
    """Every rank learns whether any rank failed with engine ``name``, so that all of them
    leave it alone from then on (a rank that went on alone would wait in a collective)."""
    failed = torch.tensor([1.0 if name in errors else 0.0])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item() and name not in errors:
        errors[name] = "failed on another rank"


def launch(world, args):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="bench_distributed_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(_rank_main, args=(world, init_file, args, tmp), nprocs=world,
                           join=True, start_method="spawn")
        ranks = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    return ranks


# ------------------------------------------------------------------------------ the report
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
        q = statistics.quantiles(steps, n=4) if len(steps) > 1 else [steps[0]] * 3
        n_timed = len(steps)
        payload = [p["comm"]["payload"] / n_timed for p in per_rank]
        wire = [p["comm"]["wire"] / n_timed for p in per_rank]
        losses = [sum(ls) / world for ls in zip(*(p["losses"] for p in per_rank))]
        rows[name] = {
            "world": world, "engine": name, "timed_steps": n_timed,
            "step_ms_median": 1e3 * statistics.median(steps),
            "step_ms_p25": 1e3 * q[0], "step_ms_p75": 1e3 * q[2],
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
    for key, ref in (("ratio_vs_sharded", rows.get("sharded")),
                     ("ratio_vs_sharded_bf16", rows.get("sharded-bf16"))):
        for r in rows.values():
            r[key] = r["step_ms_median"] / ref["step_ms_median"] if ref else None
    return {"world": world, "rows": rows, "errors": first["errors"],
            "reference": next(iter(first["engines"]), None),
            "load_average_after": os.getloadavg(),
            "model_bytes": first.get("model_bytes"),
            "params_by_dtype": first.get("params_by_dtype")}


def _mb(b):
    return f"{b / 1e6:.2f} MB"


def _range(values, fmt=_mb):
    lo, hi = min(values), max(values)
    return fmt(lo) if abs(hi - lo) <= 0.005 * max(hi, 1) else f"{fmt(lo)}–{fmt(hi)}"


def _git(*cmd):
    try:
        return subprocess.run(["git", "-C", ROOT, *cmd], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info():
    """bench_step's description of the machine (CPU model and flags, torch, date), with what
    identifies the code that ran: the commit and, where the tree differs from it, a digest of
    the tracked files' diff and of the package's and library's untracked sources (the same
    working tree gives the same digest), and when the library was built."""
    from bench_step import machine_info as shared

    info = shared("cpu")
    changed = _git("diff", "--name-only", "HEAD").splitlines()
    untracked = [f for f in _git("ls-files", "--others", "--exclude-standard", "csrc",
                                 "python", "cuda").splitlines() if f]
    digest = hashlib.sha256(_git("diff", "HEAD").encode())
    for path in untracked:
        with open(os.path.join(ROOT, path), "rb") as f:
            digest.update(path.encode() + b"\0" + f.read())
    dirty = changed + [f"{f} (untracked)" for f in untracked]
    from fusedamp import _library

    lib = os.path.realpath(_library.library_path)
    info.update(commit=_git("rev-parse", "--short", "HEAD") or "unknown",
                uncommitted_changes=dirty,
                uncommitted_sha256=digest.hexdigest()[:12] if dirty else None,
                fusedamp_library_built=datetime.datetime.fromtimestamp(
                    os.path.getmtime(lib)).strftime("%Y-%m-%d %H:%M:%S"),
                load_average_before=os.getloadavg())
    return info


def _faster(name, ratio, ms, ref_name, ref_ms):
    if ratio > 1:
        return f"{ref_name} is faster by {100 * (ratio - 1):.0f} % ({ms - ref_ms:.1f} ms per step)"
    return f"{name} is faster by {100 * (1 - ratio):.0f} % ({ref_ms - ms:.1f} ms per step)"


def _reading(results):
    """The honest reading, from the numbers of this run."""
    lines = []
    for res in results:
        rows, w = res["rows"], res["world"]
        base, like = rows.get("sharded"), rows.get("sharded-bf16")
        if base is None:
            continue
        if like is not None:
            lines.append(
                f"- {w} ranks, the two ShardedOptimizer rows (the same engine; FP32 or BF16 norm "
                f"layers): {like['step_ms_median']:.1f} vs {base['step_ms_median']:.1f} ms, "
                f"{like['ratio_vs_sharded']:.2f}x. Not an engine difference: the gap is what the "
                "FP32 norm layers (and convert_module's casts around them) cost or save plus "
                "this run's noise, a yardstick for the ratios below.")
        for name in ("fsdp2", "fsdp2-bf16r", "ddp+zero", "ddp+zero-bv"):
            if name not in rows and name not in res["errors"]:
                continue  # not asked for
            r = rows.get(name)
            if r is None:
                lines.append(f"- {w} ranks, {name}: failed ({res['errors'].get(name)}).")
                continue
            parts = []
            for ref_name, ref, key in (("sharded", base, "ratio_vs_sharded"),
                                       ("sharded-bf16", like, "ratio_vs_sharded_bf16")):
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
                f"{bytes_ratio:.2f}x sharded's bytes to collectives per step ({wire_ratio:.2f}x "
                "on the wire model) and keeps "
                f"{state_ratio:.2f}x its state + FP32 masters on its most loaded rank.")
    return lines


def write_report(results, machine, args, path_base, wall_s):
    ms = machine
    from bench_step import CPU_FLAGS

    flags = ", ".join(ms["cpu_flags"]) or "none of " + ", ".join(CPU_FLAGS)
    first = next((r for r in results if r["params_by_dtype"]), results[0])
    any_row = next(iter(first["rows"].values()), {})
    params = any_row.get("params", 0)
    dirty = (f" plus uncommitted changes to {', '.join(ms['uncommitted_changes'])} (sha256 "
             f"{ms['uncommitted_sha256']}… of `git diff HEAD` and those untracked files): the "
             "working tree as it was, with "
             f"the library built from it at {ms['fusedamp_library_built']}"
             if ms["uncommitted_changes"] else "")
    lines = [
        "# Distributed ZeRO-1 on CPU ranks: ShardedOptimizer vs FSDP2 vs DDP + ZeRO", "",
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
           f"fusedamp.convert_module; {_mb(first['model_bytes'])} of weights)"
           if first["params_by_dtype"] else "")
        + f". Global batch {args['batch']} sequences, split evenly over the ranks; the same "
        "batches in the same order for every engine; AdamW lr 1e-3, betas (0.9, 0.999), eps "
        "1e-8, weight decay 0.01, FP32 master weights and moments, BF16 compute, no loss "
        "scaling (fusedamp.GradScaler disabled) and no clipping. All engines start from the same "
        "BF16-rounded weights.", "",
        "Engines: **sharded** = fusedamp.convert_module(model, bf16) + "
        "fusedamp.distributed.ShardedOptimizer(\"adamw\", master_weights=True), no DDP (FP32 "
        "norm layers, as convert_module leaves them); **sharded-bf16** = the same on the model "
        "that fsdp2 and ddp+zero-bv train, norm layers BF16 as well: forward and backward are "
        "the same work as theirs (FSDP2's policy runs the norm layers in BF16 too), so it "
        "is the like-for-like reference for them; "
        "**fsdp2** = fully_shard on every block and the root (reshard_after_forward=False, "
        "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)) + fusedamp.optim.AdamW on "
        "the FP32 shards; **ddp+zero** = DDP on the converted model (the model of sharded) + "
        "fusedamp.distributed.ZeroRedundancyOptimizer (torch's ZeroRedundancyOptimizer with "
        "optimizer_class=fusedamp.optim.AdamW, master_weights=True, "
        "parameters_as_bucket_view=False: each parameter broadcast by its owner; fusedamp's "
        "subclass all-reduces the local step's [found_inf, sum_sq] so that clipping and skips "
        "are global, one small all_reduce a step), DDP's gradients averaged by torch's "
        "allreduce_hook (the same all-reduce as DDP's built-in one, made through "
        "dist.all_reduce so it can be counted); **ddp+zero-bv** = the same with "
        "parameters_as_bucket_view=True (each rank's parameters are views of one bucket, "
        "broadcast in one call), which takes one dtype: on the all-BF16 model of "
        "sharded-bf16.", "",
        f"Step time: forward + backward + optimizer step between a barrier before and one after "
        f"(the slowest rank's time), {args['warmup']} untimed warm-up steps per engine, then "
        f"{args['steps']} timed steps per engine in {args['rounds']} interleaved rounds (rotating "
        "order)" + (f", in each of {args['repeats']} launches per world size"
                    if args["repeats"] > 1 else "")
        + "; the median over steps, with the 25th–75th percentile. Ratios: the engine's median "
        "/ the sharded row's and / the sharded-bf16 row's at the same world size (> 1: slower "
        "than ShardedOptimizer). Fwd+bwd: the median of the forward and backward alone (the "
        "slowest rank), which includes FSDP2's all-gather and reduce-scatter and DDP's "
        "all-reduce.", "",
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
        "State bytes per rank: `fusedamp.distributed.optimizer_state_bytes(opt)` for the sharded "
        "rows (masters, moments, step counts of the shard); the tensors in the "
        "ZeroRedundancyOptimizer's local optimizer (`opt.optim.state`: master_param, moments, "
        "step) for ddp+zero; the local shards of the state DTensors (moments, step) for fsdp2, "
        "whose FP32 masters are the sharded parameters themselves: the column \"+ masters\" "
        "adds them, so it compares like with like.", "",
        "| engine | ranks | step ms (median) | p25–p75 ms | fwd+bwd ms | ratio vs sharded "
        "| ratio vs sharded-bf16 | payload per rank per step | wire per rank per step | "
        "collective calls per step | "
        "state per rank | state + masters per rank |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|",
    ]
    for res in results:
        for name in ENGINES:
            r = res["rows"].get(name)
            if r is None:
                if name in res["errors"]:
                    lines.append(f"| {name} | {res['world']} | failed: {res['errors'][name]} "
                                 "| | | | | | | | | |")
                continue
            calls = ", ".join(f"{k} {v:g}" for k, v in sorted(r["calls_per_step"].items()))
            ratios = " | ".join("—" if r[k] is None else f"{r[k]:.2f}"
                                for k in ("ratio_vs_sharded", "ratio_vs_sharded_bf16"))
            lines.append(
                f"| {name} | {res['world']} | {r['step_ms_median']:.1f} | "
                f"{r['step_ms_p25']:.0f}–{r['step_ms_p75']:.0f} | {r['fwd_bwd_ms_median']:.1f} | "
                f"{ratios} | {_range(r['payload_bytes_per_rank'])} | "
                f"{_range(r['wire_bytes_per_rank'])} | {calls} | "
                f"{_range(r['state_bytes_per_rank'])} | "
                f"{_range(r['state_and_master_bytes_per_rank'])} |")
    lines += ["", "A range (a–b) means the ranks differ: ZeroRedundancyOptimizer assigns whole "
              "parameters to ranks, so its shards are uneven.", ""]
    if args["repeats"] > 1:
        lines += [f"Each world size was launched {args['repeats']} times; the table pools their "
                  "timed steps. Each launch on its own (median ms; ratio vs sharded / vs "
                  "sharded-bf16), a measure of how far this VM moves between launches:", "",
                  "| engine | ranks | " + " | ".join(f"launch {i + 1}"
                                                     for i in range(args["repeats"])) + " |",
                  "|---|--:|" + "---|" * args["repeats"]]
        for res in results:
            for name in ENGINES:
                if name not in res["rows"]:
                    continue
                cells = []
                for rows in res["per_launch"]:
                    r = rows.get(name)
                    if r is None:
                        cells.append("—")
                        continue
                    ratios = ["—" if r[k] is None else f"{r[k]:.2f}"
                              for k in ("ratio_vs_sharded", "ratio_vs_sharded_bf16")]
                    cells.append(" / ".join([f"{r['step_ms_median']:.1f} ms"] + ratios))
                lines.append(f"| {name} | {res['world']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Plausibility of the byte counts", "",
              "Against the model's weight bytes W (BF16 weights + FP32 norm layers, "
              "as the converted model holds them) and its parameter count P. Expected payload per "
              "step: sharded and sharded-bf16 2·W (reduce-scatter of the BF16/FP32 gradients + "
              "all-gather of the weights, each padded to a multiple of N) plus an 8-byte "
              "all-reduce of [found_inf, sum_sq]; fsdp2 2·P (BF16 all-gather, every parameter "
              "cast by the policy) + 4·P (FP32 reduce-scatter; fsdp2-bf16r 2·P, BF16) plus "
              "fusedamp's 16-byte all-reduce, each padded per shard; ddp+zero W (all-reduce of "
              "the gradients, as DDP's buckets say) + W (each parameter, or each rank's bucket, "
              "broadcast by its owner) plus fusedamp's 16-byte all-reduce.", "",
              "| engine | ranks | payload / W | expected | DDP bucket bytes |",
              "|---|--:|--:|---|--:|"]
    for res in results:
        w_bytes = res["model_bytes"]
        if not w_bytes:
            continue
        params = next(iter(res["rows"].values()))["params"]
        expect = {"sharded": "≈ 2.00", "sharded-bf16": "≈ 2.00", "ddp+zero": "≈ 2.00",
                  "ddp+zero-bv": "≈ 2.00", "fsdp2": f"≈ {6 * params / w_bytes:.2f} (6·P / W)",
                  "fsdp2-bf16r": f"≈ {4 * params / w_bytes:.2f} (4·P / W)"}
        for name in ENGINES:
            r = res["rows"].get(name)
            if r is None:
                continue
            buckets = r.get("ddp_bucket_sizes")
            lines.append(f"| {name} | {res['world']} | "
                         f"{max(r['payload_bytes_per_rank']) / w_bytes:.3f} | {expect[name]} | "
                         f"{buckets if buckets else '—'} |")
    lines += ["", "## Do the engines train the same model?", "",
              "Training loss averaged over the ranks at the first and the last step (the same "
              "global batches for every engine), the loss of the final weights on one held-out "
              "batch, and the relative L2 distance of the final weights from the reference's (the "
              "first engine run: sharded unless left out). Agreement: every loss within "
              f"{100 * LOSS_TOLERANCE:.0f} % of the reference's.",
              "", "| engine | ranks | first loss | last loss | held-out loss | "
              "weights vs reference (rel. L2) | agrees |", "|---|--:|--:|--:|--:|--:|---|"]
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
            lines.append(f"| {name} | {res['world']} | {r['loss_first']:.4f} | "
                         f"{r['loss_last']:.4f} | {r['val_loss']:.4f} | "
                         f"{r['weights_rel_diff_vs_reference']:.2e} | "
                         f"{'yes' if ok else '**no**'} |")
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
        "(tests/python/test_zero.py shows both); fusedamp.distributed.ZeroRedundancyOptimizer, "
        "ShardedOptimizer and fusedamp's FSDP2 path all-reduce [found_inf, sum_sq] so that "
        "every rank clips by the global norm and skips alike (the one all_reduce a step in "
        "their rows, beside DDP's gradient all-reduce for ddp+zero)."]
    text = "\n".join(lines) + "\n"
    with open(path_base + ".md", "w") as f:
        f.write(text)
    with open(path_base + ".json", "w") as f:
        json.dump({"machine": machine, "args": args, "wall_s": wall_s,
                   "results": results}, f, indent=1)
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
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
    ap.add_argument("--out", default=os.path.join(HERE, "results", "distributed_cpu"),
                    help="path of the results without .md/.json")
    a = ap.parse_args()
    worlds = [int(w) for w in a.ranks.split(",")]
    for w in worlds:
        if a.batch % w:
            ap.error(f"--batch {a.batch} does not split evenly over {w} ranks")
    args = dict(vars(a), engines=[e for e in a.engines.split(",") if e],
                argv=" ".join(sys.argv[1:]))
    unknown = set(args["engines"]) - set(ENGINES)
    if unknown:
        ap.error(f"unknown engines {sorted(unknown)}; choose from {ENGINES}")
    # Gloo picks an interface by the host name; loopback is what the ranks share here.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    machine = machine_info()
    t0 = time.perf_counter()
    results = []
    for w in worlds:
        launches = []
        for i in range(a.repeats):
            print(f"{w} ranks, launch {i + 1} of {a.repeats} ...", flush=True)
            launches.append(launch(w, args))
        res = summarise(w, pooled(launches))
        res["per_launch"] = [summarise(w, ranks)["rows"] for ranks in launches]
        for name, r in res["rows"].items():
            print(f"  {name:12s} {r['step_ms_median']:8.1f} ms  x{r['ratio_vs_sharded'] or 0:.2f}  "
                  f"{_mb(max(r['payload_bytes_per_rank']))}/step  loss {r['loss_last']:.4f}",
                  flush=True)
        for name, err in res["errors"].items():
            print(f"  {name:12s} FAILED: {err}", flush=True)
        results.append(res)
    machine["load_average_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    print(write_report(results, machine, args, a.out, time.perf_counter() - t0))


if __name__ == "__main__":
    main()
