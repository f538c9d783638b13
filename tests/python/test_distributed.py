"""Data-parallel training with fusedamp: DDP over a fusedamp.initialize'd model and the sharded
(ZeRO-1) optimizer, on 2 and 3 processes that this module launches itself (Gloo on the CPU;
NCCL with one rank per GPU when at least two GPUs are present). Every rank runs
distributed_worker.py; the checks here compare the ranks with each other and with a
single-process run of the same global batch.

Numerics: with an FP32 model the sharded step equals the single-process step within FP32
rounding (the only difference is the order of the gradient sum). With an FP16 model the
gradients themselves are FP16 tensors computed from a different split of the batch and summed
in FP16 (as DDP does), so the runs agree to FP16 gradient rounding, amplified by Adam where a
gradient is near zero: the tolerances below are set from that, and every run prints the largest
difference it saw.
"""
import os
import subprocess
import sys
import time

import pytest
import torch

import fusedamp
from distributed_worker import (INF_STEP, MODES, RESUME_STEPS, STEPS, mode_name,
                                reference_modes_run, reference_run)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_worker.py")
PYTHON_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "python"))
LAUNCH_TIMEOUT_S = 150  # a hang fails the test instead of blocking CI

BACKENDS = [
    pytest.param(("gloo", "cpu"), id="gloo-cpu"),
    pytest.param(("nccl", "cuda"), id="nccl-cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2
        or not torch.distributed.is_nccl_available(),
        reason="NCCL tests need at least 2 CUDA GPUs (one rank per GPU)")),
]
WORLDS = (2, 3)

# FP16 model vs single process (see the module doc): master weights, model weights, moments.
TOL_FP16 = {"adamw": 2e-3, "sgd": 2e-4}
TOL_FP32 = dict(rtol=1e-5, atol=1e-6)


