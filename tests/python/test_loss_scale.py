"""The loss scale: update_scale_ against torch._amp_update_scale_ and a plain-Python model
(growth, backoff, hysteresis, bounds, float limits); fusedamp.GradScaler's sequence against
torch.amp.GradScaler, as its telemetry records it, and its inverse scale against torch's."""
import pytest
import torch

import fusedamp
from op_helpers import _model_params, assert_bitwise_equal, f32, scalar, scale_model
from op_inputs import op_inputs


def _overflow_pattern(n, seed):
    g = torch.Generator().manual_seed(seed)
    pattern = (torch.rand(n, generator=g) < 0.1).tolist()
    pattern[10:16] = [True] * 6
    return pattern


@pytest.mark.parametrize("fused", [True, False])
def test_scale_sequence_matches_torch_amp(device, fused):
    """Same overflow pattern -> same scale sequence as torch.amp.GradScaler. fused=False drives
    a plain torch.optim.SGD through fusedamp.GradScaler."""
    ours_p = _model_params(device)
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    opt = fusedamp.optim.SGD(ours_p, lr=0.01) if fused else torch.optim.SGD(ours_p, lr=0.01)
    ref_opt = torch.optim.SGD(ref_p, lr=0.01)
    scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=3)
    ref = torch.amp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=3)
    carried = []  # torch's scale in each iteration, before its update
    for i, overflow in enumerate(_overflow_pattern(200, seed=1)):
        carried.append(ref.get_scale())
        for ps, sc in ((ours_p, scaler), (ref_p, ref)):
            loss = sum((p.float() ** 2).sum() for p in ps)
            sc.scale(loss).backward()
            if overflow:
                ps[1].grad[0, 0] = float("inf")
        scaler.step(opt)
        ref.step(ref_opt)
        scaler.update()
        ref.update()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert scaler.get_scale() == ref.get_scale(), i
    for p, r in zip(ours_p, ref_p):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6)
    # The telemetry records the scale of every iteration.
    assert scaler.telemetry()["scale"] == carried


def test_scale_sequence_with_default_factors_is_bit_exact_vs_torch(device):
    """5,000 steps of update_scale_ with GradScaler's defaults (growth 2.0, backoff 0.5,
    interval 2000) against torch._amp_update_scale_: scale and growth tracker bit for bit after
    every step, through two growths and backoffs of one and three overflows."""
    found_seq = [i in (7, 8, 2100, 4300, 4301, 4302) for i in range(5000)]
    mine, ref = (op_inputs(device, [], loss_scale=2.0 ** 16) for _ in range(2))
    growths = 0
    for i, found in enumerate(found_seq):
        found_inf = scalar(float(found), device)
        previous = ref.scale.item()
        mine.call("update_scale_", found_inf=found_inf, growth_factor=2.0, backoff_factor=0.5,
                  growth_interval=2000)
        torch._amp_update_scale_(ref.scale, ref.growth_tracker, found_inf, 2.0, 0.5, 2000)
        assert torch.equal(mine.scale.view(torch.int32), ref.scale.view(torch.int32)), i
        assert torch.equal(mine.growth_tracker, ref.growth_tracker), i
        growths += ref.scale.item() > previous
    assert growths == 2  # at steps 2008 and 4100


@pytest.mark.parametrize("interval", [1, 3, 50])
@pytest.mark.parametrize("factors", [(2.0, 0.5), (1.7, 0.3)])
def test_update_scale_matches_torch(device, interval, factors):
    growth, backoff = factors
    gen = torch.Generator().manual_seed(interval)
    found_seq = (torch.rand(3000, generator=gen) < 0.15).tolist()
    found_seq[100:140] = [True] * 40  # a long overflow burst drives the scale down hard
    mine, ref = (op_inputs(device, [], loss_scale=2.0 ** 16) for _ in range(2))
    for i, f in enumerate(found_seq):
        fi = scalar(float(f), device)
        mine.call("update_scale_", found_inf=fi, growth_factor=growth, backoff_factor=backoff,
                  growth_interval=interval)
        torch._amp_update_scale_(ref.scale, ref.growth_tracker, fi, growth, backoff, interval)
        assert mine.scale.item() == ref.scale.item(), (i, mine.scale.item(), ref.scale.item())
        assert mine.growth_tracker.item() == ref.growth_tracker.item()


