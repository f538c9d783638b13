"""fusedamp.GradScaler's telemetry and amax policy, end to end on every device: each recorded
value against a reference computed separately from the gradients the step saw (every path a
scaler takes: fusedamp optimizers, torch's fused ones, plain ones, with and without unscale_),
the ring buffer, checkpoints, and the two failure modes the amax policy exists for."""
import copy
import math

import pytest
import torch

import fusedamp

INF = float("inf")


def make_model(device, dtype=torch.float16, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return model.to(device=device, dtype=dtype)


def batch(device, dtype, step, loss_factor=1.0):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(64, 12, generator=g).to(device, dtype)
    y = torch.randn(64, 1, generator=g).to(device, dtype)
    return x, y, loss_factor


def loss_of(model, x, y, loss_factor):
    return ((model(x).float() - y.float()) ** 2).mean() * loss_factor


def reference(named_grads, scale):
    """What the record must hold, from the scaled gradients as the step saw them (FP64)."""
    amax, small, zero, elements, sum_sq, first = 0.0, 0, 0, 0, 0.0, None
    for name, g in named_grads:
        x = g.detach().double()
        finite = torch.isfinite(x)
        amax = max(amax, x.abs().where(finite, 0.0).max().item())
        small += int((x.abs() < torch.finfo(g.dtype).tiny).sum())
        zero += int((x == 0).sum())
        elements += x.numel()
        sum_sq += x.square().sum().item()
        if first is None and not bool(finite.all()):
            first = name
    return dict(scale=scale, amax=amax, underflow_fraction=small / elements,
                subnormal_fraction=(small - zero) / elements,
                grad_norm=math.sqrt(sum_sq) / scale, found_inf=first is not None,
                first_nonfinite=first)


def check_record(log, k, want, norm_rtol=1e-5):
    assert log["scale"][k] == want["scale"]
    assert log["found_inf"][k] == want["found_inf"] == log["skipped"][k]
    assert log["first_nonfinite"][k] == want["first_nonfinite"]
    if want["found_inf"]:
        return
    assert log["amax"][k] == want["amax"]
    assert log["underflow_fraction"][k] == pytest.approx(want["underflow_fraction"], abs=1e-15)
    assert log["subnormal_fraction"][k] == pytest.approx(want["subnormal_fraction"], abs=1e-15)
    assert log["grad_norm"][k] == pytest.approx(want["grad_norm"], rel=norm_rtol)


def poison(model, step, poisoned_step, name):
    if step == poisoned_step:
        dict(model.named_parameters())[name].grad.view(-1)[3] = float("nan")


PATHS = ["fusedamp-adamw", "torch-fused-adamw", "torch-sgd", "torch-sgd-unscale"]


@pytest.mark.parametrize("path", PATHS)
def test_record_matches_reference(device, path):
    if path == "torch-fused-adamw" and device == "cpu" and not hasattr(torch, "_fused_adamw_"):
        pytest.skip("torch has no fused AdamW on this device")
    dtype = torch.float16 if path == "fusedamp-adamw" else torch.float32
    model = make_model(device, dtype)
    if path == "fusedamp-adamw":
        opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3)
    elif path == "torch-fused-adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=3)
    wants = []
    for step in range(8):
        x, y, f = batch(device, dtype, step)
        scaler.scale(loss_of(model, x, y, f)).backward()
        poison(model, step, 5, "2.weight")
        wants.append(reference([(n, p.grad) for n, p in model.named_parameters()],
                               scaler.get_scale()))
        if path == "torch-sgd-unscale":
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    log = scaler.telemetry(model)
    assert log["step"] == list(range(8))
    assert any(w["found_inf"] for w in wants) and not all(w["found_inf"] for w in wants)
    for k, want in enumerate(wants):
        check_record(log, k, want)
    assert log["dtype_max"] == float(torch.finfo(dtype).max) and log["amax_target"] is None


