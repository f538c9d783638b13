"""The loss scale of fusedamp.GradScaler: its sequence against torch.amp.GradScaler and torch's
update op (growth, backoff, hysteresis, bounds), its inverse against torch's, and the scale
history it records, kept through a pickle."""
import pytest
import torch

import fusedamp
from op_helpers import _model_params, scalar, scale_model
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
    for i, overflow in enumerate(_overflow_pattern(200, seed=1)):
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
    assert scaler.scale_history()[-1] == ref.get_scale()


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
    # One isolated overflow is tolerated; the run of four backs off three times, to the
    # minimum; clean steps grow every two steps, up to the maximum (the plain-Python model).
    model = [s for s, _, _ in scale_model(pattern, 256.0, 2.0, 0.5, 2, 2, 64.0, 1024.0)]
    assert seen == model
    assert seen[:6] == [256, 256, 256, 128, 64, 64] and seen[-1] == 1024


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


def test_the_scale_history_is_each_update_s_scale_and_travels_with_a_pickle(device):
    """scale_history(): the scale after each update(), an explicit update(new_scale) included,
    written by the update op into the scaler's ring (no op of its own); a pickled and restored
    scaler keeps it and goes on recording; history=False records nothing."""
    import pickle

    params = [torch.nn.Parameter(torch.randn(4, device=device).half())]
    opt = fusedamp.optim.AdamW(params, lr=1e-3)
    scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2)
    quiet = fusedamp.GradScaler(device, init_scale=2.0 ** 10, history=False)
    scales = []
    for step in range(5):
        for s in (scaler, quiet):
            s.scale(torch.ones((), device=device))
            params[0].grad = torch.full((4,), float("inf") if step == 2 else 1.0,
                                        device=device).half()
            s.step(opt)
            if step == 3:
                s.update(100.0)
            else:
                s.update()
        scales.append(scaler.get_scale())
    assert scales[3] == 100.0 and scales[2] == scales[1] / 2  # the overflow's backoff
    assert scaler.scale_history() == scales
    assert quiet.scale_history() == []
    restored = pickle.loads(pickle.dumps(scaler))
    assert restored.scale_history() == scales
    restored.scale(torch.ones((), device=device))
    params[0].grad = torch.ones(4, device=device).half()
    restored.step(opt)
    restored.update()
    assert restored.scale_history() == scales + [restored.get_scale()]


def test_a_scaler_pickled_with_a_python_history_keeps_it(device):
    """Pickles made while the scale history was a Python History on the scaler (13 engine
    arguments, a `_history` entry): unpickled, the engine takes the history over, and
    history=None there (history=False then) stays off."""
    for recorded in ([1024.0, 512.0, 1024.0], None):
        scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 10)
        state = scaler.__getstate__()
        del state["_scale_history"]
        state["_engine_args"] = state["_engine_args"][:-1]
        old = None
        if recorded is not None:
            old = fusedamp.History()
            for value in recorded:
                old.record(torch.tensor([value], device=device))
        state["_history"] = old
        restored = fusedamp.GradScaler.__new__(fusedamp.GradScaler)
        restored.__setstate__(state)
        assert restored.scale_history() == (recorded or [])
        restored.update(8.0)
        assert restored.scale_history() == ((recorded + [8.0]) if recorded else [])
