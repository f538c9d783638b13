"""What torch's machinery sees of a fusedamp step: __torch_dispatch__ modes and the profiler see
the step op, inside the profiler's Optimizer.step scope; torch's step hooks run as torch runs
them; LR schedulers and step hooks see the steps taken through scaler.step(opt)."""
import pytest
import torch

import fusedamp
from op_helpers import _model_params, three_fp16_params_and


def test_scaler_step_goes_through_optimizer_step(device):
    """LR schedulers and step hooks see steps taken through scaler.step(opt)."""
    import warnings

    params = _model_params(device)
    opt = fusedamp.optim.SGD(params, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = fusedamp.GradScaler(device)
    calls = []
    opt.register_step_post_hook(lambda o, a, k: calls.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" fails
        for _ in range(3):
            loss = sum((p ** 2).sum() for p in params)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            sched.step()
    assert len(calls) == 3
    assert opt.param_groups[0]["lr"] == 0.1 / 8


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_engine_step_ops_are_seen_by_dispatch_modes_and_the_profiler(device, kind):
    """From its second step on, the engine's CPU step op goes straight to its kernel (the engine
    knows its own tensors' dispatch keys). A __torch_dispatch__ mode must still see the op
    (the call then goes through the dispatcher), and the profiler must still record it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class SeenOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    op = "adam_step_" if kind == "AdamW" else "sgd_step_"
    params, opt = three_fp16_params_and(kind, device, numel=6)
    for step in range(4):
        for p in params:
            p.grad = torch.randn(6, device=device).half()
        if step == 2:
            with SeenOps() as mode:
                opt.step()
            assert f"fusedamp.{op}.default" in mode.names, mode.names
        elif step == 3:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                opt.step()
            assert f"fusedamp::{op}" in {e.name for e in prof.events()}
        else:
            opt.step()


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_a_scaled_step_through_the_dispatcher_has_the_same_bits(device, kind):
    """A scaled, clipped step whose ops go through the dispatcher (a __torch_dispatch__ mode sees
    the statistics pass and the step op) against the same steps where the engine calls its CPU
    kernels on the rows it checked: parameters, state, the record and the norm bit for bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class SeenOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func))
            return func(*args, **(kwargs or {}))

    def make():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, device=device).half()) for n in (5, 40, 3)]
        params.append(torch.nn.Parameter(torch.randn(7, device=device)))  # a bucket of its own
        opt = getattr(fusedamp.optim, kind)(params, lr=1e-2, max_grad_norm=0.5,
                                            **({"momentum": 0.9} if kind == "SGD" else {}))
        return params, opt, fusedamp.GradScaler(device, init_scale=64.0)

    direct, seen = make(), make()
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        grads = [torch.randn(p.shape, generator=gen).to(device, p.dtype) for p in direct[0]]
        if step == 2:
            grads[1][7] = float("inf")
        for (params, opt, scaler), through in ((direct, False), (seen, True)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            scaler.scale(torch.ones((), device=device))
            if through:
                with SeenOps() as mode:
                    scaler.step(opt)
                assert {"fusedamp.grad_stats_.default",
                        f"fusedamp.{'adam' if kind == 'AdamW' else 'sgd'}_step_.default"} <= \
                    mode.names, mode.names
            else:
                scaler.step(opt)
            scaler.update()
        for a, b in zip(direct[0], seen[0]):
            assert torch.equal(a, b) and torch.equal(a.grad, b.grad), step
            for name, value in direct[1].state[a].items():
                assert torch.equal(value, seen[1].state[b][name]), (step, name)
    assert direct[2].telemetry() == seen[2].telemetry()
    assert direct[2].telemetry()["first_nonfinite"][2] is not None


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_the_profiler_sees_the_step_scope_around_the_engine_ops(device, kind):
    """torch.optim's profiler scope "Optimizer.step#<class>.step" (opened by the engine's call
    when no hook runs, by torch's wrapper when one does) encloses the step op, plain or scaled."""
    op = "fusedamp::adam_step_" if kind == "AdamW" else "fusedamp::sgd_step_"
    scope = f"Optimizer.step#{kind}.step"
    params = [torch.nn.Parameter(torch.randn(6, device=device).half()) for _ in range(2)]
    opt = getattr(fusedamp.optim, kind)(params, lr=1e-2)
    scaler = fusedamp.GradScaler(device, init_scale=8.0)

    def enclosed(prof):
        for e in prof.events():
            if e.name == op:
                parent = e.cpu_parent
                while parent is not None and parent.name != scope:
                    parent = parent.cpu_parent
                return parent is not None
        raise AssertionError(f"{op} was not recorded")

    for how in ("plain", "scaled", "hooked"):
        for p in params:
            p.grad = torch.randn(6, device=device).half()
        handle = opt.register_step_post_hook(lambda *a: None) if how == "hooked" else None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            if how == "scaled":
                scaler.scale(torch.ones((), device=device))
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        if handle is not None:
            handle.remove()
        assert enclosed(prof), how


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_step_hooks_run_as_torch_runs_them(device, kind):
    """fusedamp's step runs torch's step hooks itself (it skips torch's wrapper when none is
    registered): per-optimizer and global pre/post hooks in torch's order, with torch's
    arguments, a pre-hook's replacement arguments honoured; once the hooks are removed the
    step is the plain one again. torch.optim's optimizer of the same kind is the reference."""
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    def make(cls_of):
        params = [torch.nn.Parameter(torch.ones(4, device=device))]
        opt = cls_of[kind](params, lr=0.1)
        return params, opt

    def run(cls_of):
        params, opt = make(cls_of)
        calls = []
        closures_called = []

        def closure():
            closures_called.append(True)
            return torch.tensor(3.0)

        def own_pre(o, args, kwargs):
            calls.append(("own_pre", o is opt, len(args), sorted(kwargs)))
            if not kwargs and len(args) == 1:
                return args, {"closure": closure}  # torch's argument rewriting
            return None

        handles = [opt.register_step_pre_hook(own_pre),
                   opt.register_step_post_hook(
                       lambda o, args, kwargs: calls.append(("own_post", o is opt,
                                                             sorted(kwargs)))),
                   register_optimizer_step_pre_hook(
                       lambda o, args, kwargs: calls.append(("global_pre", o is opt))),
                   register_optimizer_step_post_hook(
                       lambda o, args, kwargs: calls.append(("global_post", o is opt)))]
        try:
            params[0].grad = torch.full((4,), 0.5, device=device)
            loss = opt.step()  # the pre-hook adds the closure
        finally:
            for h in handles:
                h.remove()
        params[0].grad = torch.full((4,), 0.5, device=device)
        calls_before = list(calls)
        assert opt.step() is None  # no hook left: nothing recorded
        return calls_before, calls, float(loss), len(closures_called), params[0].detach().cpu()

    ours = run({"AdamW": fusedamp.optim.AdamW, "SGD": fusedamp.optim.SGD})
    ref = run({"AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD})
    assert ours[0] == ref[0] and ours[0][0][0] == "global_pre" and len(ours[0]) == 4
    assert ours[1] == ours[0]  # the step without hooks called none
    assert ours[2:4] == ref[2:4] == (3.0, 1)
    torch.testing.assert_close(ours[4], ref[4])
