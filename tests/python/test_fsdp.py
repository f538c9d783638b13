"""fusedamp.optim and fusedamp.GradScaler on FSDP2 (torch.distributed.fsdp.fully_shard, DTensor
parameters): 2 ranks on Gloo on the CPU, launched as test_distributed.py launches its ranks
(fsdp_worker.py runs on each), compared with a single-process run of the same global batch.

Numerics (the tolerances below):
- FP32 parameters: the ranks' gradients are the FP32 means of half batches, reduce-scattered
  and averaged; the reference's the mean of the whole batch. They differ by FP32 summation
  order only, so the runs agree to FP32 rounding (TOL_FP32).
- param_dtype BF16/FP16, reduce_dtype FP32: each rank runs forward and backward in BF16/FP16
  on its rows. The reference that computes the same rows' gradients in one process (split)
  gets the same gradients up to the FP32 rounding of the mean and of the global norm; but a
  1-ulp difference of an FP32 master can flip the BF16/FP16 rounding of the weight the next
  forward uses (a relative 2**-8 / 2**-11 change), so differences grow by such roundings over
  the steps: bounds 2e-3 (BF16) and 5e-4 (FP16), several times what is seen. Against the
  reference that computes the whole batch at once, the gradients differ by BF16/FP16 rounding
  of every activation, and Adam turns a near-zero gradient's rounding into an update of up to
  lr per step (6 steps at lr 1e-2 move a weight at most ~0.06): bounds 3e-2 (BF16) and 2e-3
  (FP16, test_distributed.py's FP16 AdamW bound). Every run records the largest differences.
- Decisions are exact: the same steps are skipped on every rank and in the reference, and the
  loss-scale sequence is identical.
"""
import os

import pytest
import torch
import fusedamp

pytest.importorskip("torch.distributed.fsdp")
if not hasattr(torch.distributed.fsdp, "fully_shard"):
    pytest.skip("FSDP2 (fully_shard) needs torch >= 2.6", allow_module_level=True)

from fsdp_worker import INF_STEP, SCENARIOS, STEPS, UNSCALE_STEP, reference_run  # noqa: E402
from test_distributed import _launch  # noqa: E402  (the launcher pattern)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fsdp_worker.py")
WORLD = 2
TOL_FP32 = dict(rtol=1e-5, atol=1e-6)
TOL_SPLIT = {"bf16": 2e-3, "fp16": 5e-4}
TOL_WHOLE_BATCH = {"bf16": 3e-2, "fp16": 2e-3}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _launch(WORLD, "gloo", str(tmp_path_factory.mktemp("fsdp")), worker=WORKER)


_REFS = {}


def _reference(name, split=True):
    if (name, split) not in _REFS:
        _REFS[name, split] = reference_run(name, world=WORLD, split=split)
    return _REFS[name, split]


def _check_low_precision(run, name, dtype, label, record_diff):
    """Against the reference that splits the batch as the ranks do (tight), and against the
    whole-batch one (recorded; bounded by the largest Adam update over the run)."""
    d = _max_diff(run["params"][-1], _reference(name)["params"][-1])
    record_diff(f"fsdp2: {label} 2 ranks vs 1 process, same split (params)", d)
    assert d <= TOL_SPLIT[dtype], d
    d_full = _max_diff(run["params"][-1], _reference(name, split=False)["params"][-1])
    record_diff(f"fsdp2: {label} 2 ranks vs 1 process, whole batch (params)", d_full)
    assert d_full <= TOL_WHOLE_BATCH[dtype], d_full


def _max_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def _step_collectives(name):
    """The step's collectives: [found_inf, sum_sq] summed over the mesh; under a recording
    scaler (while the gradients are still scaled: not after scaler.unscale_) the sum also
    carries the underflow counts, and a second all-reduce takes the max of amax and of the
    negated first non-finite position."""
    records = bool(SCENARIOS[name][2])
    return [["all_reduce", "all_reduce"] if records and step != UNSCALE_STEP else ["all_reduce"]
            for step in range(STEPS)]


def _check_decisions(ranks, name, ref):
    for r in ranks:
        run = r[name]
        assert run["applied"] == ref["applied"], (run["applied"], ref["applied"])
        assert run["scales"] == ref["scales"]
        assert run["skipped_steps"] == ref["applied"].count(0.0)
        assert run["collectives"] == _step_collectives(name), run["collectives"]
        for step in range(STEPS):  # gathered parameters: the same on every rank
            for x, y in zip(run["params"][step], ranks[0][name]["params"][step]):
                assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["fp32_adamw", "fp32_sgd"])
