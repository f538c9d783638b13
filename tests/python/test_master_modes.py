"""Master weights for less: "split" (BF16 weight + int16 remainder = the FP32 master), "kahan"
(16-bit compensation), "stochastic" (stochastic rounding, counter-based) and BF16 optimizer
state, in the fused Adam/AdamW, SGD and Lion steps. Every test runs on every device.

References are independent of the kernels: the split pair is rebuilt here from bit patterns
with torch integer ops, and the FP32 master run is fusedamp's master_weights=True (itself
tested against torch.optim in test_ops / test_torch_optim_parity)."""
import copy

import pytest
import torch
from torch import nn

import fusedamp

ops = torch.ops.fusedamp


# ---- independent references ----------------------------------------------------------------

def combine_reference(weight_bf16, remainder_int16):
    """The FP32 master a split pair holds: weight pattern * 2^16 + remainder (torch int ops)."""
    high = weight_bf16.contiguous().view(torch.int16).to(torch.int32) << 16
    return (high + remainder_int16.to(torch.int32)).view(torch.float32)


def is_halfway(master_fp32):
    """Masters whose lower 16 bits are 0x8000: exactly halfway between two BF16 values."""
    return (master_fp32.contiguous().view(torch.int32) & 0xFFFF) == 0x8000


def _adam_kwargs(**over):
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
              decoupled_weight_decay=True)
    kw.update(over)
    return kw


def _random_lists(device, n_tensors=3, numel=513, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(numel + 7 * i,) for i in range(n_tensors)]
    params = [torch.randn(s, generator=gen).to(device, torch.bfloat16) for s in shapes]
    return params, shapes, gen


# ---- op level ------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ["adam", "sgd", "lion"])
def test_split_pair_is_the_fp32_master_bit_for_bit(device, algorithm):
    """The same gradients into master_weights=True and "split": the split pair rebuilds the
    FP32 master bit for bit at every step, and the weights are equal except where the master
    lies exactly halfway (there the split weight is one BF16 ulp larger in magnitude)."""
    params, shapes, gen = _random_lists(device)
    fp32_params = [p.clone() for p in params]
    masters = [p.float() for p in params]
    split_params = [p.clone() for p in params]
    remainders = [torch.zeros(s, dtype=torch.int16, device=device) for s in shapes]
    if algorithm == "adam":
        state_a = [[torch.zeros(s, device=device) for s in shapes] for _ in range(2)]
        state_b = [[torch.zeros(s, device=device) for s in shapes] for _ in range(2)]
    else:
        state_a = [[torch.zeros(s, device=device) for s in shapes]]
        state_b = [[torch.zeros(s, device=device) for s in shapes]]
    steps_a = [torch.zeros((), device=device) for _ in shapes]
    steps_b = [torch.zeros((), device=device) for _ in shapes]
    halfway_seen = 0
    for step in range(60):
        grads = [(torch.randn(s, generator=gen) * 10).to(device, torch.bfloat16) for s in shapes]
        if algorithm == "adam":
            ops.adam_step_(fp32_params, masters, [g.clone() for g in grads], *state_a, steps_a,
                           **_adam_kwargs(lr=3e-2))
            ops.adam_step_(split_params, remainders, [g.clone() for g in grads], *state_b,
                           steps_b, **_adam_kwargs(lr=3e-2))
        else:
            op, kw = ((ops.sgd_step_, dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=1e-3,
                                           nesterov=True)) if algorithm == "sgd" else
                      (ops.lion_step_, dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1)))
            op(fp32_params, masters, [g.clone() for g in grads], *state_a, steps_a, **kw)
            op(split_params, remainders, [g.clone() for g in grads], *state_b, steps_b, **kw)
        for m, w, r, w_fp32 in zip(masters, split_params, remainders, fp32_params):
            rebuilt = combine_reference(w, r)
            assert torch.equal(rebuilt.view(torch.int32), m.view(torch.int32)), step
            differs = w.view(torch.int16) != w_fp32.view(torch.int16)
            halfway = is_halfway(m)
            assert bool((differs <= halfway).all()), "weights differ away from a halfway master"
            # Where they differ, the split weight is the rounding away from zero.
            assert torch.equal(w[differs].float().abs(),
                               (w_fp32[differs].float().abs().view(torch.int32) + 0x10000)
                               .view(torch.float32)) if bool(differs.any()) else True
            halfway_seen += int(halfway.sum())
        for a, b in zip(state_a, state_b):
            for x, y in zip(a, b):
                assert torch.equal(x, y)
    assert all(torch.equal(a, b) for a, b in zip(steps_a, steps_b))


