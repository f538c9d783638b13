"""fusedamp.initialize keeps the user's algorithm: given a torch optimizer (every configuration
torch's optim_db lists for Adam, AdamW and SGD), the FP32 masters follow torch's FP32 run of it;
groups added later take its defaults; what it cannot honour (an LR scheduler made before it,
differentiable=True) is refused with the model untouched; a tensor lr of any float dtype follows
its scheduler. Every test runs on every device present."""
import copy

import pytest
import torch
from torch import nn

import fusedamp
from model_helpers import _assert_same, _mlp, _snapshot


# ---- initialize keeps the user's algorithm ---------------------------------------------------
@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.Adam(ps, lr=2e-3, betas=(0.8, 0.95), weight_decay=0.1,
                                decoupled_weight_decay=True),
    lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05, maximize=True),
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-3, dtype=torch.float64)),
], ids=["Adam-decoupled", "AdamW-maximize", "SGD-nesterov", "Adam-tensor-lr"])
def test_initialize_trains_the_users_algorithm(device, make_opt):
    _assert_initialize_trains(device, make_opt)


def _assert_initialize_trains(device, make_opt):
    """The FP32 masters follow torch's FP32 run of the same optimizer on the same gradients
    (FP16 values, which FP32 holds exactly, fed to both as .grad) within FP32 rounding."""
    model = _mlp(device)
    reference = copy.deepcopy(model).float()
    ref_opt = make_opt(list(reference.parameters()))
    model, opt, _ = fusedamp.initialize(model, make_opt(list(model.parameters())),
                                        torch.float16, skip_nonfinite=False)
    assert type(opt).__name__ == type(ref_opt).__name__
    with torch.no_grad():  # both start from the FP16 weights (the masters' starting point)
        for p, r in zip(model.parameters(), reference.parameters()):
            r.copy_(p.float())
    torch.manual_seed(1)
    for _ in range(20):
        for p, r in zip(model.parameters(), reference.parameters()):
            g = torch.randn(p.shape, device=device).to(p.dtype)
            p.grad, r.grad = g, g.float()
        opt.step()
        ref_opt.step()
    weights = fusedamp.master_weights(model, opt)
    for (name, r) in reference.named_parameters():
        torch.testing.assert_close(weights[name], r.detach(), rtol=2e-6, atol=2e-6)


def _optim_db_cases():
    from test_torch_optim_parity import _KINDS, _configs, _ident
    return [pytest.param(kind, cfg.kwargs, id=f"{kind}-{_ident(cfg.desc)}")
            for kind in _KINDS for cfg in _configs(kind)
            if not cfg.kwargs.get("differentiable", False)]  # refused on purpose (README)


@pytest.mark.filterwarnings("ignore:fusedamp.*has no effect")
@pytest.mark.parametrize("kind,kwargs", _optim_db_cases())
def test_initialize_keeps_every_optim_db_configuration(device, kind, kwargs):
    """Every configuration torch's optim_db lists for Adam, AdamW and SGD (differentiable aside),
    given to initialize as a torch optimizer: the FP32 masters follow torch's FP32 run on the
    same gradients within FP32 rounding over 20 steps."""
    torch_cls = getattr(torch.optim, kind)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("foreach", "fused", "capturable")}
    _assert_initialize_trains(device, lambda ps: torch_cls(ps, **kwargs))


def test_initialize_keeps_defaults_for_added_groups_and_refuses_an_early_scheduler(device):
    model = _mlp(device)
    extra = nn.Parameter(torch.randn(4, device=device))
    model.register_parameter("extra", extra)
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if n != "extra"],
                            lr=5e-4, weight_decay=0.2, betas=(0.85, 0.98))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    before = _snapshot(model)
    with pytest.raises(ValueError, match="LR scheduler"):
        fusedamp.initialize(model, opt, torch.float16)
    _assert_same(before, _snapshot(model))
    del sched
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if n != "extra"],
                            lr=5e-4, weight_decay=0.2, betas=(0.85, 0.98))
    model, fused, _ = fusedamp.initialize(model, opt, torch.float16, max_grad_norm=2.0)
    fused.add_param_group({"params": [extra]})
    added = fused.param_groups[-1]
    assert (added["lr"], added["weight_decay"], added["betas"], added["max_grad_norm"]) == (
        5e-4, 0.2, (0.85, 0.98), 2.0)


def test_initialize_refuses_what_it_cannot_honour(device):
    """differentiable=True asks for a step autograd can differentiate; the fused step cannot
    be: a clear error naming it, and the model untouched."""
    model = _mlp(device)
    opt = torch.optim.Adam(model.parameters(), differentiable=True)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match="differentiable"):
        fusedamp.initialize(model, opt, torch.float16)
    _assert_same(before, _snapshot(model, opt))


# ---- a tensor lr and its scheduler -----------------------------------------------------------
def test_tensor_lr_of_any_float_dtype_follows_its_scheduler(device):
    """A float64 tensor lr updated in place by a scheduler drives the fused step."""
    model = _mlp(device)
    reference = copy.deepcopy(model)
    lr = torch.tensor(0.1, dtype=torch.float64)
    opt = fusedamp.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=torch.tensor(0.1, dtype=torch.float64))
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref_opt)]
    for _ in range(4):
        for p, r in zip(model.parameters(), reference.parameters()):
            p.grad = torch.ones_like(p)
            r.grad = torch.ones_like(r)
        opt.step()
        ref_opt.step()
        for s in scheds:
            s.step()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-6)
    assert opt.param_groups[0]["lr"] is lr or float(opt.param_groups[0]["lr"]) == 0.1 / 16