@pytest.mark.parametrize("start,growth,backoff", [
    (2.0 ** 127, 2.0, 0.5),         # growth overflows to inf: the scale must stay finite
    (3.0e38, 1.0001, 0.9999),       # factors that are not powers of two, near FLT_MAX
    (1.5e-45, 1.9, 0.3),            # subnormal scale backing off to 0
])
def test_update_scale_at_float_limits_matches_torch(device, start, growth, backoff):
    """The factors are doubles and the product is rounded to float once, as in torch."""
    found_seq = [False, False, True, False, False, True, True, False, False, False]
    mine, ref = (op_inputs(device, [], loss_scale=start) for _ in range(2))
    for i, f in enumerate(found_seq):
        fi = scalar(float(f), device)
        mine.call("update_scale_", found_inf=fi, growth_factor=growth, backoff_factor=backoff,
                  growth_interval=2)
        torch._amp_update_scale_(ref.scale, ref.growth_tracker, fi, growth, backoff, 2)
        assert_bitwise_equal([mine.scale, mine.growth_tracker], [ref.scale, ref.growth_tracker])


@pytest.mark.parametrize("min_scale,max_scale", [(1e-50, None), (None, 1e300), (1e-50, 1e300)])
def test_update_scale_bounds_beyond_float_range_are_no_bounds(device, min_scale, max_scale):
    """A bound that rounds to 0 or inf in float clamps nothing, as if it were not given."""
    gen = torch.Generator().manual_seed(11)
    found_seq = (torch.rand(400, generator=gen) < 0.4).tolist()
    bounded, ref = (op_inputs(device, [], loss_scale=2.0 ** 16) for _ in range(2))
    for f in found_seq:
        fi = scalar(float(f), device)
        bounded.call("update_scale_", found_inf=fi, growth_factor=2.0, backoff_factor=0.5,
                     growth_interval=3, min_scale=min_scale, max_scale=max_scale)
        torch._amp_update_scale_(ref.scale, ref.growth_tracker, fi, 2.0, 0.5, 3)
        assert_bitwise_equal([bounded.scale], [ref.scale])


@pytest.mark.parametrize("hysteresis", [1, 2, 4])
@pytest.mark.parametrize("bounds", [(None, None), (1.0, 2.0 ** 18), (2.0 ** 10, None)])
def test_update_scale_hysteresis_and_bounds(device, hysteresis, bounds):
    min_scale, max_scale = bounds
    gen = torch.Generator().manual_seed(hysteresis)
    found_seq = (torch.rand(2000, generator=gen) < 0.3).tolist()
    found_seq[500:560] = [True] * 60
    found_seq[800:900] = [False] * 100
    inp = op_inputs(device, [], loss_scale=2.0 ** 16, hysteresis=hysteresis)
    model = scale_model(found_seq, 2.0 ** 16, 2.0, 0.5, 5, hysteresis, min_scale, max_scale)
    for i, (f, (s, g, h)) in enumerate(zip(found_seq, model)):
        inp.call("update_scale_", found_inf=scalar(float(f), device), growth_factor=2.0,
                 backoff_factor=0.5, growth_interval=5, hysteresis=hysteresis,
                 min_scale=min_scale, max_scale=max_scale)
        scale = inp.scale.item()
        assert (scale, inp.growth_tracker.item(), inp.hysteresis_tracker.item()) == (s, g, h), i
        if min_scale is not None:
            assert scale >= min_scale
        if max_scale is not None:
            assert scale <= max_scale


