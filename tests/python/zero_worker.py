"""One rank of the ZeRO stage-1 tests (launched by test_zero.py): fusedamp's optimizers under
torch's ZeroRedundancyOptimizer and fusedamp.distributed.ZeroRedundancyOptimizer. Not a test
module itself.

    python zero_worker.py RANK WORLD INIT_FILE BACKEND OUT_DIR [CHECKPOINT_DIR]

Most scenarios step on the gradients of the whole global batch, computed alike on every rank
(one thread, the same batch), so that only the step can differ from one process. Results go to
OUT_DIR/rank{RANK}.pt; rank 0 also writes the consolidated checkpoint to OUT_DIR/checkpoint.pt,
which a launch given CHECKPOINT_DIR (another world size's OUT_DIR) resumes.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import fusedamp  # noqa: E402
import rank_process  # noqa: E402
from distributed_worker import (MODE_ADAM, MODES, STEPS, global_batch, local_rows,  # noqa: E402
                                make_model, mode_name, train_full_batch)

RESUME_STEPS = 2
CLIP = 0.05  # small enough that every step clips
CLIPPED_SGD = dict(lr=0.5, momentum=0.9, weight_decay=0.01, max_grad_norm=CLIP)
NAN_STEP = 2  # a NaN in one gradient element, in whichever rank's partition holds it
SCALER = dict(init_scale=2.0 ** 12, growth_interval=2)
INF_STEP = 3  # the last rank's loss is inf (DDP then spreads it to every gradient)


def zero(model, cls=fusedamp.distributed.ZeroRedundancyOptimizer,
         optimizer_class=fusedamp.optim.AdamW, **kw):
    return cls(model.parameters(), optimizer_class=optimizer_class, **kw)


def whole_batch_grads(model, step):
    x, y = global_batch(step, "cpu")
    model.zero_grad()
    loss_of(model, x, y).backward()


def loss_of(model, x, y):
    # as distributed_worker.train_full_batch; a model of one dtype takes its inputs in it
    return F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


def one_dtype_model():
    """The test model in BF16 throughout (its LayerNorm too): torch's ZeroRedundancyOptimizer
    takes parameters of one dtype only."""
    return make_model("cpu", torch.float32).to(torch.bfloat16)


def clipped_run(cls, nan_step=None):
    """SGD (its update is proportional to the gradient: clipping shows) with FP32 masters over
    a BF16 model, every step clipped; a NaN gradient at nan_step."""
    model = one_dtype_model()
    opt = zero(model, cls, fusedamp.optim.SGD, **CLIPPED_SGD)
    params = []
    for step in range(STEPS):
        whole_batch_grads(model, step)
        if step == nan_step:
            model[0].weight.grad[1, 2] = float("nan")
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    return params


# ZeRO-1 gives each parameter whole to one rank, so 8-bit moments (blocks in each parameter's
# own elements) are as in one process too; and the 24-bit masters of "split8" beside them.
ZERO_MODES = MODES + [(True, torch.int8), ("split", torch.int8), ("split8", torch.int8)]


# SGD with an 8-bit momentum buffer beside 24-bit masters: the same blocks as one process too.
SGD_INT8 = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, master_weights="split8",
                state_dtype=torch.int8)


def sgd_int8_run(rank):
    model = make_model("cpu", torch.bfloat16)
    opt = zero(model, optimizer_class=fusedamp.optim.SGD, **SGD_INT8)
    res = {"params": train_full_batch(model, opt, STEPS, "cpu")}
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        res["full"] = opt.state_dict()
    return res


def modes_runs(rank):
    out = {}
    for mode, state_dtype in ZERO_MODES:
        model = make_model("cpu", torch.bfloat16)
        opt = zero(model, master_weights=mode, state_dtype=state_dtype, **MODE_ADAM)
        res = {"params": train_full_batch(model, opt, STEPS, "cpu"),
               "state_bytes": fusedamp.distributed.optimizer_state_bytes(opt),
               "export": fusedamp.master_weights(model, opt)}  # a collective
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            res["full"] = opt.state_dict()
        out[mode_name(mode, state_dtype)] = res
    return out


def grad_facts(model):
    """What the scaler's record must say of these (scaled) gradients, computed here apart from
    it: the largest finite magnitude and the fractions of zero-or-subnormal and of subnormal
    elements."""
    amax, small, zero, n = 0.0, 0, 0, 0
    for p in model.parameters():
        g = p.grad.double()
        finite = torch.isfinite(g)
        amax = max(amax, g.abs().where(finite, 0.0).max().item())
        small += int((g.abs() < torch.finfo(p.grad.dtype).tiny).sum())
        zero += int((g == 0).sum())
        n += g.numel()
    return {"amax": amax, "underflow_fraction": small / n, "subnormal_fraction": (small - zero) / n}


def ddp_scaler_run(rank, world):
    """FP16 DDP + fusedamp's scaler: scales, skips and the scaler's record on every rank."""
    model = make_model("cpu", torch.float16)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = zero(model, **MODE_ADAM)
    scaler = fusedamp.GradScaler("cpu", **SCALER)
    applied, scales, measured = [], [], []
    for step in range(STEPS):
        x, y = global_batch(step, "cpu")
        loss = loss_of(ddp, local_rows(x, rank, world), local_rows(y, rank, world))
        if step == INF_STEP and rank == world - 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        measured.append(grad_facts(model))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        applied.append(float(opt.last_step_applied))
        scales.append(scaler.get_scale())
    return {"applied": applied, "scales": scales, "skipped_steps": int(opt.skipped_steps),
            "telemetry": scaler.telemetry(model), "measured": measured,
            "params": [p.detach().clone() for p in model.parameters()]}


def resume_run(load_path):
    """A checkpoint consolidated on another number of ranks, loaded and continued."""
    model = make_model("cpu", torch.bfloat16)
    checkpoint = torch.load(load_path, weights_only=False)
    model.load_state_dict(checkpoint["model"])
    opt = zero(model, **MODE_ADAM)
    opt.load_state_dict(checkpoint["optimizer"])
    state = opt.optim.state
    loaded = {i: {k: v.clone() for k, v in state[p].items()}
              for i, p in enumerate(model.parameters()) if p in state}
    params = train_full_batch(model, opt, RESUME_STEPS, "cpu", first=STEPS)
    return {"loaded": loaded, "params": params}


def torch_zero_load(rank):
    """torch's ZeroRedundancyOptimizer over fusedamp.optim.AdamW: its load_state_dict writes
    each parameter's entry into the local optimizer's `state`."""
    model = one_dtype_model()
    opt = zero(model, TorchZeRO, **MODE_ADAM)
    for step in range(2):
        whole_batch_grads(model, step)
        opt.step()
    opt.consolidate_state_dict(to=0)
    saved = opt.state_dict() if rank == 0 else None
    objs = [saved]
    torch.distributed.broadcast_object_list(objs, src=0)
    fresh = zero(model, TorchZeRO, **MODE_ADAM)
    fresh.load_state_dict(objs[0])
    return all(torch.equal(a[k], b[k]) for (_, a), (_, b) in
               zip(opt.optim.state.items(), fresh.optim.state.items()) for k in a) and \
        len(fresh.optim.state) == len(opt.optim.state) > 0


def main():
    rank, world = rank_process.join(*sys.argv[1:5])
    out_dir = sys.argv[5]
    load_path = sys.argv[6] if len(sys.argv) > 6 else ""
    out = {"modes": modes_runs(rank),
           "sgd_int8": sgd_int8_run(rank),
           "clipped": clipped_run(fusedamp.distributed.ZeroRedundancyOptimizer),
           "clipped_torch": clipped_run(TorchZeRO),
           "nan": clipped_run(fusedamp.distributed.ZeroRedundancyOptimizer, NAN_STEP),
           "nan_torch": clipped_run(TorchZeRO, NAN_STEP),
           "ddp_scaler": ddp_scaler_run(rank, world),
           "torch_zero_load_keeps_state": torch_zero_load(rank)}
    # The checkpoint other world sizes resume from (FP32 masters after STEPS steps).
    model = make_model("cpu", torch.bfloat16)
    opt = zero(model, **MODE_ADAM)
    train_full_batch(model, opt, STEPS, "cpu")
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   os.path.join(out_dir, "checkpoint.pt"))
    if load_path:  # the folder of another world size's checkpoint
        out["resumed"] = resume_run(os.path.join(load_path, "checkpoint.pt"))
    out["torch_class_error"] = rank_process.error_text(
        lambda: fusedamp.distributed.ZeroRedundancyOptimizer(make_model("cpu").parameters(),
                                                             optimizer_class=torch.optim.AdamW),
        TypeError)
    rank_process.finish(out, out_dir, rank)


if __name__ == "__main__":
    main()
