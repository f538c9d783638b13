"""One rank of the FSDP2 checkpoint tests (launched by test_fsdp_checkpoint.py), and what those
tests share with it: the cases, the model, the fixed gradients and the single-process
reference. Not a test module itself.

    python fsdp_checkpoint_worker.py RANK WORLD INIT_FILE BACKEND OUT_DIR PEER_DIR

For every case the ranks train a model under fully_shard with backward (one step skipped on an
inf), save model and optimizer through torch.distributed.checkpoint into OUT_DIR/ckpt/<case>,
record their shards of the parameters and the state, the master export (fusedamp.master_weights)
and torch's consolidated state dict, and continue with fixed gradients. Then they wait for the
ranks of another world size to have saved theirs into PEER_DIR, load each case from there into
a fresh model and optimizer, record their shards and continue with the same fixed gradients.
Everything recorded goes to OUT_DIR/rank{RANK}.pt.

The continuation sets each gradient to a full tensor that depends only on the parameter and
the step, distributed to the parameter's placements: the update is elementwise (no clipping),
so every world size and a single process compute the same bits.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import fusedamp  # noqa: E402
import rank_process  # noqa: E402

TRAIN_STEPS = 3  # with backward, before the checkpoint
INF_STEP = 1  # an inf on one rank: every rank skips, skipped_steps is 1 at the checkpoint
CONTINUE_STEPS = 3  # with fixed gradients, after it
GLOBAL_BATCH = 6  # divides by 1, 2 and 3
PEER_WAIT_S = 120  # below test_distributed.LAUNCH_TIMEOUT_S: a failed peer fails this side
ADAM = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
SGD = dict(lr=0.05, momentum=0.9, weight_decay=0.01)

# case: (optimizer, master_weights, state_dtype, layout). Layouts: "policy" shards an FP32
# model under MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), so the sharded
# parameters are FP32 and are the masters; "bf16" shards the model converted to BF16 (norm
# layers stay FP32) without a policy, so the optimizer keeps the mode's store of the shards.
CASES = {}
for _sd in (torch.float32, torch.bfloat16):
    _tag = "fp32state" if _sd == torch.float32 else "bf16state"
    CASES[f"adamw_true_policy_{_tag}"] = ("adamw", True, _sd, "policy")
    for _mode, _label in ((True, "true"), ("split", "split"), ("kahan", "kahan"), (False, "off")):
        CASES[f"adamw_{_label}_bf16_{_tag}"] = ("adamw", _mode, _sd, "bf16")
CASES["sgd_true_bf16_fp32state"] = ("sgd", True, torch.float32, "bf16")
# 8-bit moments and momentum buffers keep scales per block of 32 elements of each parameter:
# their cases train a
# model whose shards hold whole blocks on 1, 2 and 3 ranks, except the last bias (BLOCK_SPLIT),
# which takes a param group with BF16 moments.
CASES["adamw_true_policy_int8state"] = ("adamw", True, torch.int8, "policy")
CASES["adamw_true_bf16_int8state"] = ("adamw", True, torch.int8, "bf16")
CASES["adamw_split8_bf16_int8state"] = ("adamw", "split8", torch.int8, "bf16")
CASES["sgd_split8_bf16_int8state"] = ("sgd", "split8", torch.int8, "bf16")
BLOCK_SPLIT = ("3.bias",)


def make_model(seed=0, int8=False):
    """35 rows shard unevenly over 2 and 3 ranks (18/17, 12/12/11); the 2-row last layer
    leaves the third of 3 ranks an empty shard. For 8-bit moments (int8): 192 rows, whole
    blocks of 32 on every shard of the 1-D parameters (96/96, 64/64/64), rows of 32 and 192
    elements in the 2-D ones (an empty shard again on the third of 3 ranks)."""
    torch.manual_seed(seed)
    rows = 192 if int8 else 35
    return nn.Sequential(nn.Linear(32 if int8 else 16, rows), nn.LayerNorm(rows), nn.GELU(),
                         nn.Linear(rows, 2))


def build(case, mesh, seed=0):
    """The model (sharded on `mesh`, or plain when mesh is None) and its optimizer."""
    kind, mode, state_dtype, layout = CASES[case]
    int8 = state_dtype == torch.int8
    model = make_model(seed, int8)
    if layout == "bf16":
        fusedamp.convert_module(model, torch.bfloat16)
    if mesh is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw = {}
        if layout == "policy":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
        for layer in (model[0], model[3]):
            fully_shard(layer, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
    hyper = ADAM if kind == "adamw" else SGD
    cls = fusedamp.optim.AdamW if kind == "adamw" else fusedamp.optim.SGD
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if not (int8 and n in BLOCK_SPLIT)]}]
    if int8:
        groups.append({"params": [p for n, p in named if n in BLOCK_SPLIT],
                       "state_dtype": torch.bfloat16})
    opt = cls(groups, master_weights=mode, state_dtype=state_dtype, **hyper)
    return model, opt


def _local(t):
    # Under no_grad a DTensor's to_local() is its local tensor itself (no autograd view).
    with torch.no_grad():
        return t.to_local() if hasattr(t, "to_local") else t


def pieces(model, opt):
    """This rank's pieces of the parameters and of the optimizer state, by parameter name:
    FSDP2 shards dim 0 in rank order, so the test concatenates them into the full tensors (no
    collective here: Gloo and NCCL cannot all-gather the int16 "split" remainder anyway)."""
    params = {n: _local(p).clone() for n, p in model.named_parameters()}
    state = {n: {k: _local(v).clone() for k, v in opt.state[p].items()}
             for n, p in model.named_parameters() if opt.state[p]}
    skipped = opt.skipped_steps
    return {"params": params, "state": state,
            "skipped_steps": None if skipped is None else int(skipped)}


def fixed_grad(index, param, step):
    """The continuation's gradient of the parameter at position `index`: the same full tensor
    on every world size, laid out like the parameter."""
    g = torch.Generator().manual_seed(10_000 + 100 * step + index)
    full = (torch.randn(param.shape, generator=g) * 0.1).to(param.dtype)
    if not hasattr(param, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)


def continue_fixed(model, opt):
    """CONTINUE_STEPS steps on the fixed gradients; this rank's pieces after them."""
    for step in range(CONTINUE_STEPS):
        for i, p in enumerate(model.parameters()):
            p.grad = fixed_grad(i, p, step)
        opt.step()
        opt.zero_grad()
    return pieces(model, opt)


