"""The Python package: GradScaler, fusedamp.optim, step accounting, checkpoints."""
import pytest
import torch

import fusedamp
from op_helpers import _grads, _model_params, max_abs_diff, three_fp16_params_and


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


def test_bad_arguments_raise_clear_errors(device):
    ps = _model_params(device)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        fusedamp.optim.AdamW(ps, lr=-1.0)
    with pytest.raises(ValueError, match="beta"):
        fusedamp.optim.Adam(ps, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="Nesterov"):
        fusedamp.optim.SGD(ps, nesterov=True)
    with pytest.raises(RuntimeError, match="growth_factor"):
        fusedamp.GradScaler(device, growth_factor=1.0)
    # Not an error: scale() multiplies any tensor of outputs, with torch.amp's type promotion.
    ours, theirs = fusedamp.GradScaler(device), torch.amp.GradScaler(device)
    for t in (torch.ones(3, device=device, dtype=torch.float16), torch.ones((), device=device,
                                                                          dtype=torch.float16)):
        if theirs.is_enabled():
            a, b = ours.scale(t), theirs.scale(t)
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_diagnostics_grad_norm_history_and_nonfinite_names(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = model.to(device)
    model, opt, scaler = fusedamp.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.float16, max_grad_norm=1.0)
    if not scaler.is_enabled():  # CUDA scaler asked for on a CPU-only machine: use the CPU one
        scaler = fusedamp.GradScaler(device)
    expected_norms, scales = [], []
    for step in range(6):
        x = torch.randn(32, 8, device=device)
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        s = scaler.get_scale()
        grads = [p.grad.float() / s for p in model.parameters()]
        expected_norms.append(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads])).item())
        if step == 4:
            model[2].weight.grad[1, 3] = float("nan")
            assert fusedamp.nonfinite_grads(model) == ["2.weight"]
        else:
            assert fusedamp.nonfinite_grads(model) == []
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    history = opt.grad_norm_history()
    assert len(history) == 6
    for i, (got, want) in enumerate(zip(history, expected_norms)):
        if i != 4:
            assert abs(got - want) <= 1e-3 * want, (i, got, want)
    assert history[4] != history[4]  # the NaN step's norm is NaN: visible in the history
    assert scaler.scale_history() == scales
    assert opt.skipped_steps.item() == 1


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_convert_module_dtypes_at_each_layer(device, dtype):
    """Norm parameters stay FP32; batch norm runs on the low-precision activations natively,
    the other norms get FP32 input; the model takes FP32 input and returns FP32."""
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                            torch.nn.Linear(4 * 4 * 4, 8), torch.nn.LayerNorm(8),
                            torch.nn.Linear(8, 2)).to(device)
    fusedamp.convert_module(m, dtype)
    seen = {}
    for name, mod in m.named_children():
        mod.register_forward_hook(
            lambda mod, inp, out, name=name: seen.__setitem__(name, (inp[0].dtype, out.dtype)))
    out = m(torch.randn(2, 3, 6, 6, device=device))
    assert out.dtype == torch.float32
    assert m[1].weight.dtype == m[1].running_mean.dtype == m[4].weight.dtype == torch.float32
    assert m[0].weight.dtype == m[3].weight.dtype == m[5].weight.dtype == dtype
    assert seen["1"] == (dtype, dtype)            # batch norm: native mixed precision
    assert seen["4"][0] == torch.float32          # layer norm computes in FP32 ...
    assert seen["5"][0] == dtype                  # ... and hands the model's dtype on
    out.sum().backward()
    assert m[0].weight.grad.dtype == dtype and m[1].weight.grad.dtype == torch.float32


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_step_bumps_the_version_counters_torch_would(device, kind):
    """The engine calls its kernels below autograd; what a user can see keeps torch's in-place
    semantics: a step bumps the params' version counters (skipped or not, as torch's fused
    ops), and the grads' when it writes them back (a scaled step)."""
    params = [torch.nn.Parameter(torch.randn(5, device=device).half()) for _ in range(3)]
    opt = getattr(fusedamp.optim, kind)(params, lr=1e-2)
    scaler = fusedamp.GradScaler(device, init_scale=4.0)
    scaler.scale(torch.ones((), device=device))
    for p in params:
        p.grad = torch.ones_like(p)
    before = [(p._version, p.grad._version) for p in params]
    scaler.step(opt)
    for p, (pv, gv) in zip(params, before):
        assert p._version > pv and p.grad._version > gv
    scaler.update()
    params[0].grad.fill_(float("inf"))
    before = [p._version for p in params]
    scaler.step(opt)  # skipped
    assert all(p._version > v for p, v in zip(params, before))