def test_split_rounding_of_halfway_and_special_values(device):
    """Halfway masters round away from zero; 0, ±inf, NaN and the largest finite values
    survive the pair; a weight zeroed by the user (stale remainder) stays exactly zero."""
    halfway = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000 - 2**32], dtype=torch.int32)
    specials = torch.tensor([0.0, float("inf"), float("-inf"), 3.3895314e38,
                             -3.3895314e38, 1e-40, -1e-40])
    masters = torch.cat([halfway.view(torch.float32), specials]).to(device)
    n = masters.numel()
    params = [torch.zeros(n, dtype=torch.bfloat16, device=device)]
    remainders = [torch.zeros(n, dtype=torch.int16, device=device)]
    # Install the masters: one SGD step of lr 0 from weight 0 adds nothing, so instead set the
    # pair through a step that starts from the masters: w = 0, remainder 0, grad = -master, lr 1.
    grads = [(-masters).to(torch.float32)]
    steps = [torch.zeros((), device=device)]
    ops.sgd_step_(params, remainders, grads, [], steps, lr=1.0, momentum=0.0, dampening=0.0,
                  weight_decay=0.0, nesterov=False)
    rebuilt = combine_reference(params[0], remainders[0])
    finite = torch.isfinite(masters)
    assert torch.equal(rebuilt[finite].view(torch.int32), masters[finite].view(torch.int32))
    assert torch.equal(rebuilt[~finite], masters[~finite])
    # Halfway: magnitude rounded up (ties away from zero), not to even.
    w = params[0][:3].float().cpu()
    assert w.tolist() == [1.0078125, 1.015625, -1.0078125]
    # A pruned weight (zeroed by the user) with a negative stale remainder: exactly zero.
    params[0].zero_()
    remainders[0].fill_(-5)
    steps = [torch.zeros((), device=device)]
    ops.sgd_step_(params, remainders, [torch.zeros(n, device=device)], [], steps, lr=1.0,
                  momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)
    assert torch.equal(params[0].view(torch.int16), torch.zeros_like(params[0]).view(torch.int16))
    assert bool((remainders[0] == 0).all())


def _stochastic_sgd(device, seed, numel=100_000, steps=1, lr=2.0 ** -9):
    """Weights 1.0 pushed up by lr per step (a quarter of a BF16 ulp at 1 for the default)."""
    params = [torch.ones(numel, dtype=torch.bfloat16, device=device)]
    counts = [torch.zeros((), device=device)]
    for _ in range(steps):
        ops.sgd_step_(params, [], [torch.full((numel,), -1.0, device=device)], [], counts,
                      lr=lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                      rounding_seeds=[seed])
    return params[0]