def megatron_scales(found_seq, scale, growth_factor, backoff, interval, hysteresis, min_scale):
    """Megatron-Core's DynamicGradScaler.update restated in plain Python: every overflow spends
    one unit of hysteresis and, once none is left, backs off (not below min_scale); only a
    completed growth interval refills it. Yields the scale after each step."""
    growth_tracker, hysteresis_tracker = 0, hysteresis
    for found in found_seq:
        if found:
            growth_tracker = 0
            hysteresis_tracker -= 1
            if hysteresis_tracker <= 0:
                scale = max(f32(scale * backoff), min_scale)
        else:
            growth_tracker += 1
            if growth_tracker == interval:
                growth_tracker = 0
                hysteresis_tracker = hysteresis
                scale = f32(scale * growth_factor)
        yield scale


def _run_update_scale(device, found_seq, init, interval, hysteresis, min_scale):
    inp = op_inputs(device, [], loss_scale=init, hysteresis=hysteresis)
    for f in found_seq:
        inp.call("update_scale_", found_inf=scalar(float(f), device), growth_factor=2.0,
                 backoff_factor=0.5, growth_interval=interval, hysteresis=hysteresis,
                 min_scale=min_scale)
        yield inp.scale.item()


def test_hysteresis_does_not_lock_the_scale(device):
    """An overflow every other step with hysteresis 2 (Megatron's default): the first is
    tolerated, every later one backs off, as no growth refills the hysteresis."""
    pattern = [True, False] * 10
    seen = list(_run_update_scale(device, pattern, 1024.0, 1000, 2, None))
    assert seen == list(megatron_scales(pattern, 1024.0, 2.0, 0.5, 1000, 2, 0.0))
    assert seen[-1] == 2.0


@pytest.mark.parametrize("hysteresis", [1, 2, 3, 5])
def test_hysteresis_matches_megatron(device, hysteresis):
    gen = torch.Generator().manual_seed(100 + hysteresis)
    for density in (0.1, 0.3, 0.6):
        pattern = (torch.rand(400, generator=gen) < density).tolist()
        seen = list(_run_update_scale(device, pattern, 2.0 ** 16, 4, hysteresis, 1.0))
        assert seen == list(megatron_scales(pattern, 2.0 ** 16, 2.0, 0.5, 4, hysteresis, 1.0))