@pytest.mark.parametrize("poisoned", ["0.weight", "2.weight", "4.weight"])
def test_record_of_a_step_over_several_buckets_matches_reference(device, poisoned):
    """A fusedamp step whose parameters fall into several buckets on one device (FP32 and FP16
    parameters in one group): its statistics pass walks the gradients bucket by bucket, and the
    record names the first non-finite gradient by the parameter it belongs to, whichever bucket
    holds it; every other value as the reference computes it."""
    model = make_model(device, torch.float16)
    model[2].float()  # the middle layer in FP32: a bucket of its own between the FP16 ones
    opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 10)
    wants = []
    for step in range(4):
        x, y, f = batch(device, torch.float16, step)
        h = model[2](model[1](model[0](x)).float())
        out = model[4](model[3](h.half()))
        scaler.scale(((out.float() - y.float()) ** 2).mean() * f).backward()
        poison(model, step, 2, poisoned)
        wants.append(reference([(n, p.grad) for n, p in model.named_parameters()],
                               scaler.get_scale()))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    log = scaler.telemetry(model)
    assert [w["found_inf"] for w in wants] == [False, False, True, False]
    for k, want in enumerate(wants):
        check_record(log, k, want)


def test_unscale_then_a_clipping_step_records_the_gradients_once(device):
    """A clipping optimizer's step reads the gradients again after scaler.unscale_ (for the
    norm); the record keeps the pass unscale_ made, of the scaled gradients. At scale 1 a
    second record of the same gradients would show as a norm sqrt(2) too large."""
    model = make_model(device, torch.float32)
    opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1e9)
    scaler = fusedamp.GradScaler(device, init_scale=1.0)
    wants = []
    for step in range(3):
        x, y, f = batch(device, torch.float32, step)
        scaler.scale(loss_of(model, x, y, f)).backward()
        wants.append(reference([(n, p.grad) for n, p in model.named_parameters()],
                               scaler.get_scale()))
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    log = scaler.telemetry(model)
    for k, want in enumerate(wants):
        check_record(log, k, want)


def test_several_optimizers_one_iteration(device):
    """Positions of the first non-finite gradient stay right across the passes of one iteration
    (a fusedamp optimizer and a torch one), and amax/underflow combine over both."""
    model = make_model(device, torch.float16)
    head = torch.nn.Linear(1, 1).to(device)
    opt_a = fusedamp.optim.AdamW(model.parameters(), lr=1e-3)
    opt_b = torch.optim.SGD(head.parameters(), lr=1e-2)
    scaler = fusedamp.GradScaler(device, init_scale=256.0)
    names = {**{f"body.{n}": p for n, p in model.named_parameters()},
             **{f"head.{n}": p for n, p in head.named_parameters()}}
    named = [(n, p) for n, p in names.items()]
    wants = []
    for step in range(4):
        x, y, f = batch(device, torch.float16, step)
        loss = ((head(model(x).float()) - y.float()) ** 2).mean()
        scaler.scale(loss).backward()
        if step == 2:
            names["head.weight"].grad.fill_(INF)
        if step == 3:
            names["body.4.bias"].grad.fill_(INF)
            names["head.bias"].grad.fill_(INF)
        wants.append(reference([(n, p.grad) for n, p in named], scaler.get_scale()))
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
        opt_a.zero_grad()
        opt_b.zero_grad()
    log = scaler.telemetry(named)
    assert log["first_nonfinite"] == [None, None, "head.weight", "body.4.bias"]
    for k in (0, 1):
        check_record(log, k, wants[k])