def test_fp32_matches_single_process_and_skips_together(ranks, name, record_diff):
    """AdamW/SGD with global-norm clipping; at INF_STEP an inf sits in a gradient element only
    the last rank holds: the one all-reduce of [found_inf, sum_sq] makes every rank skip."""
    ref = _reference(name)
    _check_decisions(ranks, name, ref)
    run = ranks[0][name]
    assert run["applied"][INF_STEP] == 0.0 and run["skipped_steps"] == 1
    for a, b in zip(run["params"][INF_STEP - 1], run["params"][INF_STEP]):
        assert torch.equal(a, b)  # the skipped step changed nothing
    for step, (a, b) in enumerate(zip(run["params"], ref["params"])):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, **TOL_FP32, msg=f"step {step}")
    finite = [(n, m) for n, m in zip(run["norms"], ref["norms"]) if m == m and m != float("inf")]
    for n, m in finite:  # the clipping norm is the global one
        assert abs(n - m) <= 1e-5 * m, (n, m)
    for s, t in zip(run["state_full"], ref["state_full"]):
        assert set(s) == set(t)
        for k in s:
            torch.testing.assert_close(s[k].float(), t[k].float(), **TOL_FP32)
    record_diff(f"fsdp2: {name} 2 ranks vs 1 process (params)",
                _max_diff(run["params"][-1], ref["params"][-1]))


def test_bf16_policy_sharded_fp32_params_are_the_masters(ranks, record_diff):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the local shards are FP32 and
    the optimizer keeps no master copy of them: moments and step counts only."""
    name = "bf16_adamw"
    ref = _reference(name)
    _check_decisions(ranks, name, ref)
    for r in ranks:
        run = r[name]
        assert run["local_dtypes"] == ["torch.float32"]
        assert run["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
        assert run["state_is_dtensor"]["exp_avg"] == "DTensor"
        n_params = len(run["params"][0])
        # 2 FP32 moments per local element, one FP32 step count per parameter: no master.
        assert run["state_local_bytes"] == 2 * run["param_local_bytes"] + 4 * n_params
    _check_low_precision(ranks[0][name], name, "bf16", "bf16 policy AdamW", record_diff)


def test_fp16_policy_with_loss_scaler(ranks, record_diff):
    """param_dtype=fp16 under fusedamp.GradScaler: an initial scale of 2**18 overflows FP16
    gradients, so the first steps skip and the scale backs off, then grows; the inf at
    INF_STEP (one rank) skips everywhere; at UNSCALE_STEP scaler.unscale_ unscales the local
    shards first. Scales and skips equal the reference's exactly."""
    name = "fp16_adamw_scaler"
    ref = _reference(name)
    _check_decisions(ranks, name, ref)
    run = ranks[0][name]
    assert run["applied"][0] == 0.0 and run["applied"][INF_STEP] == 0.0
    assert run["scales"][UNSCALE_STEP] == run["scales"][UNSCALE_STEP - 1] * 2  # grew
    assert run["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    _check_low_precision(run, name, "fp16", "fp16 policy AdamW + scaler", record_diff)


@pytest.mark.parametrize("name", ["fp16_adamw_scaler", "fp16_adamw_amax"])
def test_telemetry_is_global_and_the_same_on_every_rank(ranks, name, record_diff):
    """The scaler's record on FSDP2 is that of one process over the whole model: every column
    equal on every rank, and equal to the single-process run's (which sees the same gradients
    up to FP32 rounding): the overflow at INF_STEP (one rank's shard) named on both ranks, amax
    and the underflow fractions over all shards, the norm of the global gradient. Under the
    amax policy the scales follow that global amax, as in one process."""
    ref = _reference(name)["telemetry"]
    _check_decisions(ranks, name, _reference(name))
    logs = [r[name]["telemetry"] for r in ranks]
    for log in logs[1:]:
        assert log == logs[0]
    log = logs[0]
    assert log["step"] == ref["step"] == list(range(STEPS))
    for key in ("scale", "found_inf", "skipped", "first_nonfinite", "dtype_max", "amax_target"):
        assert log[key] == ref[key], key
    assert log["first_nonfinite"][INF_STEP] == "0.weight"
    assert sum(log["found_inf"]) >= 2  # the initial overflow(s) and the injected inf
    worst = 0.0
    for k in range(STEPS):
        if log["found_inf"][k]:
            continue
        for key, rel in (("amax", 1e-6), ("grad_norm", 1e-5)):
            worst = max(worst, abs(log[key][k] - ref[key][k]) / ref[key][k])
            assert log[key][k] == pytest.approx(ref[key][k], rel=rel), (key, k)
        for key in ("underflow_fraction", "subnormal_fraction"):
            assert log[key][k] == pytest.approx(ref[key][k], abs=1e-12), (key, k)
    assert any(f > 0 for f in log["underflow_fraction"])  # the counts are exercised
    if name == "fp16_adamw_amax":  # the policy moved the scale, unlike torch's rule
        assert log["scale"] != [r["fp16_adamw_scaler"]["telemetry"]["scale"] for r in ranks][0]
    record_diff(f"fsdp2: {name} telemetry vs 1 process (amax, grad_norm; relative)", worst)


@pytest.mark.parametrize("via", ["optim", "dcp"])
def test_checkpoint_resume_is_bit_exact(ranks, via):
    """The fp16 scenario stopped after 3 steps and resumed in a fresh sharded model, optimizer
    and scaler (optimizer state as DTensors: its own state_dict, or torch's
    distributed-checkpoint get/set_optimizer_state_dict) continues bit for bit."""
    for r in ranks:
        resumed = r[f"resume_{via}"]
        assert "error" not in resumed, resumed.get("error")
        full = r["fp16_adamw_scaler"]
        assert resumed["scales"] == full["scales"] and resumed["applied"] == full["applied"]
        for step, (a, b) in enumerate(zip(resumed["params"], full["params"])):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), step