def test_hysteresis_and_bounds(device):
    params = _model_params(device)
    opt = fusedamp.optim.AdamW(params, lr=1e-3)
    scaler = fusedamp.GradScaler(device, init_scale=256.0, growth_interval=2, hysteresis=2,
                                 min_scale=64.0, max_scale=1024.0)
    pattern = [1, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    seen = []
    for overflow in pattern:
        loss = sum((p ** 2).sum() for p in params)
        scaler.scale(loss).backward()
        if overflow:
            params[0].grad[3] = float("nan")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        seen.append(scaler.get_scale())
    # The first overflow is tolerated; a clean step does not refill the hysteresis, so every
    # later overflow backs off, to the minimum; clean steps grow every two steps, up to the
    # maximum (the plain-Python model).
    model = [s for s, _, _ in scale_model(pattern, 256.0, 2.0, 0.5, 2, 2, 64.0, 1024.0)]
    assert seen == model
    assert seen[:6] == [256, 256, 128, 64, 64, 64] and seen[-1] == 1024


@pytest.mark.parametrize("restore", [False, True], ids=["built", "unpickled"])
def test_every_constructor_argument_reaches_the_engine(device, restore):
    """Each argument, none at its default, is the engine's setting of the same name, in a
    scaler as built and as unpickled (which builds its engine again from the arguments)."""
    import pickle

    given = dict(init_scale=2.0 ** 9, growth_factor=4.0, backoff_factor=0.25,
                 growth_interval=7, hysteresis=3, min_scale=2.0, max_scale=2.0 ** 20,
                 policy="amax", amax_target=1000.0)
    scaler = fusedamp.GradScaler(device, telemetry_capacity=5, **given)
    if restore:
        scaler = pickle.loads(pickle.dumps(scaler))
    settings = scaler.state_dict()
    assert {k: settings["scale" if k == "init_scale" else k] for k in given} == given
    assert scaler.is_enabled()
    param = torch.nn.Parameter(torch.ones(4, device=device))
    opt = fusedamp.optim.SGD([param], lr=0.0)
    for _ in range(6):
        scaler.scale(param.sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert len(scaler.telemetry()["scale"]) == 5  # the last telemetry_capacity iterations


def test_the_inverse_scale_is_torchs(device):
    """The engine takes 1 / scale in FP32 (one op; on the CPU the double reciprocal on the
    host, into a tensor it keeps) where torch rounds the double reciprocal to FP32: the same
    number for every FP32 scale. Checked through the optimizer (a scale
    handed over by torch's protocol: SGD, lr 1, gradient 1 leaves -1/scale in the weight and
    1/scale in .grad) and through the scaler's unscale_, over random scales of every
    magnitude, against torch's formula."""
    g = torch.Generator().manual_seed(7)
    exponents = torch.randint(-60, 60, (150,), generator=g).to(torch.float64)
    scales = (torch.rand(150, generator=g, dtype=torch.float64) + 1.0) * 2.0 ** exponents
    scales = scales.float()
    expected = scales.double().reciprocal().float()

    param = torch.nn.Parameter(torch.zeros(1, device=device))
    opt = fusedamp.optim.SGD([param], lr=1.0, master_weights=False)
    scaler = fusedamp.GradScaler(device)
    via_optimizer, via_scaler, via_grad = [], [], []
    for s in scales.tolist():
        with torch.no_grad():
            param.zero_()
        param.grad = torch.ones(1, device=device)
        opt.grad_scale = torch.tensor(s, device=device)
        opt.found_inf = torch.zeros((), device=device)
        opt.step()
        del opt.grad_scale, opt.found_inf
        via_optimizer.append(-param.item())
        via_grad.append(param.grad.item())

        scaler.update(s)
        scaler.scale(torch.ones((), device=device))
        param.grad = torch.ones(1, device=device)
        scaler.unscale_(opt)
        via_scaler.append(param.grad.item())
        scaler.update(s)  # ends the iteration (no step)
    for got in (via_optimizer, via_grad, via_scaler):
        assert torch.equal(torch.tensor(got, dtype=torch.float32), expected)


def _stepped_scaler(device, param):
    scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 10)
    opt = fusedamp.optim.SGD([param], lr=0.1)
    scaler.scale(torch.ones((), device=device))  # the iteration starts with scale()
    param.grad = torch.ones_like(param)
    scaler.step(opt)
    return scaler


def test_update_with_a_tensor_copies_on_the_device_without_reading_it(device, monkeypatch):
    """update(new_scale=<tensor>) sets the scale as torch's does, by a device copy: the value
    is never read on the host (no .item(), which would synchronise with the GPU)."""
    param = torch.nn.Parameter(torch.zeros(4, device=device))
    scaler = _stepped_scaler(device, param)
    new_scale = torch.tensor([512.0], device=device)

    def no_host_read(self):
        raise AssertionError("update(new_scale=<tensor>) read the tensor on the host")

    monkeypatch.setattr(torch.Tensor, "item", no_host_read)
    scaler.update(new_scale=new_scale)
    monkeypatch.undo()
    assert scaler.get_scale() == 512.0
    new_scale.fill_(3.0)  # a copy, not the caller's tensor
    assert scaler.get_scale() == 512.0
    # the iteration is over, as after update(float)
    scaler.scale(torch.ones((), device=device))
    param.grad = torch.ones_like(param)
    scaler.step(fusedamp.optim.SGD([param], lr=0.1))
    scaler.update()


@pytest.mark.parametrize("bad", [
    torch.tensor([1.0, 2.0]),                    # two elements
    torch.tensor([4], dtype=torch.int32),        # not floating point
    torch.tensor([4.0], requires_grad=True),     # requires grad
])
def test_update_with_a_bad_tensor_is_refused_and_changes_nothing(device, bad):
    param = torch.nn.Parameter(torch.zeros(4, device=device))
    scaler = _stepped_scaler(device, param)
    with pytest.raises(RuntimeError, match="new_scale must be a float or a one-element"):
        scaler.update(new_scale=bad.to(device))
    assert scaler.get_scale() == 2.0 ** 10
    scaler.update()  # the iteration is still open: its step is still there to update from
    assert scaler.get_scale() == 2.0 ** 10
