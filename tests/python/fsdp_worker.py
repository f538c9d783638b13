"""One rank of the FSDP2 tests (launched by test_fsdp.py), and the single-process references
those ranks are compared with. Not a test module itself.

    python fsdp_worker.py RANK WORLD INIT_FILE BACKEND OUT_DIR

The model is sharded with torch.distributed.fsdp.fully_shard (each Linear, then the root) on a
1-D mesh; its parameters are DTensors and fusedamp's optimizers step their local shards. Each
scenario's per-step full parameters (gathered), skip flags and loss scales are saved to
OUT_DIR/rank{RANK}.pt. The first Linear has 33 output rows, so its shards are uneven.
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import fusedamp  # noqa: E402
import rank_process  # noqa: E402

GLOBAL_BATCH = 8
STEPS = 6
INF_STEP = 2  # an inf appears in one gradient element that only the last rank holds
UNSCALE_STEP = 4  # scaler.unscale_(opt) before the step (the local-shard unscale path)
RESUME_AT = 3  # checkpoint after this many steps, then continue to STEPS
ADAM = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, max_grad_norm=0.5)
SGD = dict(lr=0.05, momentum=0.9, weight_decay=0.01, max_grad_norm=0.5)
SCALER = dict(init_scale=2.0 ** 18, growth_interval=2)  # overflows FP16 at first: backs off

# scenario: (optimizer, FSDP2 param_dtype (None: FP32, no policy), loss scaler (False, True,
# or "amax": its amax policy), inf step)
SCENARIOS = {
    "fp32_adamw": ("adamw", None, False, INF_STEP),
    "fp32_sgd": ("sgd", None, False, INF_STEP),
    "bf16_adamw": ("adamw", torch.bfloat16, False, None),
    "fp16_adamw_scaler": ("adamw", torch.float16, True, INF_STEP),
    "fp16_adamw_amax": ("adamw", torch.float16, "amax", INF_STEP),
}


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 33), nn.LayerNorm(33), nn.GELU(), nn.Linear(33, 8))


def make_optimizer(kind, params):
    if kind == "adamw":
        return fusedamp.optim.AdamW(params, **ADAM)
    return fusedamp.optim.SGD(params, **SGD)


def make_scaler(on):
    policy = "amax" if on == "amax" else "torch"
    return fusedamp.GradScaler("cpu", enabled=bool(on), policy=policy, **SCALER)


def global_batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 8, generator=g)
    x[:, -1] = 0  # a dead input: the last column of model[0].weight gets zero gradients (on
    return x, y   # every rank's rows), which the telemetry's underflow counts must add up


def loss_of(out, y):
    return F.mse_loss(out.float(), y)


def inf_row(world):
    """The first row of the last rank's shard of model[0].weight (torch.chunk's split)."""
    return (world - 1) * -(-33 // world)


# ---------------------------------------------------------------------------- ranks
def shard(model, mesh, param_dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {}
    if param_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def full_params(model):
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def train_steps(model, opt, scaler, steps, first, rank, world, inf_step, record):
    n = GLOBAL_BATCH // world
    for step in range(first, first + steps):
        x, y = global_batch(step)
        loss = loss_of(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n])
        scaler.scale(loss).backward()
        if step == inf_step and rank == world - 1:
            model[0].weight.grad.to_local()[0, 0] = float("inf")
        if step == UNSCALE_STEP and scaler.is_enabled():
            scaler.unscale_(opt)
        with count_collectives() as calls:
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        record["collectives"].append(list(calls))
        record["params"].append(full_params(model))
        record["applied"].append(float(opt.last_step_applied))
        record["scales"].append(scaler.get_scale())
        record["norms"].append(step_norm(opt))


def step_norm(opt):
    """The global norm of the unscaled gradients of the step just made, as the engine keeps it
    (the clipping norm; the scaler's telemetry records its own from the scaled gradients)."""
    norm = opt._engine.grad_norm()
    return float("nan") if norm is None else norm.item()


def new_record():
    return {"params": [], "applied": [], "scales": [], "norms": [], "collectives": []}


@contextlib.contextmanager
def count_collectives():
    """The names of the torch.distributed collectives called inside the block."""
    import torch.distributed as dist

    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
             "broadcast", "reduce", "all_to_all_single", "barrier")
    saved = {n: getattr(dist, n) for n in names}
    calls = []

    def counting(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return call

    for n, fn in saved.items():
        setattr(dist, n, counting(n, fn))
    try:
        yield calls
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def run_scenario(name, mesh, rank, world):
    kind, param_dtype, scaled, inf_step = SCENARIOS[name]
    model = shard(make_model(), mesh, param_dtype)
    opt = make_optimizer(kind, model.parameters())
    scaler = make_scaler(scaled)
    rec = new_record()
    train_steps(model, opt, scaler, STEPS, 0, rank, world, inf_step, rec)
    rec["skipped_steps"] = int(opt.skipped_steps)
    rec["telemetry"] = scaler.telemetry(model) if scaled else None
    p = model[0].weight
    rec["local_dtypes"] = sorted({str(q.to_local().dtype) for q in model.parameters()})
    rec["state_keys"] = sorted(opt.state[p])
    rec["state_is_dtensor"] = {k: type(v).__name__ for k, v in opt.state[p].items()}
    rec["state_local_bytes"] = sum(
        (v.to_local() if hasattr(v, "to_local") else v).nbytes
        for s in opt.state.values() for v in s.values())
    rec["param_local_bytes"] = sum(q.to_local().nbytes for q in model.parameters())
    rec["state_full"] = [{k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                          for k, v in opt.state[q].items()} for q in model.parameters()]
    return rec


def run_resume(mesh, rank, world, via):
    """fp16_adamw_scaler interrupted after RESUME_AT steps and resumed in fresh objects from
    the model/optimizer/scaler state dicts (via "optim": their own; "dcp": torch's
    distributed-checkpoint state-dict API)."""
    kind, param_dtype, scaled, inf_step = SCENARIOS["fp16_adamw_scaler"]
    model = shard(make_model(), mesh, param_dtype)
    opt, scaler = make_optimizer(kind, model.parameters()), make_scaler(scaled)
    first = new_record()
    train_steps(model, opt, scaler, RESUME_AT, 0, rank, world, inf_step, first)
    if via == "dcp":
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             get_optimizer_state_dict,
                                                             set_model_state_dict,
                                                             set_optimizer_state_dict)
        msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    else:
        msd, osd = model.state_dict(), opt.state_dict()
    msd, osd = copy.deepcopy(msd), copy.deepcopy(osd)
    ssd = scaler.state_dict()
    del model, opt, scaler
    model = shard(make_model(seed=1), mesh, param_dtype)  # other weights: all must be loaded
    opt, scaler = make_optimizer(kind, model.parameters()), make_scaler(scaled)
    if via == "dcp":
        set_model_state_dict(model, msd)
        set_optimizer_state_dict(model, opt, osd)
    else:
        model.load_state_dict(msd)
        opt.load_state_dict(osd)
    scaler.load_state_dict(ssd)
    rest = new_record()
    train_steps(model, opt, scaler, STEPS - RESUME_AT, RESUME_AT, rank, world, inf_step, rest)
    return {"params": first["params"] + rest["params"], "scales": first["scales"] + rest["scales"],
            "applied": first["applied"] + rest["applied"]}


