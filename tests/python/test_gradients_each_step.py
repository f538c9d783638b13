"""The gradients a step takes: the current ones, however they were changed since the last step;
none kept alive after it; one with other strides than its parameter (transposed, expanded)
stepped as torch steps it; and a gradient the step cannot use (its parameter's own memory,
another dtype, sparse, or with dispatch keys of its own) refused at any step with its error,
nothing modified."""
import pytest
import torch

import fusedamp
from op_helpers import three_fp16_params_and


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


@pytest.mark.parametrize("bad", ["float64", "sparse"])
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


def _other_strides(layout, device, scale):
    """A gradient of shape (4, 6) laid out as `layout`, its values times `scale`."""
    if layout == "transposed":
        return (torch.randn(6, 4, device=device) * scale).t()
    if layout == "rows expanded":  # every row the same memory
        return (torch.randn(1, 6, device=device) * scale).expand(4, 6)
    return (torch.randn(4, 1, device=device) * scale).expand(4, 6)  # every column


@pytest.mark.parametrize("layout", ["transposed", "rows expanded", "columns expanded"])
def test_a_gradient_with_other_strides_steps_as_torch(device, layout):
    """A hand-set .grad of the parameter's shape with other strides is stepped as torch.optim
    steps it: the same update as its contiguous copy, bit for bit (the first step and those on
    the plan), close to torch.optim.AdamW's; after a scaled step .grad holds the unscaled
    gradient, as torch's (a copy in the parameter's layout: an expanded one cannot hold it)."""
    torch.manual_seed(0)
    init = torch.randn(4, 6, device=device)
    strided, dense, ref = (torch.nn.Parameter(init.clone()) for _ in range(3))
    opts = [fusedamp.optim.AdamW([p], lr=1e-2, weight_decay=0.01) for p in (strided, dense)]
    scalers = [fusedamp.GradScaler(device, init_scale=2.0 ** 10) for _ in opts]
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.01, foreach=False)
    for step in range(3):
        strided.grad = _other_strides(layout, device, 2.0 ** 10)
        dense.grad = strided.grad.contiguous()
        ref.grad = strided.grad / 2.0 ** 10  # exact: a power of two
        for opt, scaler in zip(opts, scalers):
            scaler.scale(torch.ones((), device=device))
            scaler.step(opt)
            scaler.update()
        torch_opt.step()
        assert torch.equal(strided, dense), step
        assert strided.grad.stride() == strided.stride()
        assert torch.equal(strided.grad, ref.grad) and torch.equal(dense.grad, ref.grad), step
        torch.testing.assert_close(strided.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    assert not torch.equal(strided.detach(), init)


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