def _launch(world, backend, out_dir, load_path="", worker=WORKER):
    """Starts `world` ranks of `worker`, waits for all of them (bounded) and returns their
    results."""
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
    init_file = os.path.join(out_dir, "rendezvous")
    procs, logs = [], []
    for rank in range(world):
        log = open(os.path.join(out_dir, f"log{rank}.txt"), "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, worker, str(rank), str(world), init_file, backend, out_dir]
            + ([load_path] if load_path else []), stdout=log, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        timed_out = [p for p in procs if p.poll() is None]
        for p in timed_out:
            p.kill()
            p.wait()
        for log in logs:
            log.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = []
        for r in failed:
            with open(os.path.join(out_dir, f"log{r}.txt")) as f:
                tails.append(f"--- rank {r} ---\n" + f.read()[-3000:])
        what = "timed out" if timed_out else "failed"
        pytest.fail(f"{world} ranks ({backend}) {what}:\n" + "\n".join(tails))
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


@pytest.fixture(scope="module", params=BACKENDS)
def runs(request, tmp_path_factory):
    """{world: [per-rank results]}; the 3-rank run also loads the 2-rank run's gathered
    checkpoint."""
    backend, device = request.param
    base = tmp_path_factory.mktemp(f"dist_{backend}")
    out = {2: _launch(2, backend, str(base / "w2"))}
    out[3] = _launch(3, backend, str(base / "w3"), load_path=str(base / "w2" / "ckpt_2.pt"))
    out["device"] = "cuda:0" if device == "cuda" else "cpu"
    out["ckpt_2"] = str(base / "w2" / "ckpt_2.pt")
    return out


_REFS = {}


def _reference(kind, device, dtype=torch.float16):
    key = (kind, device, dtype)
    if key not in _REFS:
        _REFS[key] = reference_run(kind, device, dtype)
    return _REFS[key]


def _max_diff(a, b):
    return max((x.float().cpu() - y.float().cpu()).abs().max().item() for x, y in zip(a, b))


def _assert_ranks_identical(results, get):
    first = get(results[0])
    for r, res in enumerate(results[1:], start=1):
        for step, (a, b) in enumerate(zip(first, get(res))):
            for i, (x, y) in enumerate(zip(a, b)):
                assert torch.equal(x, y), f"rank {r} differs from rank 0: step {step}, param {i}"


def _state_diff(full, ref_state):
    diffs = {}
    for i, s in ref_state.items():
        assert set(full[i]) == set(s), (i, sorted(full[i]), sorted(s))
        for name, v in s.items():
            d = (full[i][name].float().cpu() - v.float().cpu()).abs().max().item()
            diffs[name] = max(diffs.get(name, 0.0), d)
    return diffs


# ----------------------------------------------------------------------------------- DDP
@pytest.mark.parametrize("world", WORLDS)
def test_ddp_matches_single_process_and_skips_together(runs, world, record_diff):
    results = runs[world]
    ref = _reference("ddp", runs["device"])
    _assert_ranks_identical(results, lambda r: r["ddp"]["run"]["params"])
    for r in results:
        run = r["ddp"]["run"]
        assert run["scales"] == ref["scales"]  # same scale sequence on every rank
        assert run["applied"] == ref["applied"]
        assert run["applied"][INF_STEP] == 0.0 and sum(run["applied"]) == STEPS - 1
        # The skipped step changed nothing, bit for bit.
        for a, b in zip(run["params"][INF_STEP - 1], run["params"][INF_STEP]):
            assert torch.equal(a, b)
    d = _max_diff(results[0]["ddp"]["run"]["params"][-1], ref["params"][-1])
    record_diff(f"distributed: DDP FP16 {world} ranks vs 1 process (params)", d)
    assert d <= TOL_FP16["adamw"], d
    assert ref["scales"][INF_STEP] < ref["scales"][INF_STEP - 1]  # the reference did back off


@pytest.mark.parametrize("world", WORLDS)
def test_ddp_checkpoint_loaded_on_every_rank(runs, world, record_diff):
    """Every rank loads rank 0's checkpoint into a fresh model and DDP wrapper: the ranks stay
    identical, and the run continues as the uninterrupted one. Bit-exact on 2 ranks; on 3, a
    fresh DDP's gradient buckets (before its first-iteration rebuild) split the FP16 all-reduce
    differently from the running one, so the sum is rounded in another order."""
    results = runs[world]
    _assert_ranks_identical(results, lambda r: r["ddp"]["resumed"]["params"])
    for r in results:
        assert r["ddp"]["cont"]["scales"] == r["ddp"]["resumed"]["scales"]
        d = _max_diff(r["ddp"]["cont"]["params"][-1], r["ddp"]["resumed"]["params"][-1])
        record_diff(f"distributed: DDP FP16 {world} ranks resumed vs uninterrupted", d)
        if world == 2:
            for a, b in zip(r["ddp"]["cont"]["params"], r["ddp"]["resumed"]["params"]):
                assert all(torch.equal(x, y) for x, y in zip(a, b))
        else:
            assert d <= TOL_FP16["adamw"], d


# ----------------------------------------------------------------------------------- sharded
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("world", WORLDS)
def test_sharded_fp16_matches_single_process(runs, world, kind, record_diff):
    """AdamW with global-norm clipping; SGD with momentum, two param groups and an LR
    scheduler. The inf is injected into one grad on the last rank only, in an element that
    rank 0 owns: every rank must skip, and the scale must back off the same way everywhere."""
    results = runs[world]
    ref = _reference(kind, runs["device"])
    _assert_ranks_identical(results, lambda r: r[kind]["params"])
    for r in results:
        assert r[kind]["scales"] == ref["scales"]
        assert r[kind]["applied"] == ref["applied"]
        assert r[kind]["applied"][INF_STEP] == 0.0 and r[kind]["skipped_steps"] == 1
        for a, b in zip(r[kind]["params"][INF_STEP - 1], r[kind]["params"][INF_STEP]):
            assert torch.equal(a, b)
    d = _max_diff(results[0][kind]["params"][-1], ref["params"][-1])
    record_diff(f"distributed: sharded {kind} FP16 {world} ranks vs 1 process (params)", d)
    assert d <= TOL_FP16[kind], d
    diffs = _state_diff(results[0][kind]["full"]["state"], ref["state"]["state"])
    for name, v in diffs.items():
        record_diff(f"distributed: sharded {kind} FP16 {world} ranks vs 1 process ({name})", v)
    assert diffs["step"] == 0.0
    assert max(diffs.values()) <= TOL_FP16[kind], diffs


@pytest.mark.parametrize("world", WORLDS)
def test_sharded_fp32_matches_single_process_within_fp32_rounding(runs, world, record_diff):
    results = runs[world]
    ref = _reference("adamw", runs["device"], torch.float32)
    r0 = results[0]["adamw_fp32"]
    assert r0["applied"] == ref["applied"] and r0["applied"][INF_STEP] == 0.0
    for step, (a, b) in enumerate(zip(r0["params"], ref["params"])):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, **TOL_FP32, msg=f"step {step}")
    record_diff(f"distributed: sharded adamw FP32 {world} ranks vs 1 process (params)",
                _max_diff(r0["params"][-1], ref["params"][-1]))
    full, rs = r0["full"]["state"], ref["state"]["state"]
    for i, s in rs.items():
        for name, v in s.items():
            torch.testing.assert_close(full[i][name].cpu(), v.cpu(), **TOL_FP32)


