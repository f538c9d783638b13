"""fusedamp.optim.Lion and its operator lion_step_, against a plain-PyTorch reference: the
update of lucidrains/lion-pytorch (p *= 1 - lr * wd; p -= lr * sign(beta1 * m + (1 - beta1) *
g); m = beta2 * m + (1 - beta2) * g), written here with torch ops in FP32 (the same operations
as the kernel: bit for bit) and in FP64 (what the master-weight modes are measured against).
Every test runs on every device."""
import io

import pytest
import torch

import fusedamp

ops = torch.ops.fusedamp

LR = 2.0 ** -8          # exactly representable: the FP32 reference rounds as the kernel does
WD = 2.0 ** -4
BETAS = (0.9, 0.99)
SHAPES = [(37,), (5, 13), (1,), (300,)]  # tails of every length, a one-element tensor
STEPS = 12


def reference_step(params, exp_avgs, grads, lr=LR, betas=BETAS, weight_decay=WD):
    """One Lion step in torch ops, in the tensors' own dtype (lion-pytorch's update_fn)."""
    beta1, beta2 = betas
    for p, m, g in zip(params, exp_avgs, grads):
        p.mul_(1.0 - lr * weight_decay)
        update = m.clone().mul_(beta1).add(g, alpha=1.0 - beta1).sign_()
        p.add_(update, alpha=-lr)
        m.mul_(beta2).add_(g, alpha=1.0 - beta2)


def make_grads(device, steps=STEPS, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randn(s, generator=gen) * scale).to(device) for s in SHAPES]
            for _ in range(steps)]


def start_weights(device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(device) for s in SHAPES]


def test_fp32_matches_the_reference_bit_for_bit(device):
    """FP32 parameters and state: every step's weights and exp_avg are the FP32 reference's."""
    weights = start_weights(device)
    params = [w.clone().requires_grad_() for w in weights]
    opt = fusedamp.optim.Lion(params, lr=LR, betas=BETAS, weight_decay=WD)
    ref = [w.clone() for w in weights]
    ref_m = [torch.zeros_like(w) for w in weights]
    for step, grads in enumerate(make_grads(device)):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        reference_step(ref, ref_m, grads)
        for p, r, m in zip(params, ref, ref_m):
            assert torch.equal(p.detach(), r), step
            assert torch.equal(opt.state[p]["exp_avg"], m), step
    assert all(float(opt.state[p]["step"]) == STEPS for p in params)


def test_maximize_and_the_tensor_lr_are_the_reference_s(device):
    """maximize=True is the reference on -g; a tensor lr (the engine's lr_tensor) is the number."""
    weights = start_weights(device, seed=3)
    params = [w.clone().requires_grad_() for w in weights]
    opt = fusedamp.optim.Lion(params, lr=torch.tensor(LR), betas=BETAS, weight_decay=WD,
                              maximize=True)
    ref = [w.clone() for w in weights]
    ref_m = [torch.zeros_like(w) for w in weights]
    for grads in make_grads(device, steps=4, seed=4):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        reference_step(ref, ref_m, [-g for g in grads])
    for p, r in zip(params, ref):
        assert torch.equal(p.detach(), r)


# (param dtype, master_weights, state_dtype, tolerance against the FP64 reference in units of
# the param dtype's eps, relative to max(|w|, 1), after STEPS steps): the modes that keep the
# master's bits give the rounding of an FP32 master, within half an ulp (HALF: and the FP32
# master's own few FP32 roundings); rounding to nearest alone (False) and stochastic rounding
# drift by up to about an ulp per step.
HALF = 0.5 + 2.0 ** -10
MODES = [
    (torch.bfloat16, True, torch.float32, HALF),
    (torch.bfloat16, "split", torch.float32, HALF),
    (torch.bfloat16, "split8", torch.float32, HALF),
    (torch.bfloat16, "kahan", torch.float32, HALF),
    (torch.bfloat16, "stochastic", torch.float32, STEPS),
    (torch.bfloat16, False, torch.float32, STEPS),
    (torch.bfloat16, True, torch.bfloat16, HALF),
    (torch.float16, True, torch.float32, HALF),
    (torch.float16, "kahan", torch.bfloat16, HALF),
    (torch.float16, False, torch.float32, STEPS),
]


