"""fusedamp.lr_scheduler: each schedule against torch's scheduler of the same name (or LambdaLR
with the same factor) evaluated at the number of *applied* steps, skipped steps not counted,
with no host read; state_dict resume; refusals."""
import math

import pytest
import torch

import fusedamp
from fusedamp import lr_scheduler as fs

BASE_LRS = [0.1, 0.02]
SKIPPED = {3, 4, 9, 17}  # iterations whose step overflows


def _fused(device):
    params = [torch.nn.Parameter(torch.zeros(4, device=device)) for _ in BASE_LRS]
    return fusedamp.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, BASE_LRS)])


def _torch_lrs(make_torch_sched, n):
    """torch's lr of each group after k scheduler steps, k = 0..n."""
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr}
                           for lr in BASE_LRS])
    sched = make_torch_sched(opt)
    out = [[g["lr"] for g in opt.param_groups]]
    for _ in range(n):
        opt.step()
        sched.step()
        out.append([g["lr"] for g in opt.param_groups])
    return out


def _fused_lrs(device, make_sched, iterations):
    """fusedamp's lr after each iteration (skipped ones included), with the applied count."""
    opt = _fused(device)
    sched = make_sched(opt)
    scaler = fusedamp.GradScaler(device, init_scale=2.0)
    out = []
    applied = 0
    for it in range(iterations):
        scaler.scale(torch.ones((), device=device))
        for g in opt.param_groups:
            g["params"][0].grad = torch.full((4,), float("inf") if it in SKIPPED else 1.0,
                                             device=device)
        scaler.step(opt)
        scaler.update()
        sched.step()
        applied += it not in SKIPPED
        out.append((applied, [float(g["lr"]) for g in opt.param_groups]))
    return out


CASES = {
    "ConstantLR": (lambda o: fs.ConstantLR(o, factor=0.25, total_iters=6),
                   lambda o: torch.optim.lr_scheduler.ConstantLR(o, factor=0.25, total_iters=6)),
    "LinearLR": (lambda o: fs.LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=8),
                 lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1,
                                                             end_factor=1.0, total_iters=8)),
    "StepLR": (lambda o: fs.StepLR(o, step_size=5, gamma=0.5),
               lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5)),
    "ExponentialLR": (lambda o: fs.ExponentialLR(o, gamma=0.9),
                      lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9)),
    "PolynomialLR": (lambda o: fs.PolynomialLR(o, total_iters=12, power=2.0),
                     lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=12,
                                                                     power=2.0)),
    "CosineAnnealingLR": (lambda o: fs.CosineAnnealingLR(o, T_max=15, eta_min=0.001),
                          lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(
                              o, T_max=15, eta_min=0.001)),
    "WarmupCosine": (lambda o: fs.WarmupCosine(o, warmup_steps=5, total_steps=20,
                                               min_lr_ratio=0.1),
                     lambda o: torch.optim.lr_scheduler.LambdaLR(
                         o, lambda t: t / 5 if t < 5 else 0.1 + 0.9 * 0.5 * (
                             1 + math.cos(math.pi * min(1.0, (t - 5) / 15))))),
    "InverseSqrt": (lambda o: fs.InverseSqrt(o, warmup_steps=4),
                    lambda o: torch.optim.lr_scheduler.LambdaLR(
                        o, lambda t: t / 4 if t < 4 else math.sqrt(4 / t))),
    "OneCycleLR": (lambda o: fs.OneCycleLR(o, max_lr=[0.5, 0.05], total_steps=40,
                                           cycle_momentum=False),
                   lambda o: torch.optim.lr_scheduler.OneCycleLR(
                       o, max_lr=[0.5, 0.05], total_steps=40, cycle_momentum=False)),
    "OneCycleLR-three-phase-linear": (
        lambda o: fs.OneCycleLR(o, max_lr=0.3, total_steps=32, pct_start=0.25,
                                anneal_strategy="linear", three_phase=True,
                                cycle_momentum=False),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(
            o, max_lr=0.3, total_steps=32, pct_start=0.25, anneal_strategy="linear",
            three_phase=True, cycle_momentum=False)),
    "SequentialLR": (lambda o: fs.SequentialLR(
                         o, [fs.LinearLR(o, start_factor=0.2, total_iters=4),
                             fs.ExponentialLR(o, gamma=0.8)], milestones=[6]),
                     lambda o: torch.optim.lr_scheduler.SequentialLR(
                         o, [torch.optim.lr_scheduler.LinearLR(o, start_factor=0.2,
                                                               total_iters=4),
                             torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8)],
                         milestones=[6])),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_lr_is_torchs_at_the_applied_step(device, name):
    make_ours, make_torch = CASES[name]
    ours = _fused_lrs(device, make_ours, 30)
    want = _torch_lrs(make_torch, 30)
    for applied, lrs in ours:
        # The lr tensors are FP32: torch's FP64 value within an FP32 rounding (torch chains
        # some schedules step by step, which leaves their last FP64 bits apart from the
        # closed forms computed here).
        assert lrs == pytest.approx(want[applied], rel=2.0 ** -23, abs=1e-12), \
            (applied, lrs, want[applied])
    assert ours[-1][0] == 30 - len(SKIPPED)