def _batch(step, width):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(GLOBAL_BATCH, width, generator=g),
            torch.randn(GLOBAL_BATCH, 2, generator=g))


def train(model, opt, rank, world):
    n = GLOBAL_BATCH // world
    for step in range(TRAIN_STEPS):
        x, y = _batch(step, model[0].in_features)
        out = model(x[rank * n:(rank + 1) * n])
        F.mse_loss(out.float(), y[rank * n:(rank + 1) * n]).backward()
        if step == INF_STEP and rank == world - 1:
            model[0].weight.grad.to_local()[0, 0] = float("inf")
        opt.step()
        opt.zero_grad()


# ---------------------------------------------------------------------------- checkpoints
def save(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)


def load(case, path, mesh):
    """A fresh model (other weights) and optimizer, loaded from the checkpoint at `path`
    through torch's state-dict API; mesh None: plain tensors in this process, no FSDP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)

    model, opt = build(case, mesh, seed=1)
    # The optimizer's own state dict is the template dcp.load fills (torch initialises the
    # state first with a zero-lr step).
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path, no_dist=mesh is None)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    return model, opt


def full_state_dict(model, opt):
    """torch's consolidated optimizer state (StateDictOptions(full_state_dict=True)) by
    parameter name, or the error it raised."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    try:
        osd = get_optimizer_state_dict(model, opt,
                                       options=StateDictOptions(full_state_dict=True))
    except Exception as e:  # reported by the test
        return {"error": f"{type(e).__name__}: {e}"}
    return {"state": {n: {k: v.clone() for k, v in s.items()} for n, s in osd["state"].items()}}


def _same_layout(weights, model):
    return all(type(w) is type(p) and w.placements == p.placements
               and w.device_mesh == p.device_mesh
               for w, p in zip(weights.values(), model.parameters()))


def save_case(case, mesh, rank, world, ckpt_dir):
    model, opt = build(case, mesh)
    train(model, opt, rank, world)
    saved = pieces(model, opt)
    save(model, opt, os.path.join(ckpt_dir, case))
    weights = fusedamp.master_weights(model, opt)
    return {"saved": saved,
            "export": {n: _local(w).clone() for n, w in weights.items()},
            "export_types": sorted({type(w).__name__ for w in weights.values()}),
            "export_layout_is_params": _same_layout(weights, model),
            "full_state_dict": full_state_dict(model, opt),
            "continued": continue_fixed(model, opt)}