def join(argv):
    """Joins the process group named by argv (RANK WORLD INIT_FILE BACKEND OUT_DIR), one torch
    thread per rank; returns rank, world, out_dir and a 1-D CPU mesh over the ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = rank_process.join(*argv[:4])
    return rank, world, argv[4], init_device_mesh("cpu", (world,))


def main():
    rank, world, out_dir, mesh = join(sys.argv[1:])
    out = {name: run_scenario(name, mesh, rank, world) for name in SCENARIOS}
    for via in ("optim", "dcp"):
        try:
            out[f"resume_{via}"] = run_resume(mesh, rank, world, via)
        except Exception as e:  # reported by the test, with the error
            out[f"resume_{via}"] = {"error": f"{type(e).__name__}: {e}"}
    # DTensor parameters under a scaler and a torch optimizer: refused with a clear error.
    model = shard(make_model(), mesh, None)
    opt, scaler = torch.optim.AdamW(model.parameters()), make_scaler(True)
    scaler.scale(loss_of(model(global_batch(0)[0]), global_batch(0)[1])).backward()
    out["plain_step_error"] = rank_process.error_text(lambda: scaler.step(opt),
                                                      NotImplementedError)
    rank_process.finish(out, out_dir, rank)


# ---------------------------------------------------------------------------- references
def reference_run(name, steps=STEPS, world=2, split=True):
    """The same training on one process and the same global batch: an FP32 master model;
    with a policy, forward and backward run on a copy cast to param_dtype (what FSDP2
    all-gathers), and the gradients, cast to FP32 (reduce_dtype), are averaged. split=True
    computes them per rank's rows, as the ranks do (the FP32 mean of the rows' means);
    split=False on the whole batch at once. FP32 models always use the whole batch."""
    kind, param_dtype, scaled, inf_step = SCENARIOS[name]
    master = make_model()
    opt, scaler = make_optimizer(kind, master.parameters()), make_scaler(scaled)
    parts = world if split and param_dtype is not None else 1
    n = GLOBAL_BATCH // parts
    rec = new_record()
    for step in range(steps):
        x, y = global_batch(step)
        low = master if param_dtype is None else copy.deepcopy(master).to(param_dtype)
        grads = None
        for r in range(parts):
            low.zero_grad()
            xr, yr = x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]
            loss = loss_of(low(xr if param_dtype is None else xr.to(param_dtype)), yr)
            scaler.scale(loss).backward()
            g = [p.grad.float() for p in low.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for pm, g in zip(master.parameters(), grads):
            pm.grad = g / parts
        if step == inf_step:
            master[0].weight.grad[inf_row(world), 0] = float("inf")
        if step == UNSCALE_STEP and scaler.is_enabled():
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        rec["params"].append([p.detach().clone() for p in master.parameters()])
        rec["applied"].append(float(opt.last_step_applied))
        rec["scales"].append(scaler.get_scale())
        rec["norms"].append(step_norm(opt))
    rec["state_full"] = [{k: v.clone() for k, v in opt.state[p].items()}
                         for p in master.parameters()]
    rec["telemetry"] = scaler.telemetry(master) if scaled else None
    return rec


if __name__ == "__main__":
    main()