@pytest.mark.parametrize("world", WORLDS)
def test_sharded_checkpoint_same_world_size_is_bit_exact(runs, world):
    for r in runs[world]:
        a = r["adamw"]
        assert a["cont"]["scales"] == a["resumed"]["scales"]
        for x, y in zip(a["cont"]["params"], a["resumed"]["params"]):
            assert all(torch.equal(p, q) for p, q in zip(x, y))
        for i, s in a["cont_full"]["state"].items():
            for name, v in s.items():
                assert torch.equal(v, a["resumed_full"]["state"][i][name]), (i, name)


def test_gathered_checkpoint_loads_on_another_world_size(runs, record_diff):
    """The 2-rank run's consolidated checkpoint, loaded by 3 ranks: the state re-gathers
    bit-exactly, and training continues like a single process resumed from it."""
    ck = torch.load(runs["ckpt_2"], map_location=runs["device"])
    ref = reference_run("adamw", runs["device"], steps=RESUME_STEPS, checkpoint=ck)
    results = runs[3]
    _assert_ranks_identical(results, lambda r: r["adamw"]["other_n"]["params"])
    a = results[0]["adamw"]
    for i, s in ck["optim"]["state"].items():
        for name, v in s.items():
            assert torch.equal(a["reloaded_full"]["state"][i][name].cpu(), v.cpu()), (i, name)
    assert a["other_n"]["scales"] == ref["scales"]
    d = _max_diff(a["other_n"]["params"][-1], ref["params"][-1])
    record_diff("distributed: 2-rank checkpoint continued on 3 ranks vs 1 process (params)", d)
    assert d <= TOL_FP16["adamw"], d
    # It also moved: the continued run is not the checkpoint itself.
    assert _max_diff(a["other_n"]["params"][-1], list(ck["model"].values())) > 0


@pytest.mark.parametrize("world", WORLDS)
def test_state_bytes_per_rank_are_one_nth(runs, world):
    unsharded = _reference("adamw", runs["device"])["state_bytes"]  # fusedamp.optim.AdamW
    results = runs[world]
    per_rank = [r["memory"]["all_ranks"] for r in results]
    one = results[0]["memory"]["one_rank"]
    assert results[0]["memory"]["one_rank_world"] == 1
    assert one == unsharded  # one rank: the same bytes as the unsharded optimizer
    n_params = len(results[0]["adamw"]["params"][0])
    # FP32 master + 2 moments for 1/N of each bucket (padding < N elements per bucket), plus
    # one 4-byte step per segment (each parameter is cut at most once per rank boundary).
    for b in per_rank:
        assert abs(b - unsharded / world) <= 12 * world * 2 + 4 * (n_params + world), per_rank
    print(f"\noptimizer-state bytes per rank: 1 rank {one}, {world} ranks {per_rank}")


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_fp32_export_is_the_consolidated_masters(runs, world):
    """fusedamp.master_weights on a ZeRO-1 run (called on every rank): the same FP32 weights on
    every rank, the consolidated masters bit for bit (the FP32 norm layers' own weights), and
    they round to the model's weights."""
    ranks = runs[world]
    export = ranks[0]["adamw"]["export"]
    masters = ranks[0]["adamw"]["full"]["state"]
    names = list(ranks[0]["adamw"]["named_params"])
    for r in ranks[1:]:
        assert r["adamw"]["export"].keys() == export.keys()
        for name in export:
            assert torch.equal(r["adamw"]["export"][name], export[name]), name
    for index, name in enumerate(names):  # one param group: state index = parameter order
        param = ranks[0]["adamw"]["named_params"][name]
        assert export[name].dtype == torch.float32
        if param.dtype == torch.float32:  # the FP32 norm layers: the weights themselves
            assert torch.equal(export[name], param)
            continue
        assert torch.equal(export[name], masters[index]["master_param"].to(export[name].device))
        assert torch.equal(export[name].to(param.dtype), param)