def test_ring_keeps_the_last_capacity_iterations(device):
    model = make_model(device)
    opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 8, growth_interval=1,
                                 telemetry_capacity=5)
    for step in range(8):
        x, y, f = batch(device, torch.float16, step)
        scaler.scale(loss_of(model, x, y, f)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    log = scaler.telemetry()
    assert log["step"] == [3, 4, 5, 6, 7]
    assert log["scale"] == [2.0 ** (8 + k) for k in range(3, 8)]  # growth every clean step


def test_telemetry_off_and_argument_errors(device):
    scaler = fusedamp.GradScaler(device, telemetry=False)
    if scaler.is_enabled():
        assert scaler.telemetry()["step"] == []
    with pytest.raises(RuntimeError, match="amax policy needs telemetry"):
        fusedamp.GradScaler(device, policy="amax", telemetry=False)
    with pytest.raises(RuntimeError, match="policy must be"):
        fusedamp.GradScaler(device, policy="smart")
    with pytest.raises(RuntimeError, match="amax_target"):
        fusedamp.GradScaler(device, policy="amax", amax_target=-1.0)
    with pytest.raises(RuntimeError, match="telemetry_capacity"):
        fusedamp.GradScaler(device, telemetry_capacity=0)


def iterate(device, model, opt, scaler, steps, loss_factor=1.0):
    for step in steps:
        x, y, f = batch(device, torch.float16, step, loss_factor)
        scaler.scale(loss_of(model, x, y, f)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def train(device, scaler, steps, loss_factor=1.0):
    model = make_model(device)
    opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3)
    iterate(device, model, opt, scaler, range(steps), loss_factor)
    return model, opt


def skips_before_first_applied(log):
    return next(k for k, s in enumerate(log["skipped"]) if not s)


def test_amax_policy_from_a_scale_far_too_high(device):
    """init_scale=2^24 overflows this model: the amax policy skips at most 2 steps before the
    first applied one; torch's rule halves once per skipped step."""
    counts = {}
    for policy in ("torch", "amax"):
        scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 24, policy=policy)
        train(device, scaler, 20)
        counts[policy] = skips_before_first_applied(scaler.telemetry())
    assert counts["amax"] <= 2 < counts["torch"]


def test_amax_policy_lifts_underflowing_gradients(device):
    """A loss 1e-6 as large, from init_scale=1: the amax policy brings the underflow fraction of
    the FP16 gradients below 0.1 % within 10 steps; torch's rule (growth every 2000 steps)
    leaves it where it started."""
    fractions = {}
    for policy in ("torch", "amax"):
        scaler = fusedamp.GradScaler(device, init_scale=1.0, policy=policy)
        train(device, scaler, 10, loss_factor=1e-6)
        fractions[policy] = scaler.telemetry()["underflow_fraction"]
    assert fractions["amax"][0] > 0.01  # the problem is real at the start
    assert fractions["amax"][-1] < 1e-3
    assert min(fractions["torch"]) > 0.01


def test_amax_policy_resumes_bit_exactly(device):
    """A checkpoint mid-run (scaler state_dict + model + optimizer) continues exactly as the
    uninterrupted run; a scaler of another policy refuses it."""
    scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 20, policy="amax")
    model, opt = train(device, scaler, 6)
    saved = copy.deepcopy((scaler.state_dict(), model.state_dict(), opt.state_dict()))
    iterate(device, model, opt, scaler, range(6, 12))  # the uninterrupted run continues
    resumed_model = make_model(device)
    resumed_model.load_state_dict(saved[1])
    resumed_opt = fusedamp.optim.AdamW(resumed_model.parameters(), lr=1e-3)
    resumed_opt.load_state_dict(saved[2])
    resumed = fusedamp.GradScaler(device, policy="amax")
    resumed.load_state_dict(saved[0])
    iterate(device, resumed_model, resumed_opt, resumed, range(6, 12))
    assert resumed.telemetry()["scale"] == scaler.telemetry()["scale"][6:]
    assert resumed.get_scale() == scaler.get_scale()
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    other = fusedamp.GradScaler(device, policy="torch")
    with pytest.raises(ValueError, match="policy"):
        other.load_state_dict(saved[0])


