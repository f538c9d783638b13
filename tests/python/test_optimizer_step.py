"""A fusedamp.optim step: the Python optimizer steps as the C++ engine does, bit for bit; a
skipped step changes no bit and is counted; the state a step creates is one block of memory for
a small parameter, each state tensor its own memory all the same."""
import pytest
import torch

import fusedamp
from op_helpers import _grads, _model_params


def test_python_and_cpp_optimizer_identical(device):
    """The Python class is the C++ engine plus torch.optim conventions: same bits."""
    a = _model_params(device, torch.float16, seed=4)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt = fusedamp.optim.AdamW(a, lr=1e-3, weight_decay=0.05, max_grad_norm=0.5)
    eng = fusedamp._C.AdamW([b])
    for name, v in (("lr", 1e-3), ("weight_decay", 0.05), ("max_grad_norm", 0.5)):
        eng.set_group_option(0, name, v)
    for step in range(10):
        for p, q, g in zip(a, b, _grads(device, torch.float16, step)):
            p.grad, q.grad = g.half(), g.half()
        opt.step()
        with torch.no_grad():
            eng.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    for p, q in zip(a, b):
        for k, v in opt._engine.param_state(p).items():
            assert torch.equal(v, eng.param_state(q)[k]), k


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_skipped_step_is_bitwise_noop_and_counted(device, dtype):
    params = _model_params(device, dtype, seed=5)
    opt = fusedamp.optim.AdamW(params, lr=1e-2, max_grad_norm=1.0)
    scaler = fusedamp.GradScaler(device, enabled=dtype == torch.float16)
    scaler.scale(torch.ones((), device=device))  # an iteration starts with scale(), as in torch
    for step in range(3):
        for p, g in zip(params, _grads(device, dtype, step)):
            p.grad = g.to(dtype)
        scaler.step(opt)
        scaler.update()
    before = [p.detach().clone() for p in params]
    state = {id(p): {k: v.clone() for k, v in opt._engine.param_state(p).items()} for p in params}
    for p, g in zip(params, _grads(device, dtype, 99)):
        p.grad = g.to(dtype)
    params[2].grad[5] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert opt.last_step_applied.item() == 0.0
    assert opt.skipped_steps.item() == 1
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
    for p in params:
        for k, v in opt._engine.param_state(p).items():
            assert torch.equal(v, state[id(p)][k]), k
    # BF16 without loss scaling still skips (non-finite protection); FP16 backs the scale off.
    if dtype == torch.float16:
        assert scaler.get_scale() == 2.0 ** 15


def test_the_state_of_a_small_parameter_is_one_block_of_disjoint_tensors(device):
    """A small parameter's state (step count, master, moments) is created as views of one block
    of memory, a large one's as tensors of their own; either way each state tensor is its own
    memory: an edit of one changes no other, and reaches the next step."""
    small = torch.nn.Parameter(torch.randn(3, device=device).half())
    large = torch.nn.Parameter(torch.randn(5000, device=device).half())
    opt = fusedamp.optim.AdamW([small, large], lr=1e-2)
    for p in (small, large):
        p.grad = torch.randn_like(p)
    opt.step()

    def storages(p):
        return {t.untyped_storage().data_ptr() for t in opt.state[p].values()}
    assert set(opt.state[small]) == {"step", "master_param", "exp_avg", "exp_avg_sq"}
    assert len(storages(small)) == 1
    assert len(storages(large)) == 4
    state = opt.state[small]
    assert state["master_param"].dtype == torch.float32 and state["master_param"].shape == (3,)
    assert state["step"].shape == () and state["step"].item() == 1.0
    before = {k: v.clone() for k, v in state.items()}
    state["exp_avg"].fill_(7.0)
    for name in ("step", "master_param", "exp_avg_sq"):
        assert torch.equal(state[name], before[name]), name
    # The edited moment reaches the next step: AdamW's update of it, from 7.
    small.grad = torch.zeros_like(small)
    opt.step()
    torch.testing.assert_close(state["exp_avg"], torch.full((3,), 7.0 * 0.9, device=device))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_momentum_that_rounds_to_zero_in_fp32_still_writes_the_buffer(device, state_dtype):
    """momentum=1e-46 is nonzero (a buffer exists, as in torch) but 0 as an FP32 hyper-parameter:
    the first step writes buf = g all the same, and later ones buf = 0 * buf + g, as torch's
    FP32 buffer does; no step reads an unwritten buffer."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(100, device=device))
    ref = torch.nn.Parameter(p.detach().clone())
    opt = fusedamp.optim.SGD([p], lr=0.1, momentum=1e-46, state_dtype=state_dtype)
    ref_opt = torch.optim.SGD([ref], lr=0.1, momentum=1e-46)
    for i in range(3):
        g = torch.randn(100, device=device)
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        tol = 0 if state_dtype == torch.float32 else 0.02 * g.abs().max().item()
        if state_dtype != torch.int8:  # int8: codes and block scales, seen through the weights
            buf = opt.state[p]["momentum_buffer"].float()
            torch.testing.assert_close(buf, ref_opt.state[ref]["momentum_buffer"], rtol=0,
                                       atol=tol)
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=0.1 * tol)