@pytest.mark.parametrize("dtype,mode,state_dtype,ulps", MODES)
def test_master_modes_track_the_fp64_reference(device, dtype, mode, state_dtype, ulps):
    """Each master-weight mode and state format against the FP64 reference: the weights within
    `ulps` of the param dtype's eps. Each step moves a weight by about lr = 2^-8 (half a BF16
    eps, four FP16 eps): a lost step or a wrong sign is outside the tolerance of the master
    modes."""
    weights = [w.to(dtype) for w in start_weights(device, seed=5)]
    params = [w.clone().requires_grad_() for w in weights]
    opt = fusedamp.optim.Lion(params, lr=LR, betas=BETAS, weight_decay=WD, master_weights=mode,
                              state_dtype=state_dtype, rounding_seed=7)
    ref = [w.double() for w in weights]
    ref_m = [torch.zeros_like(w) for w in ref]
    # Gradients far from zero in the interpolation: a sign the FP32 and FP64 runs could read
    # differently would move a weight by 2 lr.
    for grads in make_grads(device, seed=6, scale=4.0):
        grads = [g + torch.where(g >= 0, 1.0, -1.0) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.to(dtype)
        opt.step()
        reference_step(ref, ref_m, [g.to(dtype).double() for g in grads])
    eps = torch.finfo(dtype).eps
    for p, r in zip(params, ref):
        err = (p.detach().double() - r).abs() / r.abs().clamp_min(1.0)
        assert float(err.max()) <= ulps * eps, (mode, float(err.max()) / eps)
    assert all(opt.state[p]["exp_avg"].dtype == state_dtype for p in params)


def test_split_pair_is_the_fp32_master_bit_for_bit(device):
    """master_weights="split" and True from the same BF16 weights and gradients: the split pair
    (weight pattern * 2^16 + the signed remainder) is the FP32 master at every step."""
    weights = [w.to(torch.bfloat16) for w in start_weights(device, seed=8)]
    a = [w.clone().requires_grad_() for w in weights]
    b = [w.clone().requires_grad_() for w in weights]
    opt_a = fusedamp.optim.Lion(a, lr=LR, weight_decay=WD, master_weights=True)
    opt_b = fusedamp.optim.Lion(b, lr=LR, weight_decay=WD, master_weights="split")
    for grads in make_grads(device, steps=6, seed=9):
        for p, q, g in zip(a, b, grads):
            p.grad = g.to(torch.bfloat16)
            q.grad = g.to(torch.bfloat16)
        opt_a.step()
        opt_b.step()
        for p, q in zip(a, b):
            high = q.detach().view(torch.int16).to(torch.int32) << 16
            rebuilt = high + opt_b.state[q]["param_remainder"].to(torch.int32)
            assert torch.equal(rebuilt, opt_a.state[p]["master_param"].view(torch.int32))


def test_skipped_step_and_state_dict_round_trip(device):
    """A step with non-finite gradients changes nothing; a state_dict saved mid-run and loaded
    into a new optimizer continues the run bit for bit."""
    weights = [w.half() for w in start_weights(device, seed=10)]
    params = [w.clone().requires_grad_() for w in weights]
    opt = fusedamp.optim.Lion(params, lr=LR, weight_decay=WD)
    runs = make_grads(device, steps=6, seed=11)
    for grads in runs[:3]:
        for p, g in zip(params, grads):
            p.grad = g.half()
        opt.step()
    before = [p.detach().clone() for p in params]
    state_before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    for p, g in zip(params, runs[3]):
        p.grad = torch.full_like(g, float("nan")).half()
    opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(torch.equal(opt.state[params[0]][k], v) for k, v in state_before.items())
    assert int(opt.skipped_steps) == 1

    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    copies = [p.detach().clone().requires_grad_() for p in params]
    resumed = fusedamp.optim.Lion(copies, lr=LR, weight_decay=WD)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer))
    for grads in runs[4:]:
        for p, q, g in zip(params, copies, grads):
            p.grad = g.half()
            q.grad = g.half()
        opt.step()
        resumed.step()
    assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(params, copies))


def test_bad_options_are_refused(device):
    p = torch.zeros(4, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="no 8-bit format"):
        fusedamp.optim.Lion([p], state_dtype=torch.int8)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        fusedamp.optim.Lion([p], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="Invalid learning rate"):
        fusedamp.optim.Lion([p], lr=-1.0)


@pytest.mark.parametrize("override,message", [
    (dict(beta1=1.0), "invalid beta1"),
    (dict(weight_decay=-1.0), "invalid weight_decay"),
    (dict(lr=float("nan")), "invalid lr"),
    ("int8", "no 8-bit format"),
])
def test_op_refuses_bad_input_and_modifies_nothing(device, override, message):
    params = [torch.randn(8, device=device)]
    exp_avgs = [torch.randn(8, device=device)]
    grads = [torch.randn(8, device=device)]
    steps = [torch.zeros((), device=device)]
    kwargs = dict(lr=LR, beta1=0.9, beta2=0.99, weight_decay=WD)
    if override == "int8":
        exp_avgs = [torch.zeros(8, dtype=torch.int8, device=device)]
    else:
        kwargs.update(override)
    before = [t.clone() for t in params + exp_avgs + steps]
    with pytest.raises(RuntimeError, match=message):
        ops.lion_step_(params, [], grads, exp_avgs, steps, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(params + exp_avgs + steps, before))