def test_gradients_are_taken_fresh_every_step_however_they_change(device):
    """The engine keeps its gradient lists between steps and refreshes them in place: a grad
    replaced by a new tensor (param 0), one changed in place (1), one set to None for a step
    and then replaced (2) and one never touched again (3) must all reach the step as they are
    now. Reference: the same values handed over as fresh clones every step (nothing reused),
    bit for bit, through the mixed-precision path."""
    def make():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(5, device=device).half()) for _ in range(4)]

    kept, fresh = make(), make()
    opts = [fusedamp.optim.AdamW(ps, lr=1e-2) for ps in (kept, fresh)]
    gen = torch.Generator().manual_seed(1)
    constant = torch.randn(5, generator=gen).half().to(device)
    kept[3].grad = constant.clone()
    for step in range(6):
        values = [torch.randn(5, generator=gen).half().to(device) for _ in range(3)] + [constant]
        kept[0].grad = values[0].clone()
        if kept[1].grad is None:
            kept[1].grad = values[1].clone()
        else:
            kept[1].grad.copy_(values[1])
        kept[2].grad = None if step == 3 else values[2].clone()
        for i, p in enumerate(fresh):
            p.grad = None if (i == 2 and step == 3) else values[i].clone()
        for opt in opts:
            opt.step()
        for i, (a, b) in enumerate(zip(kept, fresh)):
            assert torch.equal(a, b), (step, i)
    assert not torch.equal(kept[0].detach(), make()[0].detach())  # the steps moved it


def test_step_keeps_no_gradient_alive_after_zero_grad(device):
    """After a step, the engine holds no handle to that step's gradients: zero_grad(set_to_none=
    True) frees them, as with a torch optimizer, instead of a whole set of gradients staying
    alive through the next forward and backward."""
    import weakref

    import fusedamp
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(device)
    model, opt, scaler = fusedamp.initialize(model, torch.optim.AdamW(model.parameters()),
                                             torch.float16, max_grad_norm=1.0)
    for _ in range(2):  # the second step reuses the engine's gradient lists
        loss = model(torch.randn(4, 8, device=device)).float().pow(2).sum()
        scaler.scale(loss).backward()
        grads = [weakref.ref(p.grad) for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        assert all(g() is None for g in grads), "a gradient outlived zero_grad(set_to_none=True)"


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_steps_after_the_first_see_every_edit_of_params_and_state(device, kind):
    """After a bucket's first step the engine keeps the addresses of its own tensors (master
    weights, moments, step counts; on the CPU) and checks only params and grads again. What a
    user does between steps must still reach the step exactly: a parameter given new memory of
    its shape (`.data =`), in-place edits of a parameter and of a state tensor, a state replaced
    through load_state_dict. Reference: a twin whose state is reloaded before every step, so
    that every tensor of it is checked and taken afresh each time; bit for bit."""
    def make():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, device=device).half())
              for s in [(5,), (3, 4), (7,)]]
        opt = (fusedamp.optim.AdamW(ps, lr=1e-2) if kind == "AdamW"
               else fusedamp.optim.SGD(ps, lr=1e-2, momentum=0.9))
        return ps, opt

    (kept, opt), (fresh, twin) = make(), make()
    moment = "exp_avg" if kind == "AdamW" else "momentum_buffer"
    gen = torch.Generator().manual_seed(2)
    for step in range(7):
        grads = [torch.randn(p.shape, generator=gen).half().to(device) for p in kept]
        for params, o in ((kept, opt), (fresh, twin)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            with torch.no_grad():
                if step == 2:  # new memory for param 0, its shape, other values
                    params[0].data = (params[0].detach() * 0.5).clone()
                if step == 3:  # in place: a parameter and a state tensor
                    params[1].mul_(0.25)
                    o.state[params[2]][moment].mul_(-1.0)
            if step == 5:  # a state replaced through load_state_dict
                sd = o.state_dict()
                sd["state"][0][moment] = sd["state"][0][moment] + 1.0
                o.load_state_dict(sd)
        twin.load_state_dict(twin.state_dict())
        opt.step()
        twin.step()
        for i, (a, b) in enumerate(zip(kept, fresh)):
            assert torch.equal(a, b), (step, i)
            for name, value in opt.state[a].items():
                assert torch.equal(value, twin.state[b][name]), (step, i, name)
    assert not torch.equal(kept[2].detach(), make()[0][2].detach())  # the steps moved it


@pytest.mark.parametrize("new_shape", [(2, 3), (8,)])
def test_a_parameter_given_another_shape_after_a_step_is_refused(device, new_shape):
    """A parameter given memory of another shape after the engine has stepped it (its state was
    taken for the old shape): a clear error, nothing modified; never a step over the state of
    the old shape."""
    p = torch.nn.Parameter(torch.randn(6, device=device).half())
    opt = fusedamp.optim.AdamW([p], lr=1e-2)
    p.grad = torch.randn(6, device=device).half()
    opt.step()
    with torch.no_grad():
        p.data = torch.randn(new_shape, device=device).half()
    p.grad = torch.randn(new_shape, device=device).half()
    weight = p.detach().clone()
    state = {k: v.clone() for k, v in opt.state[p].items()}
    with pytest.raises(RuntimeError, match=r"has shape \[6\] but params\[0\] has shape"):
        opt.step()
    assert torch.equal(p.detach(), weight)
    for name, value in opt.state[p].items():
        assert torch.equal(value, state[name]), name


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
def test_a_gradient_with_dispatch_keys_of_its_own_goes_through_the_dispatcher(device, kind):
    """After the first steps the engine's CPU step op skips the dispatcher when every param and
    grad is a plain tensor. A grad that is not (here a negative view: its memory holds -g) must
    still reach torch's fallback, which refuses it in a mutable list, and the failing step
    changes no weight — the kernel must never run on the raw memory."""
    params = [torch.nn.Parameter(torch.randn(5, device=device).half()) for _ in range(3)]
    opt = (fusedamp.optim.AdamW(params, lr=0.1) if kind == "AdamW"
           else fusedamp.optim.SGD(params, lr=0.1, momentum=0.9))
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(5, device=device).half()
        opt.step()
    before = [p.detach().clone() for p in params]
    for i, p in enumerate(params):
        g = torch.randn(5, device=device).half()
        p.grad = (-g)._neg_view() if i == 1 else g
    assert params[1].grad.is_neg()
    with pytest.raises(RuntimeError, match="negation"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)


@pytest.mark.parametrize("how", ["new value", "list edited in place", "lr tensor edited in place",
                                 "group dict replaced"])
def test_every_change_of_a_param_group_reaches_the_next_step(device, how):
    """The step pushes a param group's options to the engine only when the group's dict holds
    other objects than at the last step; a value that can change under the same identity (a
    list, a tensor) is pushed every time. Each kind of change must reach the next step exactly
    as torch.optim.AdamW (which reads the dicts every step) sees it."""
    def run(make):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(8, device=device))]
        # float64: the engine takes a converted copy, seen again only when pushed again
        lr = (torch.tensor(0.01, dtype=torch.float64) if how == "lr tensor edited in place"
              else 0.01)
        opt = make(params, lr=lr)
        if how == "list edited in place":
            opt.param_groups[0]["betas"] = [0.9, 0.999]  # torch.optim reads it at every step
        trajectory = []
        for step in range(4):
            params[0].grad = torch.randn(8, device=device)
            if step == 2:
                group = opt.param_groups[0]
                if how == "new value":
                    group["lr"] = 0.05
                elif how == "list edited in place":
                    group["betas"][0] = 0.5
                elif how == "lr tensor edited in place":
                    group["lr"].fill_(0.05)
                else:
                    opt.param_groups[0] = dict(group, weight_decay=0.3)
            opt.step()
            trajectory.append(params[0].detach().cpu().clone())
        return trajectory

    ours = run(fusedamp.optim.AdamW)
    ref = run(lambda params, **kw: torch.optim.AdamW(params, foreach=False, **kw))
    for mine, theirs in zip(ours, ref):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_a_gradient_sharing_its_parameters_memory_is_refused_at_any_step(device, kind):
    """From the second step on, the engine checks each parameter and gradient for the step op
    in its own walk over the gradients (on the CPU), and the op then skips its walk: that walk
    must refuse what the op refuses. A gradient that is its parameter's own memory, given at
    the third step: the op's error, nothing modified."""
    params, opt = three_fp16_params_and(kind, device, numel=5)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(5, device=device).half()
        opt.step()
    params[1].grad = params[1].detach()
    weights = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    with pytest.raises(RuntimeError, match=r"grads\[1\] and params\[1\] share memory"):
        opt.step()
    for p, weight, state in zip(params, weights, states):
        assert torch.equal(p.detach(), weight)
        for name, value in opt.state[p].items():
            assert torch.equal(value, state[name]), name
    params[1].grad = torch.randn(5, device=device).half()  # and the next step runs
    opt.step()
    assert not torch.equal(params[1].detach(), weights[1])


