"""fusedamp's optimizers under ZeRO stage 1 on 2 and 3 Gloo ranks (launched as
test_distributed.py launches its ranks; zero_worker.py runs on each): torch's
ZeroRedundancyOptimizer with fusedamp.distributed.ZeroRedundancyOptimizer's additions, against
single-process fusedamp.optim on the same gradients.

Numerics: on the gradients of the whole batch (the same on every rank) each element's update
is the one-process update, so every master mode except stochastic rounding (which draws per
parameter position, and a partition renumbers the parameters) is bit-identical. With clipping
the global norm is summed from the partitions' FP32 sums of squares (in FP64): it may differ
from one process's FP32 sum in its last bit, so weights agree to one BF16 rounding.
"""
import os

import pytest
import torch

import fusedamp
from distributed_worker import MODE_ADAM, STEPS, make_model, mode_name
from test_distributed import _launch
from zero_worker import (CLIPPED_SGD, INF_STEP, NAN_STEP, RESUME_STEPS, SGD_INT8, ZERO_MODES,
                         one_dtype_model, whole_batch_grads)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero_worker.py")
WORLDS = (2, 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{world: per-rank results}; the 3 ranks resume the 2 ranks' consolidated checkpoint."""
    two = str(tmp_path_factory.mktemp("zero2"))
    out = {2: _launch(2, "gloo", two, worker=WORKER)}
    out[3] = _launch(3, "gloo", str(tmp_path_factory.mktemp("zero3")), load_path=two,
                     worker=WORKER)
    out["checkpoint"] = torch.load(os.path.join(two, "checkpoint.pt"), weights_only=False)
    return out


def one_process(steps=STEPS, first=0, nan_step=None, checkpoint=None,
                model_fn=lambda: make_model("cpu", torch.bfloat16),
                optimizer_class=fusedamp.optim.AdamW, **options):
    """A fusedamp optimizer (AdamW with MODE_ADAM and `options`, or SGD with `options`) on one
    thread over the same whole-batch gradients."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if optimizer_class is fusedamp.optim.AdamW:
        options = dict(MODE_ADAM, **options)
    try:
        model = model_fn()
        opt = optimizer_class(model.parameters(), **options)
        if checkpoint is not None:
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["optimizer"])
        params = []
        for step in range(first, first + steps):
            whole_batch_grads(model, step)
            if step == nan_step:
                model[0].weight.grad[1, 2] = float("nan")
            opt.step()
            params.append([p.detach().clone() for p in model.parameters()])
    finally:
        torch.set_num_threads(threads)
    return params, opt, model


def _ranks_identical(results, get):
    for r in results[1:]:
        for a, b in zip(get(r), get(results[0])):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def _same(a, b):
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b or (a != a and b != b)


def _max_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("world", WORLDS)
def test_sgd_int8_momentum_matches_one_process_bit_for_bit(runs, world):
    """SGD's 8-bit momentum buffer (blocks in each parameter's own elements) and 24-bit masters
    under ZeRO-1: every step's weights and the consolidated state are one process's."""
    results = runs[world]
    _ranks_identical(results, lambda r: r["sgd_int8"]["params"])
    mine = results[0]["sgd_int8"]
    ref_params, ref_opt, _ = one_process(optimizer_class=fusedamp.optim.SGD, **SGD_INT8)
    for step, (a, b) in enumerate(zip(mine["params"], ref_params)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), step
    full, ref_state = mine["full"]["state"], ref_opt.state_dict()["state"]
    assert full.keys() == ref_state.keys()
    for i, s in ref_state.items():
        assert full[i].keys() == s.keys() and "momentum_scales" in s
        for key, v in s.items():
            assert full[i][key].dtype == v.dtype and torch.equal(full[i][key], v), (i, key)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode,state_dtype", ZERO_MODES,
                         ids=[mode_name(*m) for m in ZERO_MODES])
def test_every_mode_matches_one_process_bit_for_bit(runs, world, mode, state_dtype):
    results = runs[world]
    name = mode_name(mode, state_dtype)
    _ranks_identical(results, lambda r: r["modes"][name]["params"])
    mine = results[0]["modes"][name]
    ref_params, ref_opt, ref_model = one_process(master_weights=mode, state_dtype=state_dtype)
    if mode == "stochastic":
        for a, b in zip(mine["params"][-1], ref_params[-1]):
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -5, atol=1e-3)
        return
    for step, (a, b) in enumerate(zip(mine["params"], ref_params)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), step
    full, ref_state = mine["full"]["state"], ref_opt.state_dict()["state"]
    assert full.keys() == ref_state.keys()
    for i, s in ref_state.items():
        assert full[i].keys() == s.keys()
        for key, v in s.items():
            assert full[i][key].dtype == v.dtype and torch.equal(full[i][key], v), (i, key)
    # The FP32 model behind the run, gathered from the partitions, is one process's.
    ref_export = fusedamp.master_weights(ref_model, ref_opt)
    for r in results:
        export = r["modes"][name]["export"]
        assert export.keys() == ref_export.keys()
        for key, value in ref_export.items():
            assert export[key].dtype == torch.float32 and torch.equal(export[key], value), key
    # The partitions hold the state once between them.
    ref_bytes = fusedamp.distributed.optimizer_state_bytes(ref_opt)
    assert sum(r["modes"][name]["state_bytes"] for r in results) == ref_bytes
    assert max(r["modes"][name]["state_bytes"] for r in results) < ref_bytes


@pytest.mark.parametrize("world", WORLDS)
def test_clipping_uses_the_norm_of_all_gradients(runs, world, record_diff):
    """SGD, every step clipped: fusedamp's ZeRO matches one process to a BF16 rounding; torch's
    class over the same optimizer clips each partition by its own norm and drifts away."""
    results = runs[world]
    _ranks_identical(results, lambda r: r["clipped"])
    ref, _, _ = one_process(model_fn=one_dtype_model, optimizer_class=fusedamp.optim.SGD,
                         **CLIPPED_SGD)
    mine = _max_diff(results[0]["clipped"][-1], ref[-1])
    theirs = _max_diff(results[0]["clipped_torch"][-1], ref[-1])
    record_diff(f"zero: clipped SGD {world} ranks vs 1 process (params)", mine)
    assert mine <= 2 ** -7 and theirs > 8 * max(mine, 2 ** -9), (mine, theirs)


@pytest.mark.parametrize("world", WORLDS)
def test_a_nonfinite_gradient_skips_the_step_on_every_rank(runs, world):
    """A NaN in one element (one rank's partition): fusedamp's ZeRO skips the whole step, as
    one process does; torch's class skips only the partition that holds it."""
    results = runs[world]
    _ranks_identical(results, lambda r: r["nan"])
    mine, theirs = results[0]["nan"], results[0]["nan_torch"]
    assert all(torch.equal(a, b) for a, b in zip(mine[NAN_STEP], mine[NAN_STEP - 1]))
    assert not all(torch.equal(a, b) for a, b in zip(theirs[NAN_STEP], theirs[NAN_STEP - 1]))
    assert not all(torch.equal(a, b) for a, b in zip(mine[NAN_STEP + 1], mine[NAN_STEP]))
    ref, _, _ = one_process(nan_step=NAN_STEP, model_fn=one_dtype_model,
                         optimizer_class=fusedamp.optim.SGD, **CLIPPED_SGD)
    assert _max_diff(mine[-1], ref[-1]) <= 2 ** -7


@pytest.mark.parametrize("world", WORLDS)
def test_ddp_with_the_scaler_skips_and_scales_alike(runs, world):
    """FP16 DDP + fusedamp.GradScaler: the step takes the scaler's grad_scale/found_inf (no
    host sync); an inf loss on the last rank skips every rank; the scaler's record (of every
    gradient, which every rank holds) is the same on every rank."""
    results = runs[world]
    runs_ = [r["ddp_scaler"] for r in results]
    for r in runs_[1:]:
        assert r["applied"] == runs_[0]["applied"] and r["scales"] == runs_[0]["scales"]
        for key, column in runs_[0]["telemetry"].items():  # NaN: the overflowing step's norm
            assert _same(r["telemetry"][key], column), key
        assert all(torch.equal(a, b) for a, b in zip(r["params"], runs_[0]["params"]))
    run = runs_[0]
    assert run["applied"][INF_STEP] == 0.0 and run["skipped_steps"] == run["applied"].count(0.0)
    assert run["scales"][INF_STEP] == run["scales"][INF_STEP - 1] / 2
    assert run["telemetry"]["found_inf"][INF_STEP]
    for k, facts in enumerate(run["measured"]):  # against the gradients, measured apart
        if not run["telemetry"]["found_inf"][k]:
            for key, value in facts.items():
                assert run["telemetry"][key][k] == pytest.approx(value, abs=1e-15), (key, k)
    assert run["telemetry"]["amax"][0] > 0


def test_a_checkpoint_of_two_ranks_continues_on_three_bit_for_bit(runs):
    """A consolidated checkpoint written by 2 ranks (torch's ZeRO format), loaded by 3 (each
    takes its new partition) and by one process: the loaded state is the saved one, and the
    continued steps are bit-identical."""
    checkpoint = runs["checkpoint"]
    saved = checkpoint["optimizer"]["state"]
    loaded = {}
    for r in runs[3]:
        assert not loaded.keys() & r["resumed"]["loaded"].keys()  # each in one partition
        loaded.update(r["resumed"]["loaded"])
    assert loaded.keys() == saved.keys() and len(saved) == len(checkpoint["model"])
    for i, s in saved.items():
        mine = loaded[i]
        assert mine.keys() == s.keys() and all(torch.equal(mine[k], v) for k, v in s.items())
    ref, _, _ = one_process(steps=RESUME_STEPS, first=STEPS, checkpoint=checkpoint)
    _ranks_identical(runs[3], lambda r: r["resumed"]["params"])
    for a, b in zip(runs[3][0]["resumed"]["params"], ref):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("world", WORLDS)
def test_torch_zero_load_state_dict_reaches_the_fused_optimizer(runs, world):
    assert all(r["torch_zero_load_keeps_state"] for r in runs[world])


def test_a_torch_optimizer_class_is_refused(runs):
    error = runs[2][0]["torch_class_error"]
    assert error is not None and "fusedamp.optim" in error