def test_torch_optimizer_under_fusedamp_scaler_is_refused(ranks):
    for r in ranks:
        assert r["plain_step_error"] is not None
        assert "reduce found_inf over the mesh" in r["plain_step_error"]


def test_every_scenario_ran(ranks):
    assert set(SCENARIOS) <= set(ranks[0])


# ---------------------------------------------------------------- in this process, 1 rank
@pytest.fixture
def one_rank_mesh(one_rank_process_group):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def test_one_rank_equals_plain_tensors_and_follows_new_local_tensors(one_rank_mesh):
    """On one rank the DTensor path is the plain one, bit for bit; when FSDP2 gives a
    parameter a new local tensor (as its reset_sharded_param does after a .to() or a load),
    the optimizer moves to it with its state."""
    from fsdp_worker import global_batch, loss_of, make_model, shard

    sharded = shard(make_model(), one_rank_mesh, None)
    plain = make_model()
    opts = [fusedamp.optim.AdamW(m.parameters(), lr=1e-2, max_grad_norm=0.5)
            for m in (sharded, plain)]
    for step in range(4):
        if step == 2:  # a new local tensor, taken over by FSDP2 as after a load or .to()
            from torch.distributed.fsdp import fully_shard

            group = fully_shard.state(sharded[0])._fsdp_param_group
            fsdp_param = next(f for f in group.fsdp_params if f.sharded_param is sharded[0].weight)
            old = sharded[0].weight._local_tensor
            sharded[0].weight._local_tensor = old.clone()
            fsdp_param.reset_sharded_param()
            assert sharded[0].weight._local_tensor is not old
        x, y = global_batch(step)
        for m, opt in zip((sharded, plain), opts):
            loss_of(m(x), y).backward()
            opt.step()
            opt.zero_grad()
        for a, b in zip(sharded.parameters(), plain.parameters()):
            assert torch.equal(a.to_local(), b), step
    state = opts[0].state[sharded[0].weight]
    assert type(state["exp_avg"]).__name__ == "DTensor" and int(state["step"]) == 4
    assert torch.equal(state["exp_avg"].to_local(), opts[1].state[plain[0].weight]["exp_avg"])


@pytest.mark.parametrize("mode,state_dtype,kind", [
    ("split", torch.bfloat16, "adamw"), ("kahan", torch.bfloat16, "adamw"),
    ("stochastic", torch.bfloat16, "adamw"), ("split8", torch.bfloat16, "adamw"),
    ("split8", torch.int8, "adamw"), (True, torch.int8, "adamw"), ("split8", torch.int8, "sgd")])
