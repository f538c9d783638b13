"""One rank of the distributed tests (launched by test_distributed.py), and the single-process
references those ranks are compared with. Not a test module itself.

    python distributed_worker.py RANK WORLD INIT_FILE BACKEND OUT_DIR [LOAD_CHECKPOINT]

Each rank runs every scenario (DDP, sharded AdamW, sharded SGD, checkpoints, memory) and saves
what it saw to OUT_DIR/rank{RANK}.pt; the test process compares ranks with each other and with
the references below.
"""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import fusedamp  # noqa: E402
from fusedamp.distributed import ShardedOptimizer, optimizer_state_bytes  # noqa: E402

GLOBAL_BATCH = 12  # divisible by 1, 2 and 3
STEPS = 6
INF_STEP = 3  # an inf appears on the last rank only, in this step
RESUME_STEPS = 2
ADAM = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
MAX_GRAD_NORM = 0.1  # small enough to clip every step: exercises the global norm
SCALER = dict(init_scale=2.0 ** 10, growth_interval=2)


def make_model(device, dtype=torch.float16, seed=0):
    """A small MLP; FP16/BF16 with an FP32 LayerNorm (fusedamp.convert_module), or FP32."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 24),
                      nn.GELU(), nn.Linear(24, 8)).to(device)
    if dtype != torch.float32:
        fusedamp.convert_module(m, dtype)
    return m


def global_batch(step, device):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    y = torch.randn(GLOBAL_BATCH, 8, generator=g)
    return x.to(device), y.to(device)


def local_rows(t, rank, world):
    n = GLOBAL_BATCH // world
    return t[rank * n:(rank + 1) * n]


def make_scaler(device, dtype):
    return fusedamp.GradScaler(torch.device(device).type, enabled=dtype == torch.float16,
                               **SCALER)


def backward(model, scaler, step, device, rank, world, inject_input=False):
    x, y = global_batch(step, device)
    if inject_input and step == INF_STEP:
        x[-1, 0] = float("inf")  # the last row lives on the last rank
    x, y = local_rows(x, rank, world), local_rows(y, rank, world)
    loss = F.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()


def inject_grad(model, step, rank, world):
    """An inf in the grad of the first parameter (the first element of the first flat bucket,
    owned by rank 0) on the last rank only."""
    if step == INF_STEP and rank == world - 1:
        next(model.parameters()).grad.view(-1)[0] = float("inf")


def snapshot(model):
    return [p.detach().clone().cpu() for p in model.parameters()]


def sgd_groups(model):
    ps = list(model.parameters())
    return [{"params": ps[:3], "lr": 0.05}, {"params": ps[3:], "lr": 0.02}]


def make_sharded(model, kind, group=None):
    if kind == "sgd":
        return ShardedOptimizer(sgd_groups(model), "sgd", process_group=group, momentum=0.9,
                                weight_decay=1e-3, max_grad_norm=MAX_GRAD_NORM)
    return ShardedOptimizer(model.parameters(), "adamw", process_group=group,
                            max_grad_norm=MAX_GRAD_NORM, **ADAM)


def make_reference(model, kind):
    if kind == "sgd":
        return fusedamp.optim.SGD(sgd_groups(model), momentum=0.9, weight_decay=1e-3,
                                  max_grad_norm=MAX_GRAD_NORM)
    return fusedamp.optim.AdamW(model.parameters(), max_grad_norm=MAX_GRAD_NORM, **ADAM)


def train(model, opt, scaler, sched, steps, device, rank, world, first=0, ddp=False):
    """Runs `steps` steps; returns per-step (scale, applied) and the params after each step."""
    scales, applied, params = [], [], []
    for step in range(first, first + steps):
        backward(model, scaler, step, device, rank, world, inject_input=ddp)
        if not ddp:
            inject_grad(model, step, rank, world)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        scales.append(scaler.get_scale())
        applied.append(float(opt.last_step_applied.item()))
        params.append(snapshot(model))
    return {"scales": scales, "applied": applied, "params": params}


def make_sched(opt, kind):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if kind == "sgd" else None


# --------------------------------------------------------------------- single-process references
def reference_run(kind, device, dtype=torch.float16, steps=STEPS, checkpoint=None):
    """The same global batch in one process with fusedamp.optim (kind 'ddp' is AdamW through
    fusedamp.initialize with the inf in the input, as in the DDP run)."""
    if kind == "ddp":
        model = make_model(device, torch.float32)
        model, opt, scaler = fusedamp.initialize(
            model, torch.optim.AdamW(model.parameters(), **ADAM), dtype,
            max_grad_norm=MAX_GRAD_NORM, **SCALER)
        return train(model, opt, scaler, None, steps, device, 0, 1, ddp=True)
    model = make_model(device, dtype)
    opt = make_reference(model, kind)
    scaler = make_scaler(device, dtype)
    first = 0
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optim"])
        scaler.load_state_dict(checkpoint["scaler"])
        first = checkpoint["next_step"]
    out = train(model, opt, scaler, make_sched(opt, kind), steps, device, 0, 1, first=first)
    out["state"] = opt.state_dict()
    out["state_bytes"] = optimizer_state_bytes(opt)
    return out


# Master-weight modes under ZeRO-1 (BF16 model): every rank computes the gradient of the whole
# global batch and the optimizer is told so (grads_averaged=True), so the gradients equal the
# single process's bit for bit and any difference would be the sharded step's own. No
# clipping: the global norm's sum order differs with the layout.
MODES = [(True, torch.bfloat16), ("split", torch.float32), ("split", torch.bfloat16),
         ("kahan", torch.float32), ("kahan", torch.bfloat16), ("stochastic", torch.float32),
         (False, torch.bfloat16)]
MODE_ADAM = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, rounding_seed=7)


def mode_name(mode, state_dtype):
    return f"{mode}-{str(state_dtype).split('.')[-1]}"


def train_full_batch(model, opt, steps, device, first=0):
    """Steps on the whole global batch (the same on every rank); the params after each step."""
    params = []
    for step in range(first, first + steps):
        x, y = global_batch(step, device)
        F.mse_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
        params.append(snapshot(model))
    return params


def reference_modes_run(mode, state_dtype, device, steps=STEPS):
    """fusedamp.optim on one thread, as the ranks run (a CPU backward's reductions split
    differently on more threads: the gradients would differ in their last bits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model(device, torch.bfloat16)
        opt = fusedamp.optim.AdamW(model.parameters(), master_weights=mode,
                                   state_dtype=state_dtype, **MODE_ADAM)
        params = train_full_batch(model, opt, steps, device)
    finally:
        torch.set_num_threads(threads)
    return {"params": params, "state": opt.state_dict(), "state_bytes": optimizer_state_bytes(opt)}


def make_sharded_mode(model, mode, state_dtype):
    return ShardedOptimizer(model.parameters(), "adamw", master_weights=mode,
                            state_dtype=state_dtype, grads_averaged=True, **MODE_ADAM)


def run_modes(device, rank, world, out_dir, load_path):
    out = {}
    for mode, state_dtype in MODES:
        model = make_model(device, torch.bfloat16)
        opt = make_sharded_mode(model, mode, state_dtype)
        res = {"params": train_full_batch(model, opt, STEPS, device),
               "state_bytes": opt.state_bytes(), "full": opt.consolidated_state_dict(to=None)}
        if mode == "stochastic":  # this rank's shard, resumed by a fresh optimizer
            model_sd = {k: v.clone() for k, v in model.state_dict().items()}
            shard = opt.state_dict()
            res["cont"] = train_full_batch(model, opt, RESUME_STEPS, device, first=STEPS)
            model2 = make_model(device, torch.bfloat16, seed=1)
            opt2 = make_sharded_mode(model2, mode, state_dtype)
            model2.load_state_dict(model_sd)
            opt2.load_state_dict(shard)
            res["resumed"] = train_full_batch(model2, opt2, RESUME_STEPS, device, first=STEPS)
        out[mode_name(mode, state_dtype)] = res
    # A checkpoint converted between modes: FP32 masters -> split -> FP32 masters.
    model = make_model(device, torch.bfloat16)
    opt = make_sharded_mode(model, True, torch.float32)
    train_full_batch(model, opt, STEPS, device)
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "optim": opt.consolidated_state_dict(to=None)}
    hops = {"start": saved}
    for hop, mode in (("split", "split"), ("back", True)):
        model = make_model(device, torch.bfloat16, seed=1)
        opt = make_sharded_mode(model, mode, torch.float32)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                 "optim": opt.consolidated_state_dict(to=None)}
        hops[hop] = dict(saved, export=fusedamp.master_weights(model, opt))
    out["convert"] = hops
    # A split checkpoint gathered on 2 ranks, continued here and (load_path) on 3 ranks.
    model = make_model(device, torch.bfloat16)
    opt = make_sharded_mode(model, "split", torch.bfloat16)
    train_full_batch(model, opt, STEPS, device)
    ck = {"model": {k: v.clone() for k, v in model.state_dict().items()},
          "optim": opt.consolidated_state_dict(to=0)}
    if rank == 0:
        torch.save(ck, os.path.join(out_dir, f"ckpt_split_{world}.pt"))
    out["split_cont"] = train_full_batch(model, opt, RESUME_STEPS, device, first=STEPS)
    if load_path:
        ck = torch.load(os.path.join(os.path.dirname(load_path), "ckpt_split_2.pt"),
                        map_location=device)
        model = make_model(device, torch.bfloat16, seed=2)
        opt = make_sharded_mode(model, "split", torch.bfloat16)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optim"])
        out["split_reloaded"] = opt.consolidated_state_dict(to=None)
        out["split_other_n"] = train_full_batch(model, opt, RESUME_STEPS, device, first=STEPS)
    return out