def test_stochastic_rounding_is_unbiased_and_reproducible(device):
    up = _stochastic_sgd(device, seed=7)
    values = set(up.float().unique().cpu().tolist())
    assert values <= {1.0, 1.0078125}
    # P(round up) = (2^-9) / (2^-7) = 0.25; 100,000 draws: standard deviation 0.0014.
    fraction_up = float((up.float() > 1.0).float().mean())
    assert abs(fraction_up - 0.25) < 0.01, fraction_up
    assert torch.equal(up, _stochastic_sgd(device, seed=7))  # same seed: same bits
    assert not torch.equal(up, _stochastic_sgd(device, seed=8))
    # Many sub-ulp steps: the mean follows the FP32 sum (1 + 64 * 2^-12 = 1.015625).
    walked = _stochastic_sgd(device, seed=3, numel=20_000, steps=64, lr=2.0 ** -12)
    assert abs(float(walked.float().mean()) - 1.015625) < 1e-3
    plain = [torch.ones(20_000, dtype=torch.bfloat16, device=device)]
    counts = [torch.zeros((), device=device)]
    for _ in range(64):
        ops.sgd_step_(plain, [], [torch.full((20_000,), -1.0, device=device)], [], counts,
                      lr=2.0 ** -12, momentum=0.0, dampening=0.0, weight_decay=0.0,
                      nesterov=False)
    assert bool((plain[0] == 1.0).all())  # round to nearest: every update lost


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (compares CPU and CUDA)")
def test_stochastic_rounding_same_bits_on_cpu_and_cuda():
    cpu = _stochastic_sgd("cpu", seed=11, numel=70_001, steps=3)
    gpu = _stochastic_sgd("cuda", seed=11, numel=70_001, steps=3)
    assert torch.equal(cpu.view(torch.int16), gpu.cpu().view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kahan_keeps_sub_ulp_updates(device, dtype):
    """64 updates of 1/16 ulp each: round to nearest loses all of them; the Kahan pair reaches
    the FP32 sum exactly (1 + 2^-6 for BF16, representable)."""
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    lr = ulp / 16
    params = [torch.ones(1000, dtype=dtype, device=device)]
    comps = [torch.zeros(1000, dtype=dtype, device=device)]
    counts = [torch.zeros((), device=device)]
    for _ in range(64):
        ops.sgd_step_(params, comps, [torch.full((1000,), -1.0, device=device)], [], counts,
                      lr=lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)
    assert bool((params[0].float() == 1.0 + 4 * ulp).all())
    # An edited weight drops its stale compensation: the step starts from the weight.
    comps[0].fill_(ulp / 4)
    params[0].fill_(0.0)
    ops.sgd_step_(params, comps, [torch.zeros(1000, device=device)], [], counts, lr=lr,
                  momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)
    assert bool((params[0] == 0).all()) and bool((comps[0] == 0).all())


@pytest.mark.parametrize("mode", ["fp32", "split", "kahan", "stochastic", "none"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_skipped_step_changes_nothing_in_any_mode(device, mode, state_dtype):
    params, shapes, gen = _random_lists(device, n_tensors=2, numel=300, seed=4)
    masters = {"fp32": [p.float() for p in params],
               "split": [torch.randint(-300, 300, s, dtype=torch.int16, generator=gen).to(device)
                         for s in shapes],
               "kahan": [(torch.randn(s, generator=gen) * 1e-3).to(device, torch.bfloat16)
                         for s in shapes]}.get(mode, [])
    state = [[torch.rand(s, generator=gen).to(device, state_dtype) for s in shapes]
             for _ in range(2)]
    steps = [torch.full((), 3.0, device=device) for _ in shapes]
    before = [t.clone() for t in params + masters + state[0] + state[1] + steps]
    seeds = [1, 2] if mode == "stochastic" else None
    ops.adam_step_(params, masters, [torch.randn(s).to(device, torch.bfloat16) for s in shapes],
                   *state, steps, **_adam_kwargs(), found_inf=torch.ones(1, device=device),
                   rounding_seeds=seeds)
    after = params + masters + state[0] + state[1] + steps
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_bf16_moments_follow_the_fp32_formula(device):
    """state_dtype=bfloat16: each step is the FP32 update from the stored BF16 moments (the
    update uses the new moments in FP32), which are then stored rounded to nearest (reference:
    torch ops in FP32 with that rounding)."""
    params, shapes, gen = _random_lists(device, n_tensors=2, numel=400, seed=5)
    masters = [p.float() for p in params]
    m = [torch.zeros(s, dtype=torch.bfloat16, device=device) for s in shapes]
    v = [torch.zeros(s, dtype=torch.bfloat16, device=device) for s in shapes]
    steps = [torch.zeros((), device=device) for _ in shapes]
    ref_p = [x.clone() for x in masters]
    ref_m = [x.float() for x in m]
    ref_v = [x.float() for x in v]
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.0
    for t in range(1, 11):
        grads = [torch.randn(s, generator=gen).to(device, torch.bfloat16) for s in shapes]
        ops.adam_step_(params, masters, grads, m, v, steps, **_adam_kwargs(lr=lr, weight_decay=wd))
        for i, g in enumerate(grads):
            g = g.float()
            new_m = ref_m[i] + (1 - b1) * (g - ref_m[i])
            new_v = ref_v[i] * b2 + (1 - b2) * g * g
            denom = (new_v.sqrt() / (1 - b2 ** t) ** 0.5) + eps
            ref_p[i] = ref_p[i] - (lr / (1 - b1 ** t)) * new_m / denom
            ref_m[i], ref_v[i] = new_m.bfloat16().float(), new_v.bfloat16().float()
    for i in range(len(shapes)):
        assert torch.allclose(m[i].float(), ref_m[i], rtol=2 ** -7, atol=0)
        assert torch.allclose(v[i].float(), ref_v[i], rtol=2 ** -7, atol=0)
        torch.testing.assert_close(masters[i], ref_p[i], rtol=1e-5, atol=1e-6)


def test_bad_weight_stores_are_refused_and_change_nothing(device):
    half = [torch.ones(8, dtype=torch.float16, device=device)]
    bf16 = [torch.ones(8, dtype=torch.bfloat16, device=device)]
    grads16 = [torch.ones(8, dtype=torch.float16, device=device)]
    steps = [torch.zeros((), device=device)]
    kw = dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)
    with pytest.raises(RuntimeError, match="int16"):  # remainders need bfloat16 params
        ops.sgd_step_(half, [torch.zeros(8, dtype=torch.int16, device=device)], grads16, [],
                      steps, **kw)
    with pytest.raises(RuntimeError, match="bfloat16 params"):
        ops.sgd_step_(half, [], grads16, [], steps, rounding_seeds=[1], **kw)
    with pytest.raises(RuntimeError, match="one seed per tensor"):
        ops.sgd_step_(bf16, [], [g.bfloat16() for g in grads16], [], steps,
                      rounding_seeds=[1, 2], **kw)
    with pytest.raises(RuntimeError, match="keeps no master_params"):
        ops.sgd_step_(bf16, [torch.zeros(8, device=device)], [g.bfloat16() for g in grads16],
                      [], steps, rounding_seeds=[1], **kw)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.sgd_step_(bf16, [], [g.bfloat16() for g in grads16],
                      [torch.zeros(8, dtype=torch.float16, device=device)], steps,
                      **dict(kw, momentum=0.9))
    assert bool((half[0] == 1).all()) and bool((bf16[0] == 1).all())
    assert float(steps[0]) == 0.0


# ---- the optimizers -------------------------------------------------------------------------

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


def _mlp_bf16(device, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(device,
                                                                           torch.bfloat16)


def test_split_optimizer_tracks_fp32_masters_on_a_model(device):
    """Teacher-forced: the same gradients into master_weights=True and "split" optimizers for
    300 steps of an MLP: masters rebuilt from weight + remainder equal the FP32 masters bit for
    bit every step; the weights differ only at halfway masters."""
    model_a = _mlp_bf16(device)
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


def test_checkpoint_converts_fp32_split_fp32_exactly(device):
    model = _mlp_bf16(device)
    x = torch.randn(8, 16, device=device, dtype=torch.bfloat16)

    def train(opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()

    def skipped_step(opt):  # builds (converts) the state, changes nothing else
        for p in model.parameters():
            p.grad = torch.full_like(p, float("inf"))
        opt.step()

    fp32_opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-2)
    train(fp32_opt, 5)
    saved = copy.deepcopy(fp32_opt.state_dict())
    split_opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-2, master_weights="split")
    split_opt.load_state_dict(saved)  # keeps the mode it was built with
    assert split_opt.param_groups[0]["master_weights"] == "split"
    skipped_step(split_opt)
    split_saved = copy.deepcopy(split_opt.state_dict())
    assert all("param_remainder" in s and "master_param" not in s
               for s in split_saved["state"].values())
    back = fusedamp.optim.AdamW(model.parameters(), lr=1e-2)
    back.load_state_dict(split_saved)
    assert back.param_groups[0]["master_weights"] is True
    skipped_step(back)
    for k, s in back.state_dict()["state"].items():
        assert torch.equal(s["master_param"].view(torch.int32),
                           saved["state"][k]["master_param"].view(torch.int32))
        assert torch.equal(s["exp_avg"], saved["state"][k]["exp_avg"])


def test_stochastic_optimizer_resumes_bit_identically(device):
    def run(resume_at=None, steps=6):
        model = _mlp_bf16(device, seed=3)
        opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3, master_weights="stochastic",
                                   rounding_seed=123, state_dtype=torch.bfloat16)
        x = torch.randn(8, 16, device=device, dtype=torch.bfloat16,
                        generator=torch.Generator(device).manual_seed(0))
        for step in range(steps):
            if step == resume_at:
                saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
                model = _mlp_bf16(device, seed=99)
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


@pytest.mark.parametrize("mode", ["split", "kahan"])
def test_fp32_export_rebuilds_the_master_of_every_mode(device, mode):
    """fusedamp.master_weights(model, optimizer) is the FP32 master whatever keeps it: the
    split pair exactly, weight + compensation for Kahan."""
    model = _mlp_bf16(device, seed=5)
    opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-2, master_weights=mode)
    x = torch.randn(8, 16, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()
    exported = fusedamp.master_weights(model, opt)
    for name, p in model.named_parameters():
        state = opt.state[p]
        if mode == "split":
            expected = combine_reference(p.detach(), state["param_remainder"])
        else:
            expected = p.detach().float() + state["kahan_compensation"].float()
        assert torch.equal(exported[name].view(torch.int32), expected.view(torch.int32)), name
        assert not torch.equal(exported[name], p.detach().float()), name  # bits below the weight


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


@pytest.mark.parametrize("weight", [1.0, 1.0078125, -3.0, 0.0])  # even, odd, negative, zero
def test_split_export_is_the_pair_for_every_remainder(device, weight):
    """fusedamp.master_weights under "split" is the stored pair (weight bits << 16 plus the
    int16 remainder) for every one of the 65,536 remainders, the ties (-32768) included, where
    the weight rounds the master with ties away from zero; below a zero weight it is the
    weight itself (math/split_math.h)."""
    model = nn.Linear(1, 65536, bias=False).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(weight)
    opt = fusedamp.optim.SGD(model.parameters(), lr=0.0, master_weights="split")
    model.weight.grad = torch.zeros_like(model.weight)
    opt.step()
    remainders = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(65536, 1)
    opt.state[model.weight]["param_remainder"].copy_(remainders.to(device))
    exported = fusedamp.master_weights(model, opt)["weight"].cpu()
    high = model.weight.detach().cpu().view(torch.int16).to(torch.int32) << 16
    want = (high + remainders.to(torch.int32)).view(torch.float32)
    if weight == 0.0:  # a remainder below zero would wrap into the other sign: the weight
        want = torch.where(remainders < 0, torch.zeros_like(want), want)
    assert torch.equal(exported.view(torch.int32), want.view(torch.int32))


_MODES = [True, False, "split", "kahan", "stochastic"]
_STORE_KEY = {True: "master_param", "split": "param_remainder", "kahan": "kahan_compensation"}


def _trained(device, mode, steps=3):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(256, device=device).to(torch.bfloat16))
    opt = fusedamp.optim.AdamW([p], lr=1e-2, master_weights=mode)
    for step in range(steps):
        p.grad = torch.randn(256, generator=torch.Generator().manual_seed(step)).to(
            device, torch.bfloat16)
        opt.step()
    return p, opt