# ------------------------------------------------------------- master-weight modes, sharded
_MODE_REFS = {}


def _mode_reference(mode, state_dtype, device):
    key = (mode, state_dtype, device)
    if key not in _MODE_REFS:
        _MODE_REFS[key] = reference_modes_run(mode, state_dtype, device)
    return _MODE_REFS[key]


@pytest.mark.parametrize("mode,state_dtype", MODES, ids=[mode_name(*m) for m in MODES])
@pytest.mark.parametrize("world", WORLDS)
def test_sharded_modes_match_single_process_bit_for_bit(runs, world, mode, state_dtype):
    """Every weight store and moment dtype sharded over 2 and 3 ranks, on the gradients of the
    whole batch (the same on every rank, as a single process computes them): the model weights
    after every step and the gathered state (remainders, compensations, moments of their
    dtype) equal fusedamp.optim's bit for bit. Stochastic rounding draws per shard segment, so
    there the ranks agree with each other and the run stays within a few BF16 ulps (2^-8
    relative each) of the single process."""
    results = runs[world]
    name = mode_name(mode, state_dtype)
    ref = _mode_reference(mode, state_dtype, runs["device"])
    _assert_ranks_identical(results, lambda r: r["modes"][name]["params"])
    mine = results[0]["modes"][name]
    assert mine["params"][-1][0].dtype == torch.bfloat16
    moved = _max_diff(mine["params"][-1], ref["params"][0])
    assert moved > 0  # the steps changed the model
    if mode == "stochastic":
        for a, b in zip(mine["params"][-1], ref["params"][-1]):
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -5, atol=1e-3)
        return
    for step, (a, b) in enumerate(zip(mine["params"], ref["params"])):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {step}, param {i}"
    full, ref_state = mine["full"]["state"], ref["state"]["state"]
    assert full.keys() == ref_state.keys()
    for i, s in ref_state.items():
        assert full[i].keys() == s.keys(), (i, sorted(full[i]), sorted(s))
        for key, v in s.items():
            assert full[i][key].dtype == v.dtype and torch.equal(full[i][key].cpu(), v.cpu()), (
                i, key)
    # 1/N of the unsharded state per rank (padding: < N elements per state buffer; one FP32
    # step count per segment instead of per parameter).
    n_params = len(ref_state)
    for r in results:
        slack = 12 * world + 4 * (n_params + world)
        assert abs(r["modes"][name]["state_bytes"] - ref["state_bytes"] / world) <= slack


@pytest.mark.parametrize("world", WORLDS)
def test_sharded_stochastic_rounding_resumes_bit_exact(runs, world):
    """The shard's state_dict (with the model) continues bit-identically in a fresh optimizer:
    the draws depend on the seed, the step and the element, not on the process."""
    for r in runs[world]:
        res = r["modes"][mode_name("stochastic", torch.float32)]
        for x, y in zip(res["cont"], res["resumed"]):
            assert all(torch.equal(p, q) for p, q in zip(x, y))


