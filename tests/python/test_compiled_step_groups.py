"""What a compiled optimizer half depends on in the param groups: which groups hold a tensor
lr (a change recompiles, and the graph then takes the tensor), not the values of the float
hyper-parameters, and the optimizer's param_groups list as it is at each call.
"""
import pytest
import torch
from torch._dynamo.utils import counters

import fusedamp
from fusedamp import compiled_step

pytestmark = pytest.mark.skipif(not compiled_step.available,
                                reason="torch's opaque objects (torch >= 2.10) are needed")


def _half(scaler, opt):
    scaler.step(opt)
    scaler.update()


def _run(make, device, dtype, compiled, change, steps=6):
    """(parameters, lrs seen) of `steps` scaled steps; change(i, opt) runs before step i."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    params = list(model.to(device=device, dtype=dtype).parameters())
    opt = make(params)
    scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 8)
    if not isinstance(opt, fusedamp.optim.FusedOptimizer):
        scaler.prepare_compiled_step(opt)
    half = torch.compile(_half, fullgraph=True) if compiled else _half
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        change(i, opt)
        scaler.scale(torch.ones((), device=device))
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * scaler.get_scale()).to(
                device=device, dtype=dtype)
        half(scaler, opt)
    return params


def _compare(make, device, change, graphs, dtype=torch.bfloat16):
    torch._dynamo.reset()
    counters.clear()
    eager = _run(make, device, dtype, False, change)
    compiled = _run(make, device, dtype, True, change)
    assert counters["stats"]["unique_graphs"] == graphs
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


def _adamw(params):
    return fusedamp.optim.AdamW(params, lr=1e-2, weight_decay=0.1, master_weights=True)


def test_float_hyper_parameters_changing_every_step_compile_once(device):
    def change(i, opt):
        g = opt.param_groups[0]
        g["lr"], g["weight_decay"], g["betas"] = 1e-2 / (1 + i), 0.1 * i, (0.9, 0.99 - i / 100)

    _compare(_adamw, device, change, graphs=1)


def test_an_lr_becoming_a_tensor_recompiles_and_the_graph_takes_it(device):
    lr = torch.tensor(5e-3, device=device)

    def change(i, opt):
        if i == 3:
            opt.param_groups[0]["lr"] = lr
        if i >= 3:
            lr.fill_(5e-3 / i)  # read by the compiled step: the eager run's bits need it

    _compare(_adamw, device, change, graphs=2)


def test_a_torch_optimizer_loading_a_state_dict_is_followed(device):
    """torch's load_state_dict replaces the param_groups list; the graph reads the new one."""
    def change(i, opt):
        if i == 3:
            opt.load_state_dict(opt.state_dict())
        opt.param_groups[0]["lr"] = 1e-2 / (1 + i)

    _compare(lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True), device, change,
             graphs=1, dtype=torch.float32)


def test_a_replaced_param_groups_list_is_the_one_read(device):
    """A new list with other lr tensors: the graph takes them (the eager bits), no recompile."""
    def change(i, opt):
        if i == 2:
            opt.param_groups = [dict(g, lr=torch.tensor(2e-3, device=device))
                                for g in opt.param_groups]
            assert opt._step_target.param_groups is opt.param_groups
        if i >= 2:
            opt.param_groups[0]["lr"].fill_(2e-3 / i)

    _compare(lambda params: fusedamp.optim.AdamW(params, lr=torch.tensor(1e-2, device=device)),
             device, change, graphs=1)


def _aot_half(scaler, opt, sched):
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    if sched is not None:
        sched.step()


@pytest.mark.parametrize("kind", ["fusedamp", "torch"])
def test_aot_eager_backend_steps_as_eager(device, kind):
    """Under a functionalising backend each op gets copies of the tensors it declares mutated
    and those copies are written back after it: the weights, unscaled gradients, a schedule's
    lr and its count come out as eager's (a skipped step included)."""
    def run(compiled):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device=device).to(torch.bfloat16))
                  for s in ((16,), (4, 3))]
        start = params[0].detach().clone()
        if kind == "fusedamp":
            opt = fusedamp.optim.AdamW(params, lr=torch.tensor(1e-2, device=device))
            sched = fusedamp.lr_scheduler.WarmupCosine(opt, warmup_steps=2, total_steps=8)
        else:
            opt, sched = torch.optim.SGD(params, lr=1e-2, momentum=0.9), None
        scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 8)
        if kind == "torch":
            scaler.prepare_compiled_step(opt)
        half = torch.compile(_aot_half, fullgraph=True, backend="aot_eager") if compiled \
            else _aot_half
        gen = torch.Generator().manual_seed(1)
        for i in range(5):
            scaler.scale(torch.ones((), device=device))
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * scaler.get_scale()).to(
                    device=device, dtype=p.dtype)
            if i == 2:
                params[1].grad.view(-1)[0] = float("inf")
            half(scaler, opt, sched)
        lr = opt.param_groups[0]["lr"]
        assert not torch.equal(params[0], start)  # the steps moved the weights
        return [*params, *(p.grad for p in params)], (lr, None if sched is None else
                                                      sched._applied.clone())

    torch._dynamo.reset()
    (eager, eager_lr), (compiled, compiled_lr) = run(False), run(True)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
    assert str(eager_lr) == str(compiled_lr)
