"""What a user changes between steps reaches the next step as torch.optim would take it: a
parameter given new memory or edited in place, a state tensor edited, given new memory or
replaced through load_state_dict, every kind of change of a param group; a parameter given
another shape is refused. A step bumps the version counters torch's in-place step would."""
import pytest
import torch

import fusedamp

MOMENT = {"AdamW": "exp_avg", "SGD": "momentum_buffer"}


def _fp16_optimizer(device, kind, shapes):
    """FP16 parameters of these shapes (the same values each time) and a fusedamp optimizer of
    this kind over them."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device).half()) for s in shapes]
    opt = (fusedamp.optim.AdamW(params, lr=1e-2) if kind == "AdamW"
           else fusedamp.optim.SGD(params, lr=1e-2, momentum=0.9))
    return params, opt


def _assert_same(step, kept, opt, fresh, twin):
    """Two optimizers' parameters and every state tensor, bit for bit."""
    for i, (a, b) in enumerate(zip(kept, fresh)):
        assert torch.equal(a, b), (step, i)
        for name, value in opt.state[a].items():
            assert torch.equal(value, twin.state[b][name]), (step, i, name)


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


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_steps_after_the_first_see_every_edit_of_params_and_state(device, kind):
    """The engine keeps its buckets (parameters, master weights, moments, step counts) from one
    step to the next. What a user does between steps must still reach the step exactly: a
    parameter given new memory of its shape (`.data =`), in-place edits of a parameter and of a
    state tensor, a state replaced through load_state_dict. Reference: a twin whose state is
    reloaded before every step, so that every tensor of it is taken afresh each time; bit for
    bit."""
    def make():
        return _fp16_optimizer(device, kind, [(5,), (3, 4), (7,)])

    (kept, opt), (fresh, twin) = make(), make()
    moment = MOMENT[kind]
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
        _assert_same(step, kept, opt, fresh, twin)
    assert not torch.equal(kept[2].detach(), make()[0][2].detach())  # the steps moved it


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
@pytest.mark.parametrize("how", ["data", "set_"])
def test_a_state_tensor_given_new_memory_is_what_the_next_step_uses(device, kind, how):
    """A state tensor given other memory between steps (`state.data = t`, `state.set_(t)`), as
    torch.optim allows: the next step reads and writes that memory, the moment and the FP32
    master weight alike. Reference: a twin given the same values through load_state_dict before
    every step; bit for bit, and `t` itself holds what the step wrote."""
    (kept, opt), (fresh, twin) = (_fp16_optimizer(device, kind, [(5,), (3, 4)]) for _ in range(2))
    moment = MOMENT[kind]
    gen = torch.Generator().manual_seed(3)
    given = {}
    for step in range(5):
        grads = [torch.randn(p.shape, generator=gen).half().to(device) for p in kept]
        for params, o in ((kept, opt), (fresh, twin)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        if step in (2, 3):  # after a step: new memory, other values, for one state tensor each
            name, index = (moment, 0) if step == 2 else ("master_param", 1)
            old = opt.state[kept[index]][name]
            t = (old.detach() * 0.5 + 0.25).clone()
            with torch.no_grad():
                if how == "data":
                    old.data = t
                else:
                    old.set_(t)
            given[name] = (index, t)
            sd = twin.state_dict()
            sd["state"][index][name] = t.clone()
            twin.load_state_dict(sd)
        opt.step()
        twin.step()
        _assert_same(step, kept, opt, fresh, twin)
        for name, (index, t) in given.items():  # the step wrote into the memory given
            assert torch.equal(t, twin.state[fresh[index]][name]), (step, name)


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_a_state_tensor_given_memory_of_another_shape_is_refused(device, kind):
    """A state tensor given memory that no longer fits its parameter (another shape) after a
    step: the next step refuses it with the step op's message and modifies nothing."""
    params, opt = _fp16_optimizer(device, kind, [(5,)] * 3)
    moment = MOMENT[kind]
    for p in params:
        p.grad = torch.randn(5, device=device).half()
    opt.step()
    with torch.no_grad():
        opt.state[params[1]][moment].set_(torch.zeros(3, device=device))
    weights = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    with pytest.raises(RuntimeError,
                       match=r"\[1\] has shape \[3\] but params\[1\] has shape \[5\]"):
        opt.step()
    for p, w, st in zip(params, weights, states):
        assert torch.equal(p.detach(), w)
        for name, value in opt.state[p].items():
            assert torch.equal(value, st[name]), name


# The second FP32 state tensor of each kind beside its moment, for a row whose two state
# tensors share memory.
OTHER_FP32_STATE = {"AdamW": "exp_avg_sq", "SGD": "master_param"}


def _break_row(opt, param, kind, how):
    """State of `param` given memory that breaks its step's row, as `how` says; the message the
    step op gives for it."""
    moment = MOMENT[kind]
    state = opt.state[param]
    other = OTHER_FP32_STATE[kind]
    names = {"exp_avg": "exp_avgs", "momentum_buffer": "momentum_buffers",
             "exp_avg_sq": "exp_avg_sqs", "master_param": "master_params"}
    with torch.no_grad():
        if how == "shared":
            state[other].set_(state[moment])
            return rf"{names[moment]}\[1\] and {names[other]}\[1\] share memory"
        if how == "dtype":
            state[moment].data = state[moment].double()
            return rf"{names[moment]}\[1\] has dtype Double"
        if how == "not dense":
            state[moment].set_(torch.zeros(2 * param.numel(), device=param.device)[::2])
            return rf"{names[moment]}\[1\] must be non-overlapping and dense"
        state["step"].set_(torch.zeros(2, device=param.device))
        return r"steps\[i\] must have exactly one element, got 2"


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
@pytest.mark.parametrize("how", ["shared", "dtype", "not dense", "two-element step"])
@pytest.mark.parametrize("scaled", [False, True])
def test_a_row_broken_between_steps_is_refused_with_the_ops_message(device, kind, how, scaled):
    """A row of the step made invalid between steps through the state the optimizer hands out
    (two state tensors sharing memory, a state tensor of another dtype or not dense, a step count
    of two elements): the engine's next step, plain or through the scaler, refuses it with the
    step op's message and modifies nothing, parameters, state and gradients alike."""
    params, opt = _fp16_optimizer(device, kind, [(5,)] * 3)
    if kind == "SGD":
        opt.param_groups[0]["momentum"] = 0.9
    scaler = fusedamp.GradScaler(device, init_scale=4.0)
    for p in params:
        p.grad = torch.randn(5, device=device).half()
    opt.step()
    if how == "two-element step" and "step" not in opt.state[params[1]]:
        pytest.skip(f"{kind} keeps no step count")
    message = _break_row(opt, params[1], kind, how)
    weights = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    with pytest.raises(RuntimeError, match=message):
        if scaled:
            scaler.scale(torch.ones((), device=device))
            scaler.step(opt)
        else:
            opt.step()
    for p, w, g, st in zip(params, weights, grads, states):
        assert torch.equal(p.detach(), w) and torch.equal(p.grad, g)
        for name, value in opt.state[p].items():
            assert torch.equal(value, st[name]), name


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_a_state_tensor_given_copy_on_write_memory_keeps_its_source(device, kind):
    """A state tensor given copy-on-write memory (a lazy clone) between steps: the step gives it
    its own copy before writing, so the tensor it was cloned from keeps its values, and the
    results are those of a twin given plain memory of the same values."""
    (kept, opt), (fresh, twin) = (_fp16_optimizer(device, kind, [(5,)] * 3) for _ in range(2))
    moment = MOMENT[kind]
    gen = torch.Generator().manual_seed(4)
    source = values = None
    for step in range(3):
        grads = [torch.randn(p.shape, generator=gen).half().to(device) for p in kept]
        for params, o in ((kept, opt), (fresh, twin)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        if step == 1:
            source = opt.state[kept[1]][moment].detach().clone()
            values = source.clone()
            with torch.no_grad():
                opt.state[kept[1]][moment].set_(torch._lazy_clone(source))
        opt.step()
        twin.step()
        _assert_same(step, kept, opt, fresh, twin)
    assert torch.equal(source, values)
    assert not torch.equal(opt.state[kept[1]][moment], values)  # the steps wrote the clone


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_a_state_entry_assigned_like_torchs_dict_reaches_the_engine(device, kind):
    """`opt.state[p] = {...}` as torch.optim's dict takes it (torch's ZeroRedundancyOptimizer
    loads its local optimizer that way): the next step uses it, as a twin that loads the same
    state through load_state_dict; an entry that does not fit is refused, changing nothing."""
    params, opt = _fp16_optimizer(device, kind, [(5,), (4, 2)])
    twin_params, twin = _fp16_optimizer(device, kind, [(5,), (4, 2)])
    for p in params + twin_params:
        p.grad = torch.ones_like(p)
    opt.step()
    twin.step()
    moment = MOMENT[kind]
    given = {k: (v * 3 if k == moment else v.clone()) for k, v in opt.state[params[0]].items()}
    opt.state[params[0]] = given
    assert torch.equal(opt.state[params[0]][moment], given[moment])
    loaded = twin.state_dict()
    loaded["state"][0] = {k: v.clone() for k, v in given.items()}
    twin.load_state_dict(loaded)
    bad = dict(given, **{moment: torch.zeros(3, device=device)})
    before = {k: v.clone() for k, v in opt.state[params[1]].items()}
    with pytest.raises(RuntimeError):
        opt.state[params[1]] = bad
    assert all(torch.equal(v, before[k]) for k, v in opt.state[params[1]].items())
    opt.step()
    twin.step()
    _assert_same("after", params, opt, twin_params, twin)


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_reading_the_state_of_a_parameter_without_state_gives_an_empty_dict(device, kind):
    """torch's state is a defaultdict(dict): an unused parameter, or any before the first
    step, reads as {} (code that logs or inspects every parameter's state relies on it); the
    read stores nothing, and assigning an invalid state still fails and changes nothing."""
    params, opt = _fp16_optimizer(device, kind, [(5,), (3,)])
    assert opt.state[params[0]] == {} and "master_param" not in opt.state[params[1]]
    assert len(opt.state) == 0
    params[0].grad = torch.ones_like(params[0])  # params[1] stays unused
    opt.step()
    assert opt.state[params[1]] == {} and params[1] not in opt.state
    assert "master_param" in opt.state[params[0]]
    with pytest.raises(RuntimeError, match="parameter 1"):
        opt.state[params[1]] = {"no_such_state": torch.zeros(3, device=device)}
    assert params[1] not in opt.state and opt.state[params[1]] == {}
    opt.state_dict()  # the reads left nothing behind that a checkpoint would trip over


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