@pytest.mark.parametrize("world", WORLDS)
def test_sharded_checkpoint_converts_between_modes_bit_exact(runs, world):
    """A gathered FP32-master checkpoint loaded into a split-mode sharded optimizer, gathered
    again and loaded into an FP32-master one: the masters come back bit for bit, and in
    between the split pair (model weight + remainder) is every master exactly."""
    ranks = runs[world]
    conv = ranks[0]["modes"]["convert"]
    start, split, back = conv["start"]["optim"]["state"], conv["split"], conv["back"]
    for r in ranks[1:]:
        assert all(torch.equal(r["modes"]["convert"]["split"]["model"][k], v)
                   for k, v in split["model"].items())
    weights = list(split["model"].values())
    names = list(split["export"])
    n_split = 0
    for i, s in start.items():
        if "master_param" not in s:  # FP32 norm weights keep none
            assert "param_remainder" not in split["optim"]["state"][i]
            continue
        remainder = split["optim"]["state"][i]["param_remainder"]
        assert remainder.dtype == torch.int16
        # weight pattern * 2^16 + the signed remainder (math/split_math.h)
        rebuilt = ((weights[i].contiguous().view(torch.int16).to(torch.int32) << 16)
                   + remainder.to(torch.int32)).view(torch.float32)
        assert torch.equal(rebuilt.cpu(), s["master_param"].cpu()), i
        assert torch.equal(split["export"][names[i]].cpu(), s["master_param"].cpu()), i
        n_split += 1
    assert n_split >= 3
    # and the checkpoint after both hops is the first one, every tensor bit for bit
    assert back["optim"]["state"].keys() == start.keys()
    for i, s in back["optim"]["state"].items():
        assert s.keys() == start[i].keys()
        for key, v in s.items():
            assert torch.equal(v, start[i][key]), (i, key)


def test_split_checkpoint_continues_on_another_world_size_bit_exact(runs):
    """The 2-rank split checkpoint (BF16 moments), loaded by 3 ranks: the state re-gathers bit
    for bit and the next steps equal the 2-rank run's continuation bit for bit."""
    two, three = runs[2][0]["modes"], runs[3]
    ck = torch.load(os.path.join(os.path.dirname(runs["ckpt_2"]), "ckpt_split_2.pt"))
    _assert_ranks_identical(three, lambda r: r["modes"]["split_other_n"])
    for i, s in ck["optim"]["state"].items():
        for key, v in s.items():
            assert torch.equal(three[0]["modes"]["split_reloaded"]["state"][i][key].cpu(),
                               v.cpu()), (i, key)
    for x, y in zip(two["split_cont"], three[0]["modes"]["split_other_n"]):
        assert all(torch.equal(p, q) for p, q in zip(x, y))


# ---------------------------------------------------------------- bad input, 1 rank in-process
def _bf16_model_and_grads():
    from distributed_worker import make_model

    model = make_model("cpu", torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    return model


@pytest.mark.usefixtures("one_rank_process_group")
def test_sharded_optimizer_is_deprecated_naming_its_replacements():
    from distributed_worker import make_model
    from fusedamp.distributed import ShardedOptimizer

    model = make_model("cpu", torch.bfloat16)
    with pytest.warns(DeprecationWarning, match="ShardedOptimizer is deprecated") as caught:
        ShardedOptimizer(model.parameters(), "adamw")
    message = str(caught[0].message)
    assert "fusedamp.distributed.ZeroRedundancyOptimizer" in message and "FSDP2" in message


@pytest.mark.usefixtures("one_rank_process_group")
def test_sharded_refuses_a_mode_that_does_not_fit_before_touching_the_model():
    from distributed_worker import make_model
    from fusedamp.distributed import ShardedOptimizer

    model = make_model("cpu", torch.float16)
    before = [(p.data_ptr(), p.detach().clone()) for p in model.parameters()]
    for mode in ("split", "stochastic"):
        with pytest.raises(ValueError, match=f'master_weights="{mode}" keeps bfloat16 weights'):
            ShardedOptimizer(model.parameters(), "adamw", master_weights=mode)
    with pytest.raises(ValueError, match="state_dtype must be torch.float32, torch.bfloat16"):
        ShardedOptimizer(model.parameters(), "adamw", state_dtype=torch.float16)
    with pytest.raises(ValueError, match="ZeroRedundancyOptimizer"):
        ShardedOptimizer(model.parameters(), "adamw", state_dtype=torch.int8)
    for p, (ptr, value) in zip(model.parameters(), before):
        assert p.data_ptr() == ptr and torch.equal(p.detach(), value)  # not repacked


@pytest.mark.usefixtures("one_rank_process_group")
def test_sharded_refuses_a_changed_layout_and_a_bad_state_changing_nothing():
    from fusedamp.distributed import ShardedOptimizer

    model = _bf16_model_and_grads()
    opt = ShardedOptimizer(model.parameters(), "adamw", master_weights="split",
                           state_dtype=torch.bfloat16)
    opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    state = opt.consolidated_state_dict(to=None)
    for key, value in (("master_weights", "kahan"), ("state_dtype", torch.float32)):
        opt.param_groups[0][key] = value
        with pytest.raises(ValueError, match=f"{key} is fixed at construction"):
            opt.step()
        opt.param_groups[0][key] = {"master_weights": "split",
                                    "state_dtype": torch.bfloat16}[key]
    bad = {"state": {i: dict(s) for i, s in state["state"].items()},
           "param_groups": state["param_groups"]}
    bad["state"][5]["param_remainder"] = torch.zeros(3, dtype=torch.int16)  # wrong shape
    with pytest.raises(RuntimeError, match="state 'param_remainder' of parameter 5 has shape"):
        opt.load_state_dict(bad)
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), params))
    after = opt.consolidated_state_dict(to=None)
    for i, s in state["state"].items():
        for key, v in s.items():
            assert torch.equal(after["state"][i][key], v), (i, key)