def test_one_rank_weight_stores_equal_plain_tensors(one_rank_mesh, mode, state_dtype, kind):
    """The compact weight stores and moments on FSDP2's DTensor parameters (a BF16 model
    sharded as it is): on one rank the same bits as on plain tensors, state included; 8-bit
    moments' and momentum buffers' scales are DTensors of the parameter's scales shape."""
    from fsdp_worker import global_batch, loss_of, make_model, shard

    def bf16_model():
        return fusedamp.convert_module(make_model(), torch.bfloat16)

    sharded = shard(bf16_model(), one_rank_mesh, None)
    plain = bf16_model()
    start = [p.detach().clone() for p in plain.parameters()]
    if kind == "adamw":
        opts = [fusedamp.optim.AdamW(m.parameters(), lr=1e-3, master_weights=mode,
                                     state_dtype=state_dtype, rounding_seed=3)
                for m in (sharded, plain)]
    else:
        opts = [fusedamp.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, master_weights=mode,
                                   state_dtype=state_dtype) for m in (sharded, plain)]
    for step in range(4):
        x, y = global_batch(step)
        for m, opt in zip((sharded, plain), opts):
            loss_of(m(x.bfloat16()), y).backward()
            opt.step()
            opt.zero_grad()
        for a, b in zip(sharded.parameters(), plain.parameters()):
            assert torch.equal(a.to_local(), b), step
    assert not torch.equal(plain[0].weight, start[0])  # the steps moved the weights
    for weight, plain_weight in zip(sharded.parameters(), plain.parameters()):
        assert weight.to_local().dtype == plain_weight.dtype  # convert_module keeps norms FP32
        state, plain_state = opts[0].state[weight], opts[1].state[plain_weight]
        assert state.keys() == plain_state.keys()
        for key, value in plain_state.items():
            mine = state[key].to_local() if hasattr(state[key], "to_local") else state[key]
            assert mine.dtype == value.dtype and torch.equal(mine, value), key
        moment = torch.int8 if state_dtype == torch.int8 else torch.bfloat16
        first, scales = (("exp_avg", "moment_scales") if kind == "adamw"
                         else ("momentum_buffer", "momentum_scales"))
        assert state[first].to_local().dtype == moment
        if state_dtype == torch.int8:
            shape_of = getattr(fusedamp._C, scales + "_shape")
            assert list(state[scales].shape) == shape_of(plain_weight)
        store = {"split": "param_remainder", "split8": "param_remainder",
                 "kahan": "kahan_compensation"}.get(mode, "step")
        assert store in state or plain_weight.dtype == torch.float32
    assert sharded[0].weight.to_local().dtype == torch.bfloat16


def test_int8_moments_on_unaligned_dtensor_parameters_are_refused_changing_nothing(one_rank_mesh):
    """8-bit moments' blocks follow each parameter's own elements: a DTensor parameter whose
    shards would not hold whole blocks (here sharded on dim 1) is refused, at construction and
    when a group is switched to int8, before anything changes. (Dim-0 shards over two and three
    ranks: fsdp_checkpoint_worker.)"""
    from torch.distributed.tensor import Shard, distribute_tensor

    param = torch.nn.Parameter(distribute_tensor(torch.randn(4, 40), one_rank_mesh, [Shard(1)]))
    with pytest.raises(ValueError, match="not whole blocks"):
        fusedamp.optim.AdamW([param], lr=1e-3, state_dtype=torch.int8)
    opt = fusedamp.optim.AdamW([param], lr=1e-3)
    param.grad = distribute_tensor(torch.randn(4, 40), one_rank_mesh, [Shard(1)])
    opt.step()
    weight = param.to_local().clone()
    moment = opt.state[param]["exp_avg"].to_local().clone()
    opt.param_groups[0]["state_dtype"] = torch.int8
    with pytest.raises(ValueError, match="not whole blocks"):
        opt.step()
    assert torch.equal(param.to_local(), weight)
    assert torch.equal(opt.state[param]["exp_avg"].to_local(), moment)


def test_one_rank_int8_checkpoint_with_flat_scales_resumes_on_dtensor_parameters(one_rank_mesh):
    """A plain-tensor checkpoint of 8-bit moments whose scales are flat [blocks, 2] (the same
    blocks, in an older layout) loads into FSDP2's DTensor parameters: the scales take the
    parameter's scales shape ([rows, row / 32, 2] for the weight), and the run continues bit
    for bit as the plain optimizer's own."""
    from fsdp_worker import shard

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 4), torch.nn.LayerNorm(4),
                                   torch.nn.GELU(), torch.nn.Linear(4, 2))

    x, y = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)), torch.randn(8, 2)

    def step(m, opt):
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()

    plain = model()
    opt = fusedamp.optim.AdamW(plain.parameters(), lr=1e-2, state_dtype=torch.int8)
    for _ in range(2):
        step(plain, opt)
    saved = opt.state_dict()
    for s in saved["state"].values():
        s["moment_scales"] = s["moment_scales"].reshape(-1, 2).clone()
    assert saved["state"][0]["moment_scales"].shape == (8, 2)  # the weight's [4, 2, 2], flat

    sharded = shard(model(), one_rank_mesh, None)
    with torch.no_grad():
        for a, b in zip(sharded.parameters(), plain.parameters()):
            a.to_local().copy_(b)
    resumed = fusedamp.optim.AdamW(sharded.parameters(), lr=1e-2, state_dtype=torch.int8)
    resumed.load_state_dict(saved)
    weight = sharded[0].weight
    assert tuple(resumed.state[weight]["moment_scales"].shape) == (4, 2, 2)
    for _ in range(2):
        step(plain, opt)
        step(sharded, resumed)
    for a, b in zip(sharded.parameters(), plain.parameters()):
        assert torch.equal(a.to_local(), b)
        for key, value in opt.state[b].items():
            mine = resumed.state[a][key]
            mine = mine.to_local() if hasattr(mine, "to_local") else mine
            assert mine.shape == value.shape and torch.equal(mine, value), key