def test_a_skipped_step_does_not_move_the_schedule(device):
    ours = _fused_lrs(device, lambda o: fs.StepLR(o, step_size=1, gamma=0.5), 6)
    assert ours[2][1] == ours[3][1] == ours[4][1]  # iterations 3 and 4 were skipped
    assert ours[5][1][0] == pytest.approx(ours[4][1][0] * 0.5)


def test_step_reads_nothing_on_the_host(device, monkeypatch):
    opt = _fused(device)
    sched = fs.CosineAnnealingLR(opt, T_max=10)
    for g in opt.param_groups:
        g["params"][0].grad = torch.ones(4, device=device)
    opt.step()

    def no_host_read(self):
        raise AssertionError("the schedule read a tensor on the host")

    monkeypatch.setattr(torch.Tensor, "item", no_host_read)
    monkeypatch.setattr(torch.Tensor, "__float__", no_host_read)
    monkeypatch.setattr(torch.Tensor, "__bool__", no_host_read)
    sched.step()
    monkeypatch.undo()
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(
        0.1 * (1 + math.cos(math.pi / 10)) / 2)


def test_state_dict_resumes_exactly(device):
    def run(resume_at=None, n=12):
        opt = _fused(device)
        sched = fs.WarmupCosine(opt, warmup_steps=3, total_steps=10)
        lrs = []
        for it in range(n):
            if it == resume_at:
                saved = sched.state_dict()
                opt = _fused(device)
                sched = fs.WarmupCosine(opt, warmup_steps=3, total_steps=10)
                sched.load_state_dict(saved)
            for g in opt.param_groups:
                g["params"][0].grad = torch.ones(4, device=device)
            opt.step()
            sched.step()
            lrs.append([g["lr"].clone() for g in opt.param_groups])
        return lrs

    straight, resumed = run(), run(resume_at=5)
    assert all(torch.equal(a, b) for x, y in zip(straight, resumed) for a, b in zip(x, y))


def test_refusals(device):
    torch_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(TypeError, match="does not report which steps it applied"):
        fs.StepLR(torch_opt, step_size=2)
    with pytest.raises(TypeError, match="does not report which steps it applied"):
        fs.OneCycleLR(torch_opt, max_lr=1.0, total_steps=10, cycle_momentum=False)
    assert torch_opt.param_groups[0]["lr"] == 0.1 and "initial_lr" not in torch_opt.param_groups[0]
    opt = _fused(device)
    with pytest.raises(ValueError, match="warmup_steps < total_steps"):
        fs.WarmupCosine(opt, warmup_steps=10, total_steps=10)
    with pytest.raises(ValueError, match="step_size must be a positive integer"):
        fs.StepLR(opt, step_size=0)
    sched = fs.StepLR(opt, step_size=2)
    with pytest.raises(RuntimeError, match="before the optimizer's first step"):
        sched.step()
    with pytest.raises(ValueError, match="cycle_momentum=False"):
        fs.OneCycleLR(opt, max_lr=0.1, total_steps=10)  # torch's default cycles momentum


TORCH_CONVERTIBLE = ["ConstantLR", "LinearLR", "StepLR", "ExponentialLR", "PolynomialLR",
                     "CosineAnnealingLR", "OneCycleLR", "OneCycleLR-three-phase-linear",
                     "SequentialLR"]


@pytest.mark.parametrize("name", TORCH_CONVERTIBLE)
def test_from_torch_gives_torchs_lr_at_the_applied_step(device, name):
    """A torch scheduler made on a fusedamp optimizer, converted: torch's lr at the applied
    step (the Lightning plugin's skip_aware_lr does this for configure_optimizers' schedulers)."""
    _, make_torch = CASES[name]
    ours = _fused_lrs(device, lambda o: fs.from_torch(make_torch(o), o), 30)
    want = _torch_lrs(make_torch, 30)
    for applied, lrs in ours:
        assert lrs == pytest.approx(want[applied], rel=2.0 ** -23, abs=1e-12), applied


def test_from_torch_refuses_what_has_no_counterpart(device):
    opt = _fused(device)
    for sched in (torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0),
                  torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=10)):
        lrs = [g["lr"] for g in opt.param_groups]
        with pytest.raises(ValueError, match="no skip-aware counterpart|cycles the momentum"):
            fs.from_torch(sched, opt)
        assert [g["lr"] for g in opt.param_groups] == lrs
