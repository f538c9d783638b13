"""torch.optim's optim_db configurations of Adam, AdamW and SGD, run as trajectories against
fusedamp.optim.

The configurations are PyTorch's (BSD-3-Clause, Copyright (c) PyTorch contributors): the
``optim_db`` entries of torch/testing/_internal/common_optimizers.py in the installed torch
2.11.0 (optim_inputs_func_adam / _adamw / _sgd, expanded by
_get_optim_inputs_including_global_cliquey_kwargs with the foreach / fused / differentiable
flags). The list is the one optim_db gives for CUDA, which contains the CPU one (on the CPU,
torch's helper leaves out the foreach variants only because CPU has no foreach kernels; torch's
foreach path runs on the CPU all the same). One configuration is added that torch 2.11's
Adam takes but optim_db does not list: Adam(weight_decay=0.1, decoupled_weight_decay=True)
with the same flag variants.

Each configuration's kwargs go, unchanged, to fusedamp.optim.X over FP32 parameters (master
weights do not apply to FP32 parameters). The reference is torch.optim.X with the same kwargs
and foreach=False, fused=False, differentiable=False (the single-tensor "for-loop" path;
differentiable changes no number). On the CPU torch cannot run capturable=True (it asserts the
parameters are on a capturable device), so there the reference drops capturable (same
arithmetic); fusedamp gets the configuration as it is.

Two tests per (kind, configuration, device):
  * test_trajectory: 20 steps on a small MLP with a StepLR schedule; after step 10 the fusedamp
    optimizer's state_dict (and the scheduler's) goes through torch.save/torch.load, the
    optimizer and the scheduler are re-created and loaded, and training goes on. Parameters are
    compared after every step, the optimizer state and the learning rate at the end.
  * test_migration: torch -> fusedamp -> torch. A torch optimizer trains 7 steps; its
    state_dict (through torch.save/torch.load) is loaded into a fresh fusedamp optimizer, which
    trains 7 steps; fusedamp's state_dict is loaded into a fresh torch optimizer, which trains
    the last 6. The trajectory must be torch-alone's for 20 steps.
And test_optimizer_parity_with_torch_groups_and_scheduler: two param groups (the second with
its own lr and no weight decay) under a OneCycleLR schedule, 40 steps against torch.optim.

Tolerance (FP32 rounding): fusedamp computes in FP32 with torch's order of operations, so each
step may differ from torch's only by the rounding of a few FP32 operations per element (a fused
multiply-add, a vectorised sqrt/division, the bias corrections in FP32 instead of double). Over
20 steps the parameters and state may then differ by a few ulps per step: rtol = atol =
STEPS * 8 * eps(float32) ~ 1.9e-5 for values of order 1 (the MLP's parameters are). A wrong
formula, a missed or doubled step, a wrong hyper-parameter or a lost state is off by orders of
magnitude more.

Failing cases are xfail(strict=True) with their cause (XFAIL below), so `make test` stays
green and a fixed case turns the xfail into a failure.
"""
import io
from copy import deepcopy

import pytest
import torch
from torch.testing._internal.common_optimizers import (
    OptimizerInput, _get_optim_inputs_including_global_cliquey_kwargs, optim_db)
from torch.testing._internal.common_utils import TestCase

import fusedamp
from op_helpers import _grads, _model_params, max_abs_diff

STEPS = 20
SAVE_AT = 10                 # trajectory: state_dict round trip after this many steps
MIGRATE_AT = (7, 14)         # migration: torch for 7 steps, fusedamp for 7, torch for the rest
RTOL = ATOL = STEPS * 8 * torch.finfo(torch.float32).eps

_KINDS = {"Adam": fusedamp.optim.Adam, "AdamW": fusedamp.optim.AdamW, "SGD": fusedamp.optim.SGD}
_FLAGS = ("foreach", "fused", "differentiable")


