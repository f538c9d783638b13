"""The optimizers under the master-weight modes: BF16 weights that round-to-nearest AdamW never
moves reach the FP32 run under True, "split", "kahan" and "stochastic"; "split" keeps the FP32
master bit for bit while a model trains; "stochastic" resumes bit-identically from a
checkpoint; how a mode is chosen (its names, what is refused, fusedamp.initialize). Every test
runs on every device."""
import copy

import pytest
import torch
from torch import nn

import fusedamp
from master_mode_helpers import bf16_mlp, combine_reference, is_halfway


def _regression(device, dtype, seed=0):
    """y = X w* with w* = 1.1 everywhere, from w = 1: Adam's step (about lr) is far below half
    a BF16 ulp at 1 (2^-8 = 0.0039), so round to nearest never moves the weights."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 64, generator=gen).to(device)
    y = x @ torch.full((64,), 1.1, device=device)
    w = nn.Parameter(torch.ones(64, device=device, dtype=dtype))
    return x, y, w


def _train_regression(device, dtype, make_opt, steps=600):
    x, y, w = _regression(device, dtype)
    opt = make_opt([w])
    for _ in range(steps):
        opt.zero_grad()
        loss = ((x.to(dtype) @ w).float() - y).pow(2).mean()
        loss.backward()
        opt.step()
    return w.detach().float()


@pytest.mark.parametrize("mode", [True, "split", "kahan", "stochastic"])
def test_stale_weights_master_modes_reach_the_fp32_result(device, mode):
    """Plain BF16 AdamW does not move (every update is below half an ulp); True, split and
    kahan end within one BF16 ulp at 1.08 (2^-7 = 0.0078) of the FP32 run, which moved 0.08;
    stochastic within half an ulp on average.
    The tolerance is the weights' own resolution: the forward runs on the BF16 weights, so the
    gradients (and the trajectory) differ from the FP32 run by that rounding."""
    lr = 2e-4
    fp32 = _train_regression(device, torch.float32,
                             lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.0))
    plain = _train_regression(device, torch.bfloat16,
                              lambda p: fusedamp.optim.AdamW(p, lr=lr, weight_decay=0.0,
                                                             master_weights=False))
    kept = _train_regression(device, torch.bfloat16,
                             lambda p: fusedamp.optim.AdamW(p, lr=lr, weight_decay=0.0,
                                                            master_weights=mode,
                                                            rounding_seed=5))
    assert float((fp32 - 1.0).abs().min()) > 0.05  # the FP32 run did move (about 0.08)
    assert bool((plain == 1.0).all())              # round to nearest: stuck
    if mode == "stochastic":
        # Unbiased, not exact: each weight walks by whole ulps at random around the FP32 run,
        # so the bound is on the average over the 64 weights (half an ulp), and loosely on each.
        assert abs(float(kept.mean() - fp32.mean())) <= 2 ** -8
        assert float((kept - fp32).abs().max()) <= 8 * 2 ** -7
    else:
        assert float((kept - fp32).abs().max()) <= 2 ** -7, (kept - fp32).abs().max()


def test_split_optimizer_tracks_fp32_masters_on_a_model(device):
    """Teacher-forced: the same gradients into master_weights=True and "split" optimizers for
    300 steps of an MLP: masters rebuilt from weight + remainder equal the FP32 masters bit for
    bit every step; the weights differ only at halfway masters."""
    model_a = bf16_mlp(device)
    model_b = copy.deepcopy(model_a)
    opt_a = fusedamp.optim.AdamW(model_a.parameters(), lr=1e-2)
    opt_b = fusedamp.optim.AdamW(model_b.parameters(), lr=1e-2, master_weights="split")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=gen).to(device, torch.bfloat16)
    target = torch.randn(64, 4, generator=gen).to(device)
    for step in range(300):
        opt_a.zero_grad()
        ((model_a(x).float() - target) ** 2).mean().backward()
        for pa, pb in zip(model_a.parameters(), model_b.parameters()):
            pb.grad = pa.grad.clone()
        opt_a.step()
        opt_b.step()
        for pa, pb in zip(model_a.parameters(), model_b.parameters()):
            master = opt_a.state[pa]["master_param"]
            rebuilt = combine_reference(pb.detach(), opt_b.state[pb]["param_remainder"])
            assert torch.equal(rebuilt.view(torch.int32), master.view(torch.int32)), step
            assert bool(((pa != pb) <= is_halfway(master)).all())


def test_stochastic_optimizer_resumes_bit_identically(device):
    def run(resume_at=None, steps=6):
        model = bf16_mlp(device, seed=3)
        opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3, master_weights="stochastic",
                                   rounding_seed=123, state_dtype=torch.bfloat16)
        x = torch.randn(8, 16, device=device, dtype=torch.bfloat16,
                        generator=torch.Generator(device).manual_seed(0))
        for step in range(steps):
            if step == resume_at:
                saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
                model = bf16_mlp(device, seed=99)
                opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3,
                                           master_weights="stochastic", rounding_seed=123,
                                           state_dtype=torch.bfloat16)
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    straight = run()
    resumed = run(resume_at=3)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(straight, resumed))


def test_optimizer_mode_checks(device):
    w16 = nn.Parameter(torch.ones(4, device=device, dtype=torch.float16))
    with pytest.raises(ValueError, match="master_weights must be"):
        fusedamp.optim.AdamW([w16], master_weights="bogus")
    with pytest.raises(ValueError, match="master_weights must be"):
        fusedamp.optim.AdamW([w16], master_weights=2)
    with pytest.raises(ValueError, match="state_dtype"):
        fusedamp.optim.AdamW([w16], state_dtype=torch.float16)
    opt = fusedamp.optim.SGD([w16], lr=0.1, master_weights="split")
    w16.grad = torch.ones_like(w16)
    with pytest.raises(ValueError, match="keeps bfloat16 weights"):
        opt.step()
    assert bool((w16 == 1).all()) and not opt.state
    # Kahan works for FP16 weights; the state is the compensation, of the weight's dtype.
    opt = fusedamp.optim.SGD([w16], lr=0.1, master_weights="kahan", momentum=0.9,
                             state_dtype=torch.bfloat16)
    opt.step()
    state = opt.state[w16]
    assert state["kahan_compensation"].dtype == torch.float16
    assert state["momentum_buffer"].dtype == torch.bfloat16
    assert "master_param" not in state


def test_initialize_passes_the_modes_and_refuses_a_misfit_first(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)).to(device)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="keeps bfloat16 weights"):
        fusedamp.initialize(model, opt, dtype=torch.float16, master_weights="split")
    assert all(p.dtype == torch.float32 and torch.equal(p, before[n])
               for n, p in model.named_parameters())
    model, fused, _ = fusedamp.initialize(model, opt, dtype=torch.bfloat16,
                                          master_weights="split", state_dtype=torch.bfloat16)
    assert all(g["master_weights"] == "split" and g["state_dtype"] == torch.bfloat16
               for g in fused.param_groups)
    model(torch.randn(4, 8, device=device)).sum().backward()
    fused.step()
    linear = model[0].weight
    assert set(fused.state[linear]) == {"step", "param_remainder", "exp_avg", "exp_avg_sq"}
    assert fused.state[linear]["exp_avg"].dtype == torch.bfloat16
    norm = model[1].weight  # FP32: its own master, nothing kept
    assert "param_remainder" not in fused.state[norm]


@pytest.mark.parametrize("name,same_as", [("fp32", True), ("float32", True), ("off", False)])
def test_master_weight_mode_names_are_aliases(device, name, same_as):
    """The documented names of True and False: the same state and the same weights."""
    def run(mode):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, device=device).to(torch.bfloat16))
        opt = fusedamp.optim.AdamW([p], lr=1e-2, master_weights=mode)
        for step in range(3):
            p.grad = torch.randn(64, generator=torch.Generator().manual_seed(step)).to(
                device, torch.bfloat16)
            opt.step()
        return p.detach().clone(), sorted(opt.state[p])

    assert_equal_runs = run(name), run(same_as)
    (w_a, keys_a), (w_b, keys_b) = assert_equal_runs
    assert torch.equal(w_a, w_b) and keys_a == keys_b


def test_an_unknown_master_weight_mode_is_refused():
    with pytest.raises(ValueError, match="master_weights must be"):
        fusedamp.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], master_weights="float64")
