"""The fused steps under the master-weight modes: "split" (BF16 weight + int16 remainder = the
FP32 master), "kahan" (16-bit compensation), "stochastic" (stochastic rounding, counter-based)
and BF16 optimizer state, in the Adam/AdamW, SGD and Lion ops. Every test runs on every device.

References are independent of the kernels: the split pair is rebuilt from bit patterns with
torch integer ops (master_mode_helpers.py), and the FP32 master run is the ops' FP32 master
path (itself tested against torch.optim in test_adam_sgd_step_ops.py and
test_torch_optim_parity.py)."""
import pytest
import torch

from master_mode_helpers import combine_reference, is_halfway
from op_helpers import ops


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