def load_case(case, mesh, ckpt_dir):
    model, opt = load(case, os.path.join(ckpt_dir, case), mesh)
    loaded = pieces(model, opt)
    export = {n: _local(w).clone() for n, w in fusedamp.master_weights(model, opt).items()}
    return {"loaded": loaded, "export": export, "continued": continue_fixed(model, opt)}


def int8_refusal(mesh):
    """8-bit moments for the 35-row model: its bias of 35 elements shards into pieces that are
    not whole blocks of 32 (18/17, 12/12/11), so every rank refuses it, at construction and
    when a group is switched to int8, changing nothing."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    fully_shard(model, mesh=mesh)
    out = {}
    try:
        fusedamp.optim.AdamW(model.parameters(), lr=1e-3, state_dtype=torch.int8)
    except ValueError as e:
        out["construction"] = str(e)
    opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3)
    for i, p in enumerate(model.parameters()):
        p.grad = fixed_grad(i, p, 0)
    opt.step()
    before = pieces(model, opt)
    opt.param_groups[0]["state_dtype"] = torch.int8
    for i, p in enumerate(model.parameters()):
        p.grad = fixed_grad(i, p, 1)
    try:
        opt.step()
    except ValueError as e:
        out["switch"] = str(e)
    after = pieces(model, opt)
    out["unchanged"] = all(
        torch.equal(after["params"][n], before["params"][n]) and
        all(torch.equal(after["state"][n][k], v) for k, v in before["state"][n].items())
        for n in before["params"])
    return out


def int8_full_checkpoint():
    """One process, the 35-row model with 8-bit moments, 2 fixed steps: the model and the
    optimizer's state dict (full tensors, codes and block scales)."""
    model = make_model()
    opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3, state_dtype=torch.int8)
    for step in range(2):
        for i, p in enumerate(model.parameters()):
            p.grad = fixed_grad(i, p, step)
        opt.step()
    return model, opt.state_dict()


def int8_checkpoint_into_bf16_moments(model, state_dict, mesh=None):
    """A copy of `model` (sharded on `mesh`: every sharding here cuts its 35-element bias
    mid-block) whose optimizer keeps BF16 moments loads the 8-bit checkpoint and takes one
    fixed step: this rank's pieces after it."""
    import copy

    model = copy.deepcopy(model)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3, state_dtype=torch.bfloat16)
    opt.load_state_dict(state_dict)
    for i, p in enumerate(model.parameters()):
        p.grad = fixed_grad(i, p, 2)
    opt.step()
    return pieces(model, opt)


def _wait_for_peer(peer_dir):
    deadline = time.monotonic() + PEER_WAIT_S
    while not os.path.exists(os.path.join(peer_dir, "saved")):
        if os.path.exists(os.path.join(peer_dir, "failed")):
            raise RuntimeError(f"the ranks writing {peer_dir} failed")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ranks writing {peer_dir} never saved their checkpoints")
        time.sleep(0.2)


def main():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = rank_process.join(*sys.argv[1:5], timeout_s=PEER_WAIT_S)
    out_dir, peer_dir = sys.argv[5:7]
    mesh = init_device_mesh("cpu", (world,))
    ckpt_dir = os.path.join(out_dir, "ckpt")
    out = {"saved": {case: save_case(case, mesh, rank, world, ckpt_dir) for case in CASES},
           "int8_refusal": int8_refusal(mesh),
           "int8_into_bf16": int8_checkpoint_into_bf16_moments(*int8_full_checkpoint(), mesh)}
    dist.barrier()
    if rank == 0:
        open(os.path.join(out_dir, "saved"), "w").close()
    _wait_for_peer(peer_dir)
    peer_ckpt = os.path.join(peer_dir, "ckpt")
    out["loaded"] = {case: load_case(case, mesh, peer_ckpt) for case in CASES}
    rank_process.finish(out, out_dir, rank)


# ---------------------------------------------------------------------------- reference
def reference(case, saved):
    """The single-process run from a checkpoint's full tensors (`saved`), loaded into plain
    fusedamp.optim through its own load_state_dict: the master export at the checkpoint and the
    fixed-gradient continuation."""
    model, opt = build(case, None, seed=1)
    names = [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved["params"][n])
    sd = opt.state_dict()
    sd["state"] = {i: {k: v.clone() for k, v in saved["state"][n].items()}
                   for i, n in enumerate(names) if n in saved["state"]}
    sd["skipped_steps"] = torch.tensor(saved["skipped_steps"])
    opt.load_state_dict(sd)
    export = {n: w.clone() for n, w in fusedamp.master_weights(model, opt).items()}
    return {"export": export, "continued": continue_fixed(model, opt)}


if __name__ == "__main__":
    main()