@pytest.mark.parametrize("bad", ["float64", "other strides", "overlapping", "sparse"])
def test_a_bad_gradient_on_the_plan_gets_the_walks_error(device, bad):
    """From the second step on, a parameter on the previous step's plan whose gradient reads
    as clean (one read of each tensor's facts) is placed without the message-raising checks;
    any other gradient must still get them: the walk's own message, nothing modified, and the
    next step with a good gradient runs."""
    params = [torch.nn.Parameter(torch.randn(4, 6, device=device).half()) for _ in range(3)]
    opt = fusedamp.optim.AdamW(params, lr=1e-2)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(4, 6, device=device).half()
        opt.step()
    good = torch.randn(4, 6, device=device).half()
    if bad == "float64":
        params[1].grad_dtype = None  # torch refuses another dtype than the parameter's otherwise
    grad, message = {
        "float64": (good.double(), "gradient dtype"),
        "other strides": (torch.randn(6, 4, device=device).half().t(), "gradient strides"),
        "overlapping": (good.as_strided((4, 6), (0, 1)), "gradient strides"),
        "sparse": (good.to_sparse(), "sparse gradients"),
    }[bad]
    params[1].grad = grad
    weights = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    with pytest.raises((RuntimeError, ValueError), match=message):
        opt.step()
    for p, weight, state in zip(params, weights, states):
        assert torch.equal(p.detach(), weight)
        for name, value in opt.state[p].items():
            assert torch.equal(value, state[name]), name
    params[1].grad = good
    opt.step()
    assert not torch.equal(params[1].detach(), weights[1])
