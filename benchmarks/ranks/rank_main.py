"""One rank of bench_distributed.py: every engine built in the same process, trained on the same
global batches in interleaved rounds, its steps timed between barriers and its collectives
counted; then the held-out loss, the state and the weights, written for the launcher."""
from __future__ import annotations

import datetime
import json
import math
import os
import tempfile
import time

from ranks.collectives import CollectiveCounter
from ranks.engines import build, converted_model, full_weights, state_bytes


def rank_main(rank, world, init_file, args, out_dir):
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
            engines[name] = build(name, vocab, args, mesh)
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
        state, state_and_masters = state_bytes(name, opt, model)
        weights = full_weights(model)
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
    # The yardstick of the byte counts: the converted model's weights, whichever engines ran.
    model = converted_model(vocab, args)
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
        mp.start_processes(rank_main, args=(world, init_file, args, tmp), nprocs=world,
                           join=True, start_method="spawn")
        ranks = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    return ranks