def test_initialize_and_copies_keep_the_policy(device):
    """initialize(policy=...) builds the scaler with it; a deepcopy (pickling) keeps policy and
    target, and starts its own record."""
    model = make_model(device, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, scaler = fusedamp.initialize(model, opt, torch.float16, policy="amax",
                                             amax_target=512.0)
    if not scaler.is_enabled():
        pytest.skip("no FP16 loss scaling on this device")
    iterate(device, model, opt, scaler, range(2))
    clone = copy.deepcopy(scaler)
    assert clone.state_dict() == scaler.state_dict()
    assert clone.state_dict()["policy"] == "amax" and clone.state_dict()["amax_target"] == 512.0
    assert len(scaler.telemetry()["step"]) == 2 and clone.telemetry()["step"] == []


def test_record_does_not_keep_parameters_alive(device):
    """The record names parameters but holds them weakly: a model deleted while its scaler lives
    is freed, and its overflow reads back as an unnamed one."""
    import gc
    import weakref

    model = make_model(device)
    opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 8)
    x, y, f = batch(device, torch.float16, 0)
    scaler.scale(loss_of(model, x, y, f)).backward()
    model[0].weight.grad.fill_(INF)
    scaler.step(opt)
    scaler.update()
    assert scaler.telemetry(model)["first_nonfinite"] == ["0.weight"]
    alive = weakref.ref(model[0].weight)
    del model, opt, x, y
    gc.collect()
    assert alive() is None
    assert scaler.telemetry()["first_nonfinite"] == [None]
    assert scaler.telemetry()["found_inf"] == [True]


@pytest.mark.parametrize("dtypes,want", [
    ((torch.float16,), 65504.0),
    ((torch.bfloat16,), float(torch.finfo(torch.bfloat16).max)),
    ((torch.float32,), float(torch.finfo(torch.float32).max)),
    ((torch.bfloat16, torch.float16), 65504.0),  # the narrowest dtype overflows first
])
def test_dtype_max_is_the_limit_of_the_gradients_dtype(device, dtypes, want):
    """dtype_max is what the scaled gradients overflow above: the largest finite value of the
    narrowest gradient dtype walked, not FP16's whatever the model's dtype."""
    params = [torch.nn.Parameter(torch.ones(8, device=device, dtype=d)) for d in dtypes]
    opt = fusedamp.optim.SGD(params, lr=0.1)
    scaler = fusedamp.GradScaler(device, init_scale=4.0)
    assert scaler.telemetry()["dtype_max"] is None  # nothing walked yet
    scaler.scale(torch.ones((), device=device))
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    scaler.step(opt)
    scaler.update()
    assert scaler.telemetry()["dtype_max"] == want


def test_amax_target_without_the_amax_policy_is_refused():
    with pytest.raises(ValueError, match="amax_target is the target of policy='amax'"):
        fusedamp.GradScaler("cpu", policy="torch", amax_target=16.0)


def _amax_scaler_after_a_step(device, grad_dtype, amax_target):
    param = torch.nn.Parameter(torch.ones(8, device=device, dtype=grad_dtype))
    opt = fusedamp.optim.SGD([param], lr=0.1)
    scaler = fusedamp.GradScaler(device, init_scale=4.0, policy="amax", amax_target=amax_target)
    scaler.scale(torch.ones((), device=device))
    param.grad = torch.full_like(param, 0.5)
    scaler.step(opt)
    return scaler


def test_amax_target_at_or_above_the_gradients_limit_is_refused_and_changes_nothing(device):
    """FP16 gradients overflow above 65504: a target there aims every step at an overflow."""
    scaler = _amax_scaler_after_a_step(device, torch.float16, 65504.0)
    with pytest.raises(RuntimeError, match="amax_target 65504 is not below"):
        scaler.update()
    assert scaler.get_scale() == 4.0 and scaler.telemetry()["step"] == []
    # The same target is fine for BF16 gradients, whose limit is ~3.4e38.
    scaler = _amax_scaler_after_a_step(device, torch.bfloat16, 65504.0)
    scaler.update()
    assert scaler.get_scale() > 4.0  # moved up toward the target