@pytest.mark.parametrize("saved,built", [(a, b) for a in _MODES for b in _MODES if a != b],
                         ids=str)
def test_a_checkpoint_of_another_mode_takes_the_mode_the_optimizer_was_built_with(
        device, saved, built):
    """The memory the user chose stays chosen: loading a checkpoint of another master-weight
    mode keeps the optimizer's own mode and converts the state to it (FP32 master <-> split
    exactly: the same FP32 value)."""
    p_saved, opt_saved = _trained(device, saved)
    p = nn.Parameter(p_saved.detach().clone())
    opt = fusedamp.optim.AdamW([p], lr=1e-2, master_weights=built)
    opt.load_state_dict(opt_saved.state_dict())
    assert opt.param_groups[0]["master_weights"] == built
    p.grad = torch.zeros_like(p)
    with torch.no_grad():
        opt.param_groups[0]["lr"] = 0.0
    opt.step()  # converts; with lr=0 and zero grads the FP32 value stays
    store_keys = set(_STORE_KEY.values()) & set(opt.state[p])
    assert store_keys == ({_STORE_KEY[built]} if built in _STORE_KEY else set())
    if {saved, built} == {True, "split"}:
        before = fusedamp.master_weights(nn.ParameterDict({"w": p_saved}), opt_saved)["w"]
        after = fusedamp.master_weights(nn.ParameterDict({"w": p}), opt)["w"]
        assert torch.equal(before, after)
    if (saved, built) == ("kahan", True):  # the exact sum, half-ulp compensations included
        exact = (p_saved.detach().double()
                 + opt_saved.state[p_saved]["kahan_compensation"].double()).float()
        assert torch.equal(opt.state[p]["master_param"], exact)