# --------------------------------------------------------------------- the distributed scenarios
def run_ddp(device, rank, world, out_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    def build():
        model = make_model(device, torch.float32)
        model, opt, scaler = fusedamp.initialize(
            model, torch.optim.AdamW(model.parameters(), **ADAM), torch.float16,
            max_grad_norm=MAX_GRAD_NORM, **SCALER)
        return model, opt, scaler

    model, opt, scaler = build()
    ids = [torch.device(device).index] if torch.device(device).type == "cuda" else None
    ddp = DDP(model, device_ids=ids)
    res = train(ddp, opt, scaler, None, STEPS, device, rank, world, ddp=True)
    path = os.path.join(out_dir, "ddp_ckpt.pt")
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                    "scaler": scaler.state_dict()}, path)
    torch.distributed.barrier()
    cont = train(ddp, opt, scaler, None, RESUME_STEPS, device, rank, world, first=STEPS,
                 ddp=True)
    # Every rank loads the checkpoint into a fresh model and continues.
    model2, opt2, scaler2 = build()
    ck = torch.load(path, map_location=device)
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["optim"])
    scaler2.load_state_dict(ck["scaler"])
    ddp2 = DDP(model2, device_ids=ids)
    resumed = train(ddp2, opt2, scaler2, None, RESUME_STEPS, device, rank, world, first=STEPS,
                    ddp=True)
    return {"run": res, "cont": cont, "resumed": resumed}