def _configs(kind):
    info = next(o for o in optim_db if o.optim_cls.__name__ == kind)
    inputs = _get_optim_inputs_including_global_cliquey_kwargs("cuda", torch.float32, info)
    if kind == "Adam":  # torch 2.11's Adam takes it; optim_db does not list it
        base = {"weight_decay": 0.1, "decoupled_weight_decay": True}
        desc = "decoupled_weight_decay (added)"
        flags = {f: False for f in _FLAGS}
        inputs.append(OptimizerInput(None, {**base, **flags}, desc))
        for f in _FLAGS:
            inputs.append(OptimizerInput(None, {**base, **flags, f: True}, f"{desc} & {f}"))
    return inputs


def _ident(desc):
    return desc.replace(" & ", "&").replace(", ", ",").replace(" ", "_")


# ---- expected failures: (test or None for both, predicate on (kind, kwargs), cause) ---------
XFAIL = []


def cases(test, differentiable=False):
    """The configurations with (differentiable=True) or without differentiable: fusedamp refuses
    it on purpose — the fused step cannot be recorded by autograd — and says so (README,
    Differences from torch.amp), so those configurations are tested for that refusal."""
    out = []
    for kind in _KINDS:
        for cfg in _configs(kind):
            if bool(cfg.kwargs.get("differentiable", False)) != differentiable:
                continue
            ident = f"{kind}-{_ident(cfg.desc)}"
            reasons = [r for t, applies, r in XFAIL
                       if t in (None, test) and applies(kind, cfg.kwargs)]
            marks = [pytest.mark.xfail(strict=True, reason=" | ".join(reasons))] if reasons else []
            out.append(pytest.param(kind, cfg.kwargs, id=ident, marks=marks))
    return out


@pytest.fixture
def tc():
    """torch's TestCase, for its assertEqual."""
    return TestCase()


def _on(kwargs, device):
    """A configuration's kwargs with tensors (lr, betas) moved to `device`, fresh copies."""
    def move(v):
        if isinstance(v, torch.Tensor):
            return v.clone().to(device)
        if isinstance(v, tuple):
            return tuple(move(x) for x in v)
        return v
    return {k: move(v) for k, v in kwargs.items()}


def _reference_kwargs(kwargs, device):
    ref = _on(kwargs, device)
    ref.update(foreach=False, fused=False, differentiable=False)
    if torch.device(device).type == "cpu":
        ref.pop("capturable", None)
    return ref


def _problem(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model = model.to(device)
    batches = [(torch.randn(8, 4, device=device), torch.randn(8, 3, device=device))
               for _ in range(STEPS)]
    return model, batches


def _scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)


def _train_step(model, opt, sched, batch):
    x, y = batch
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    sched.step()