def test_kahan_to_fp32_keeps_a_half_ulp_compensation_of_an_odd_weight(device):
    """An odd BF16 weight with a compensation of exactly half an ulp: the FP32 master made from
    the pair is the exact sum, a tie; the weight becomes its rounding (the even neighbour), so
    the step does not take the weight for an edit and drop the half ulp."""
    w = torch.tensor([1.0078125, -3.015625], dtype=torch.bfloat16, device=device)  # odd
    half_ulp = torch.tensor([2.0 ** -8, -(2.0 ** -7)], dtype=torch.bfloat16, device=device)
    p_saved = nn.Parameter(w.clone())
    opt_saved = fusedamp.optim.SGD([p_saved], lr=0.0, master_weights="kahan")
    p_saved.grad = torch.zeros_like(p_saved)
    opt_saved.step()
    opt_saved.state[p_saved]["kahan_compensation"].copy_(half_ulp)
    p = nn.Parameter(w.clone())
    opt = fusedamp.optim.SGD([p], lr=0.0, master_weights=True)
    opt.load_state_dict(opt_saved.state_dict())
    p.grad = torch.zeros_like(p)
    opt.step()
    exact = w.double() + half_ulp.double()
    assert torch.equal(opt.state[p]["master_param"].double(), exact)
    # beside an FP32 master the weight is its rounding to nearest even: the even neighbour
    assert torch.equal(p.detach(), exact.to(torch.bfloat16)) and not torch.equal(p.detach(), w)