@pytest.mark.usefixtures("one_rank_process_group")
@pytest.mark.parametrize("mode", ["split", "kahan"])
def test_sharded_sgd_weight_stores_match_fusedamp_optim_on_one_rank(mode):
    """SGD with Nesterov momentum in BF16 buffers and a 16-bit weight store, sharded over one
    rank: the same bits as fusedamp.optim.SGD, weights and state."""
    from distributed_worker import global_batch, make_model
    from fusedamp.distributed import ShardedOptimizer

    kw = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, master_weights=mode,
              state_dtype=torch.bfloat16)
    models = [make_model("cpu", torch.bfloat16) for _ in range(2)]
    opts = [ShardedOptimizer(models[0].parameters(), "sgd", **kw),
            fusedamp.optim.SGD(models[1].parameters(), **kw)]
    start = [p.detach().clone() for p in models[1].parameters()]
    for step in range(5):
        x, y = global_batch(step, "cpu")
        for m, opt in zip(models, opts):
            torch.nn.functional.mse_loss(m(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(a, b), step
    assert not torch.equal(start[0], models[1][0].weight)
    full, ref = opts[0].consolidated_state_dict(to=None)["state"], opts[1].state_dict()["state"]
    assert full.keys() == ref.keys()
    for i, s in ref.items():
        assert full[i].keys() == s.keys()
        for key, v in s.items():
            assert full[i][key].dtype == v.dtype and torch.equal(full[i][key], v), (i, key)
    store = {"split": "param_remainder", "kahan": "kahan_compensation"}[mode]
    assert store in ref[0] and ref[0]["momentum_buffer"].dtype == torch.bfloat16


@pytest.mark.usefixtures("one_rank_process_group")
@pytest.mark.parametrize("mode", [True, "split", "kahan"])
def test_sharded_load_of_a_state_without_entries_starts_fresh(mode):
    """A full state dict that holds no entry for a parameter (never stepped where it was saved)
    loads as a fresh state: step 0, zero moments, the weight store of a weights-only start
    (the FP32 master equal to the weight; a zero remainder or compensation)."""
    from distributed_worker import make_model
    from fusedamp.distributed import ShardedOptimizer

    model = make_model("cpu", torch.bfloat16)
    opt = ShardedOptimizer(model.parameters(), "adamw", master_weights=mode)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    stepped = opt.consolidated_state_dict(to=None)
    assert any(torch.count_nonzero(v) for s in stepped["state"].values() for v in s.values())
    opt.load_state_dict({"state": {}, "param_groups": stepped["param_groups"]})
    weights = [p.detach() for p in model.parameters()]
    loaded = opt.consolidated_state_dict(to=None)["state"]
    assert loaded.keys() == stepped["state"].keys()
    for i, s in loaded.items():
        assert s.keys() == stepped["state"][i].keys()
        for key, v in s.items():
            want = weights[i].float() if key == "master_param" else torch.zeros_like(v)
            assert v.dtype == stepped["state"][i][key].dtype and torch.equal(v, want), (i, key)