def _through_disk(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def _restart(cls, model, kwargs, opt, sched):
    """Checkpoint (optimizer + scheduler) through torch.save/torch.load, then a new optimizer
    of class `cls` and a new scheduler, loaded from it (torch's documented order)."""
    ckpt = _through_disk({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()})
    new_opt = cls(model.parameters(), **kwargs)
    new_sched = _scheduler(new_opt)
    new_opt.load_state_dict(ckpt["optimizer"])
    new_sched.load_state_dict(ckpt["scheduler"])
    return new_opt, new_sched


def _lr(opt):
    lr = opt.param_groups[0]["lr"]
    return float(lr) if isinstance(lr, torch.Tensor) else lr


def _check_params(tc, model, ref_model, step):
    for (name, p), r in zip(model.named_parameters(), ref_model.parameters()):
        tc.assertEqual(p, r, atol=ATOL, rtol=RTOL, msg=f"{name} after step {step}")


def _check_state(tc, opt, model, ref_opt, ref_model):
    tc.assertEqual(_lr(opt), _lr(ref_opt), msg="learning rate")
    for (name, p), r in zip(model.named_parameters(), ref_model.parameters()):
        ref_state, state = ref_opt.state[r], opt.state[p]
        for k, v in ref_state.items():
            tc.assertTrue(k in state, msg=f"{name}: state has no {k!r} (has {sorted(state)})")
            actual = state[k]
            if k == "step":
                tc.assertEqual(float(actual), float(v), msg=f"{name}: step")
            else:
                tc.assertEqual(actual, v, atol=ATOL, rtol=RTOL, msg=f"{name}: {k}")


def _alongside_torch(tc, device, kind, kwargs, first_cls, first_kwargs, restarts):
    """One optimizer (first_cls(**first_kwargs), then whatever restarts[step] makes of it after
    that step: (cls, kwargs) through a checkpoint) and torch's reference on the same problem,
    compared after every step and, at the end, in their state."""
    model, batches = _problem(device)
    ref_model = deepcopy(model)
    ref_opt = getattr(torch.optim, kind)(ref_model.parameters(),
                                         **_reference_kwargs(kwargs, device))
    ref_sched = _scheduler(ref_opt)
    opt = first_cls(model.parameters(), **first_kwargs)
    sched = _scheduler(opt)
    for step, batch in enumerate(batches, start=1):
        _train_step(ref_model, ref_opt, ref_sched, batch)
        _train_step(model, opt, sched, batch)
        _check_params(tc, model, ref_model, step)
        if step in restarts:
            cls, cls_kwargs = restarts[step]
            opt, sched = _restart(cls, model, cls_kwargs, opt, sched)
    _check_state(tc, opt, model, ref_opt, ref_model)


@pytest.mark.parametrize("kind,kwargs", cases("test_trajectory"))
def test_trajectory(tc, device, kind, kwargs):
    cls, ours = _KINDS[kind], _on(kwargs, device)
    _alongside_torch(tc, device, kind, kwargs, cls, ours, {SAVE_AT: (cls, ours)})


@pytest.mark.parametrize("kind,kwargs", cases("test_migration"))
def test_migration(tc, device, kind, kwargs):
    torch_cls, fusedamp_cls = getattr(torch.optim, kind), _KINDS[kind]
    theirs = _reference_kwargs(kwargs, device)
    _alongside_torch(tc, device, kind, kwargs, torch_cls, theirs,
                     {MIGRATE_AT[0]: (fusedamp_cls, _on(kwargs, device)),  # torch -> fusedamp
                      MIGRATE_AT[1]: (torch_cls, theirs)})                # fusedamp -> torch


@pytest.mark.parametrize("kind,kwargs", cases("test_differentiable_refused", differentiable=True))
def test_differentiable_refused(device, kind, kwargs):
    """differentiable=True asks for a step autograd can differentiate through (meta-learning);
    fusedamp's fused step cannot be, so it refuses clearly rather than silently not recording."""
    model, _ = _problem(device)
    with pytest.raises(ValueError, match="differentiable=True is not supported"):
        _KINDS[kind](model.parameters(), **_on(kwargs, device))


@pytest.mark.parametrize("cls", ["AdamW", "Adam", "SGD"])
def test_optimizer_parity_with_torch_groups_and_scheduler(device, cls, record_diff):
    ours = _model_params(device, seed=3)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(momentum=0.9, nesterov=True, weight_decay=1e-3) if cls == "SGD" else dict(
        betas=(0.8, 0.95), weight_decay=0.02)
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.003, "weight_decay": 0.0}]
    opt = getattr(fusedamp.optim, cls)(groups(ours), lr=0.01, **kw)
    ref_opt = getattr(torch.optim, cls)(groups(ref), lr=0.01, foreach=False, **kw)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 0.005], total_steps=40)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=[0.02, 0.005], total_steps=40)
    for step in range(40):
        for p, r, g in zip(ours, ref, _grads(device, torch.float32, step)):
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
    diff = max_abs_diff([p.detach() for p in ours], [r.detach() for r in ref])
    record_diff(f"fusedamp.optim.{cls} fp32 (groups + OneCycleLR) vs torch.optim", diff)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6)