def run_sharded(kind, device, rank, world, out_dir, load_path, dtype=torch.float16):
    model = make_model(device, dtype)
    opt = make_sharded(model, kind)
    scaler = make_scaler(device, dtype)
    sched = make_sched(opt, kind)
    res = train(model, opt, scaler, sched, STEPS, device, rank, world)
    res["state_bytes"] = opt.state_bytes()
    res["full"] = opt.consolidated_state_dict(to=None)
    res["skipped_steps"] = int(opt.skipped_steps.item())
    # The FP32 export (a collective: every rank calls it) and the model it came from.
    res["export"] = fusedamp.master_weights(model, opt)
    res["named_params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    if kind != "adamw" or dtype != torch.float16:
        return res
    # Checkpoints: this rank's shard, and the gathered state (saved by rank 0).
    shard = opt.state_dict()
    model_sd = {k: v.clone() for k, v in model.state_dict().items()}
    scaler_sd = scaler.state_dict()
    full = opt.consolidated_state_dict(to=0)
    if rank == 0:
        torch.save({"model": model_sd, "optim": full, "scaler": scaler_sd, "next_step": STEPS},
                   os.path.join(out_dir, f"ckpt_{world}.pt"))
    res["cont"] = train(model, opt, scaler, sched, RESUME_STEPS, device, rank, world, first=STEPS)
    res["cont_full"] = opt.consolidated_state_dict(to=None)
    model2 = make_model(device, seed=1)  # other initial weights: the load must set them
    opt2 = make_sharded(model2, kind)
    scaler2 = make_scaler(device, torch.float16)
    model2.load_state_dict(model_sd)
    opt2.load_state_dict(shard)
    scaler2.load_state_dict(scaler_sd)
    res["resumed"] = train(model2, opt2, scaler2, None, RESUME_STEPS, device, rank, world,
                           first=STEPS)
    res["resumed_full"] = opt2.consolidated_state_dict(to=None)
    if load_path:  # a gathered checkpoint written by another number of ranks
        ck = torch.load(load_path, map_location=device)
        model3 = make_model(device, seed=2)
        opt3 = make_sharded(model3, kind)
        scaler3 = make_scaler(device, torch.float16)
        model3.load_state_dict(ck["model"])
        opt3.load_state_dict(ck["optim"])
        scaler3.load_state_dict(ck["scaler"])
        res["reloaded_full"] = opt3.consolidated_state_dict(to=None)
        res["other_n"] = train(model3, opt3, scaler3, None, RESUME_STEPS, device, rank, world,
                               first=ck["next_step"])
        res["other_n_full"] = opt3.consolidated_state_dict(to=None)
    return res


def run_memory(device, rank, world):
    """State bytes of the same model sharded over 1 rank (a one-rank subgroup) and over all."""
    import torch.distributed as dist

    solo = [dist.new_group([r]) for r in range(world)][rank]
    one = make_sharded(make_model(device), "adamw", group=solo)
    full = make_sharded(make_model(device), "adamw")
    return {"one_rank": one.state_bytes(), "all_ranks": full.state_bytes(),
            "one_rank_world": one.world_size}


def main(argv):
    import torch.distributed as dist

    rank, world, init_file, backend, out_dir = (int(argv[1]), int(argv[2]), argv[3], argv[4],
                                                argv[5])
    load_path = argv[6] if len(argv) > 6 else ""
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    else:
        device = "cpu"
    dist.init_process_group(backend, init_method="file://" + init_file, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.use_deterministic_algorithms(True, warn_only=True)
    result = {
        "ddp": run_ddp(device, rank, world, out_dir),
        "adamw": run_sharded("adamw", device, rank, world, out_dir, load_path),
        "sgd": run_sharded("sgd", device, rank, world, out_dir, ""),
        "adamw_fp32": run_sharded("adamw", device, rank, world, out_dir, "", torch.float32),
        "memory": run_memory(device, rank, world),
        "modes": run_modes(device, rank, world, out_dir, load_path),
    }
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv)