def _kahan_pair(device, weights, compensations):
    """A BF16 parameter under "kahan" (SGD, lr=0) holding the given weight/compensation pairs."""
    p = nn.Parameter(torch.tensor(weights, device=device).to(torch.bfloat16))
    opt = fusedamp.optim.SGD([p], lr=0.0, master_weights="kahan")
    p.grad = torch.zeros_like(p)
    opt.step()
    opt.state[p]["kahan_compensation"].copy_(torch.tensor(compensations).to(torch.bfloat16))
    return p, opt


def _kahan_value(p, opt):
    return p.detach().double() + opt.state[p]["kahan_compensation"].double()


def test_kahan_edit_keeps_a_compensation_that_still_rounds_to_the_new_weight(device):
    """docs/master_weights.md: after an edit the compensation stays where the new weight is
    still the rounding of weight + compensation (under half an ulp of it), else it is dropped;
    the edited weight itself is always taken."""
    p, opt = _kahan_pair(device, [1.0, 1.0], [2.0 ** -10, 2.0 ** -10])
    with torch.no_grad():
        p[0] = 1.0078125  # nearby: 2^-10 is under half its ulp (2^-8): kept
        p[1] = 0.0078125  # small: 2^-10 is more than half its ulp (2^-15): dropped
    opt.step()  # lr=0: the value the step starts from is what it keeps
    value = _kahan_value(p, opt)
    assert value[0].item() == 1.0078125 + 2.0 ** -10
    assert value[1].item() == 0.0078125


def test_kahan_step_at_a_half_ulp_tie_moves_the_weight_not_the_value(device):
    """docs/master_weights.md: a compensation of exactly half an ulp of an odd weight is a tie;
    the step's round-to-nearest-even store moves the weight to its even neighbour and the
    compensation to the other side, even with lr=0; the value weight + compensation stays."""
    p, opt = _kahan_pair(device, [1.0078125], [2.0 ** -8])  # odd weight, half its ulp
    before = _kahan_value(p, opt)
    opt.step()
    assert p.item() == 1.015625  # the even neighbour
    assert opt.state[p]["kahan_compensation"].item() == -(2.0 ** -8)
    assert torch.equal(_kahan_value(p, opt), before)


@pytest.mark.parametrize("saved,built", [(torch.float32, torch.bfloat16),
                                         (torch.bfloat16, torch.float32)], ids=str)
def test_a_checkpoint_of_another_state_dtype_takes_the_optimizers(device, saved, built):
    """state_dtype, like master_weights, stays the optimizer's own: the loaded moments are
    converted to it at the next step."""
    p_saved = nn.Parameter(torch.randn(64, device=device).to(torch.bfloat16))
    opt_saved = fusedamp.optim.AdamW([p_saved], lr=1e-2, state_dtype=saved)
    p_saved.grad = torch.randn(64, device=device).to(torch.bfloat16)
    opt_saved.step()
    p = nn.Parameter(p_saved.detach().clone())
    opt = fusedamp.optim.AdamW([p], lr=1e-2, state_dtype=built)
    opt.load_state_dict(opt_saved.state_dict())
    assert opt.param_groups[0]["state_dtype"] == built
    p.grad = torch.randn(64, device=device).to(torch.bfloat16)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == built and opt.state[p]["exp_avg_sq"].dtype == built
