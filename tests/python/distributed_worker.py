"""One rank of the DDP tests (launched by test_distributed.py), the single-process reference
those ranks are compared with, and the model, data and steps the ZeRO-1 tests share
(zero_worker.py). Not a test module itself.

    python distributed_worker.py RANK WORLD INIT_FILE BACKEND OUT_DIR

Each rank trains, checkpoints and resumes under DDP and saves what it saw to
OUT_DIR/rank{RANK}.pt; the test process compares ranks with each other and with the reference
below.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import fusedamp  # noqa: E402
import rank_process  # noqa: E402

GLOBAL_BATCH = 12  # divisible by 1, 2 and 3
STEPS = 6
INF_STEP = 3  # an inf appears in the last rank's input, in this step
RESUME_STEPS = 2
ADAM = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
MAX_GRAD_NORM = 0.1  # small enough to clip every step
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


def backward(model, scaler, step, device, rank, world):
    x, y = global_batch(step, device)
    if step == INF_STEP:
        x[-1, 0] = float("inf")  # the last row lives on the last rank
    x, y = local_rows(x, rank, world), local_rows(y, rank, world)
    loss = F.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()


def snapshot(model):
    return [p.detach().clone().cpu() for p in model.parameters()]


def train(model, opt, scaler, steps, device, rank, world, first=0):
    """Runs `steps` steps; returns per-step (scale, applied) and the params after each step."""
    scales, applied, params = [], [], []
    for step in range(first, first + steps):
        backward(model, scaler, step, device, rank, world)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        applied.append(float(opt.last_step_applied.item()))
        params.append(snapshot(model))
    return {"scales": scales, "applied": applied, "params": params}


# ---------------------------------------------------------------------- the single-process reference
def reference_run(device, steps=STEPS):
    """The same global batch in one process: AdamW through fusedamp.initialize (FP16), with
    the inf in the input, as in the DDP run."""
    model = make_model(device, torch.float32)
    model, opt, scaler = fusedamp.initialize(
        model, torch.optim.AdamW(model.parameters(), **ADAM), torch.float16,
        max_grad_norm=MAX_GRAD_NORM, **SCALER)
    return train(model, opt, scaler, steps, device, 0, 1)


# Master-weight modes under ZeRO-1 (zero_worker.py, BF16 model): every rank computes the
# gradient of the whole global batch, so the gradients equal the single process's bit for bit
# and any difference would be the partitioned step's own.
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
    res = train(ddp, opt, scaler, STEPS, device, rank, world)
    path = os.path.join(out_dir, "ddp_ckpt.pt")
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                    "scaler": scaler.state_dict()}, path)
    torch.distributed.barrier()
    cont = train(ddp, opt, scaler, RESUME_STEPS, device, rank, world, first=STEPS)
    # Every rank loads the checkpoint into a fresh model and continues.
    model2, opt2, scaler2 = build()
    ck = torch.load(path, map_location=device)
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["optim"])
    scaler2.load_state_dict(ck["scaler"])
    ddp2 = DDP(model2, device_ids=ids)
    resumed = train(ddp2, opt2, scaler2, RESUME_STEPS, device, rank, world, first=STEPS)
    return {"run": res, "cont": cont, "resumed": resumed}


def main(argv):
    rank, world, init_file, backend, out_dir = (int(argv[1]), int(argv[2]), argv[3], argv[4],
                                                argv[5])
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    else:
        device = "cpu"
    rank_process.join(rank, world, init_file, backend, one_thread=False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    rank_process.finish({"ddp": run_ddp(device, rank, world, out_dir)}, out_dir, rank)


if __name__ == "__main__":
    main(sys.argv)
