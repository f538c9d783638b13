"""The step ops against torch references (CPU always, CUDA when present): adam_step_ and
sgd_step_ in FP32 against torch.optim (AMSGrad, a tensor lr, bias corrections from FP64 betas),
FP16/BF16 params with FP32 master weights against an FP64 run of the same algorithm, a skipped
step that changes no bit, and empty lists. The gradient checks: test_unscale_and_grad_stats_ops.py;
the fused clipping: test_fused_clipping.py."""
import pytest
import torch

from op_helpers import (LOW, adam_reference_fp64, assert_bitwise_equal, max_abs_diff,
                        max_rel_error, ops, randn_list, scalar, sgd_reference_fp64, snapshot)
from op_inputs import op_inputs


# ---------------------------------------------------------------- adam_step_ (FP32 vs torch)
@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("wd,maximize", [(0.0, False), (0.05, False), (0.01, True)])
def test_adam_fp32_matches_torch(device, decoupled, wd, maximize, record_diff):
    inp = op_inputs(device, seed=4)
    ref = [torch.nn.Parameter(p.clone()) for p in inp.params]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(ref, lr=3e-3, betas=(0.85, 0.99), eps=1e-7, weight_decay=wd, maximize=maximize,
              foreach=False)
    for step in range(60):
        inp.grads = randn_list(device, seed=100 + step)
        for r, g in zip(ref, inp.grads):
            r.grad = g.clone()
        opt.step()
        inp.call("adam_step_", lr=3e-3, beta1=0.85, beta2=0.99, eps=1e-7, weight_decay=wd,
                 decoupled_weight_decay=decoupled, maximize=maximize)
    diff = max_abs_diff(inp.params, [r.detach() for r in ref])
    record_diff(f"adam_step_ fp32 vs torch.optim.{cls.__name__}", diff)
    for p, r in zip(inp.params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-5, atol=1e-6)
    for s in inp.steps:
        assert s.item() == 60.0


@pytest.mark.parametrize("low", [None] + list(LOW))
def test_adam_amsgrad_matches_torch(device, low, record_diff):
    """max_exp_avg_sqs given: AMSGrad, as torch.optim.Adam(amsgrad=True). FP32 params against
    torch on the same FP32 values; FP16/BF16 params with FP32 masters against torch in FP64."""
    dtype = LOW[low] if low else torch.float32
    inp = op_inputs(device, seed=14, param_dtype=dtype, master_weights=low is not None)
    weights = inp.master_params if low is not None else inp.params
    ref_dtype = torch.float64 if low is not None else torch.float32
    ref = [torch.nn.Parameter(w.to(ref_dtype).clone()) for w in weights]
    opt = torch.optim.Adam(ref, lr=3e-3, betas=(0.9, 0.99), eps=1e-7, weight_decay=0.01,
                           amsgrad=True, foreach=False)
    v_max = [torch.zeros_like(w, dtype=torch.float32) for w in weights]
    for step in range(30):
        # Shrinking gradients: v falls below its running maximum, where AMSGrad differs.
        grads = [g * 0.8 ** step for g in randn_list(device, torch.float32, seed=900 + step,
                                                     sizes=[w.shape for w in weights])]
        inp.grads = [g.to(dtype) for g in grads]
        for r, g in zip(ref, inp.grads):
            r.grad = g.to(ref_dtype)
        opt.step()
        inp.call("adam_step_", lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-7, weight_decay=0.01,
                 decoupled_weight_decay=False, max_exp_avg_sqs=v_max)
    ref_max = [opt.state[r]["max_exp_avg_sq"] for r in ref]
    assert any((m > v).any() for m, v in zip(ref_max, [opt.state[r]["exp_avg_sq"] for r in ref]))
    err = max_rel_error(weights, [r.detach() for r in ref])
    record_diff(f"adam_step_ amsgrad ({low or 'float32'}) vs torch [rel]", err)
    assert err < 1e-6, err
    assert max_rel_error(v_max, ref_max) < 1e-5


def test_adam_lr_tensor_follows_schedule(device):
    inp = op_inputs(device, [(100,), (33,)], seed=5, scalars=dict(lr_tensor=1e-2))
    ref = [torch.nn.Parameter(p.clone()) for p in inp.params]
    opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for step in range(12):
        inp.grads = randn_list(device, seed=200 + step, sizes=[(100,), (33,)])
        for r, g in zip(ref, inp.grads):
            r.grad = g.clone()
        inp.lr_tensor.fill_(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        inp.call("adam_step_", lr=123.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
                 decoupled_weight_decay=True)
    for p, r in zip(inp.params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta2", [0.999, 0.9999])
def test_adam_bias_corrections_use_double_betas(device, beta2, record_diff):
    """From zero weights the first update is exactly lr * m_hat / (sqrt(v_hat) + eps), where a
    bias correction from the FP32-rounded beta2 is off by up to 1.7e-4 relative."""
    inp = op_inputs(device, seed=13)
    for p in inp.params:
        p.zero_()
    ref = [torch.nn.Parameter(p.clone()) for p in inp.params]
    opt = torch.optim.Adam(ref, lr=1e-3, betas=(0.9, beta2), eps=1e-8, foreach=False)
    for step in range(3):
        inp.grads = randn_list(device, seed=700 + step)
        for r, g in zip(ref, inp.grads):
            r.grad = g.clone()
        opt.step()
        inp.call("adam_step_", lr=1e-3, beta1=0.9, beta2=beta2, eps=1e-8, weight_decay=0.0,
                 decoupled_weight_decay=False, maximize=False)
        err = max_rel_error(inp.params, [r.detach() for r in ref])
        assert err < 2e-6, (step, err)
    record_diff(f"adam_step_ from zero weights vs torch.optim.Adam, beta2={beta2} [rel]", err)


# ---------------------------------------------------------------- sgd_step_ (FP32 vs torch)
@pytest.mark.parametrize("momentum,dampening,nesterov", [(0.0, 0.0, False), (0.9, 0.0, False),
                                                         (0.9, 0.1, False), (0.8, 0.0, True)])
@pytest.mark.parametrize("wd,maximize", [(0.0, False), (1e-3, True)])
def test_sgd_fp32_matches_torch(device, momentum, dampening, nesterov, wd, maximize, record_diff):
    inp = op_inputs(device, seed=6, moments=False, momentum=momentum != 0)
    ref = [torch.nn.Parameter(p.clone()) for p in inp.params]
    opt = torch.optim.SGD(ref, lr=0.05, momentum=momentum, dampening=dampening, nesterov=nesterov,
                          weight_decay=wd, maximize=maximize, foreach=False)
    for step in range(60):
        inp.grads = randn_list(device, seed=300 + step)
        for r, g in zip(ref, inp.grads):
            r.grad = g.clone()
        opt.step()
        inp.call("sgd_step_", lr=0.05, momentum=momentum, dampening=dampening, weight_decay=wd,
                 nesterov=nesterov, maximize=maximize)
    diff = max_abs_diff(inp.params, [r.detach() for r in ref])
    record_diff("sgd_step_ fp32 vs torch.optim.SGD", diff)
    for p, r in zip(inp.params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- master weights vs FP64
@pytest.mark.parametrize("low", list(LOW))
@pytest.mark.parametrize("grad_fp32", [False, True])
def test_adam_master_weights_track_fp64(device, low, grad_fp32, record_diff):
    """FP16/BF16 params with FP32 master weights and loss scaling, against an FP64 run of the
    same algorithm on the same (rounded) gradients. The tolerance is tied to what FP32 can do:
    torch.optim.AdamW in FP32 on the same gradients, measured against the same FP64 run."""
    dtype = LOW[low]
    loss_scale = 2.0 ** 12
    init = randn_list("cpu", torch.float32, seed=7)
    inp = op_inputs(device, param_dtype=dtype, master_weights=True, weights=init,
                    scalars=dict(inv_scale=1 / loss_scale, found_inf=0.0, grad_sum_sq=0.0))
    torch32 = [torch.nn.Parameter(p.clone()) for p in init]
    opt32 = torch.optim.AdamW(torch32, lr=1e-3, weight_decay=0.01, foreach=False)
    ref_p = [p.double() for p in init]
    ref_m = [torch.zeros_like(p) for p in ref_p]
    ref_v = [torch.zeros_like(p) for p in ref_p]
    for step in range(1, 51):
        true_grads = randn_list("cpu", torch.float64, seed=400 + step, scale=1e-3)
        gdtype = torch.float32 if grad_fp32 else dtype
        grads = [(g * loss_scale).to(gdtype) for g in true_grads]  # what backward produces
        inp.found_inf.zero_()
        inp.grad_sum_sq.zero_()
        inp.grads = [g.to(device) for g in grads]
        inp.call("grad_stats_")
        inp.call("adam_step_", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                 decoupled_weight_decay=True)
        for p, mm, vv, g in zip(ref_p, ref_m, ref_v, grads):
            adam_reference_fp64(p, mm, vv, g.double() / loss_scale, step, 1e-3, 0.9, 0.999, 1e-8,
                                0.01, True)
        for p, g in zip(torch32, grads):
            p.grad = g.float() / loss_scale
        opt32.step()
    rel = max_rel_error(inp.master_params, ref_p)
    torch_rel = max_rel_error([p.detach() for p in torch32], ref_p)
    record_diff(f"adam_step_ master ({low} params) vs fp64, 50 steps [rel]", rel)
    record_diff(f"  torch.optim.AdamW fp32 vs the same fp64 run [rel]", torch_rel)
    record_diff(f"adam_step_ master ({low} params) vs fp64, 50 steps [abs]",
                max_abs_diff(inp.master_params, ref_p))
    assert rel <= 2 * torch_rel + 1e-7, (rel, torch_rel)
    for p, mp in zip(inp.params, inp.master_params):
        assert torch.equal(p, mp.to(dtype))  # model weights are the rounded master weights


@pytest.mark.parametrize("low", list(LOW))
def test_sgd_master_weights_track_fp64(device, low, record_diff):
    dtype = LOW[low]
    init = randn_list("cpu", torch.float32, seed=8)
    inp = op_inputs(device, param_dtype=dtype, master_weights=True, moments=False, momentum=True,
                    weights=init)
    torch32 = [torch.nn.Parameter(p.clone()) for p in init]
    opt32 = torch.optim.SGD(torch32, lr=1e-3, momentum=0.9, weight_decay=1e-4, nesterov=True,
                            foreach=False)
    ref_p = [p.double() for p in init]
    ref_b = [torch.zeros_like(p) for p in ref_p]
    for step in range(50):
        grads = [g.to(dtype) for g in randn_list("cpu", torch.float32, seed=500 + step)]
        inp.grads = [g.to(device) for g in grads]
        inp.call("sgd_step_", lr=1e-3, momentum=0.9, dampening=0.0, weight_decay=1e-4,
                 nesterov=True)
        for p, b, g in zip(ref_p, ref_b, grads):
            sgd_reference_fp64(p, b, g.double(), step == 0, 1e-3, 0.9, 0.0, 1e-4, True)
        for p, g in zip(torch32, grads):
            p.grad = g.float()
        opt32.step()
    rel = max_rel_error(inp.master_params, ref_p)
    torch_rel = max_rel_error([p.detach() for p in torch32], ref_p)
    record_diff(f"sgd_step_ master ({low} params) vs fp64, 50 steps [rel]", rel)
    record_diff(f"  torch.optim.SGD fp32 vs the same fp64 run [rel]", torch_rel)
    assert rel <= 2 * torch_rel + 1e-7, (rel, torch_rel)
    for p, mp in zip(inp.params, inp.master_params):
        assert torch.equal(p, mp.to(dtype))


# ---------------------------------------------------------------- skipped steps
@pytest.mark.parametrize("low", list(LOW) + ["float32"])
@pytest.mark.parametrize("poison", ["inf", "nan"])
def test_skipped_step_is_bitwise_noop(device, low, poison):
    dtype = LOW.get(low, torch.float32)
    inp = op_inputs(device, param_dtype=dtype, master_weights=True, momentum=True, seed=10,
                    grads=randn_list(device, dtype, seed=11),
                    scalars=dict(inv_scale=0.5, found_inf=0.0, grad_sum_sq=0.0))
    inp.momentum_buffers = [torch.randn_like(p) for p in inp.master_params]
    sgd_steps = [torch.full((), 3.0, device=device) for _ in inp.params]
    for s in inp.steps:
        s.fill_(7.0)
    inp.exp_avgs = [torch.randn_like(x) for x in inp.exp_avgs]
    inp.exp_avg_sqs = [torch.rand_like(x) for x in inp.exp_avg_sqs]
    inp.grads[5][17] = float(poison)
    inp.call("grad_stats_")
    assert inp.found_inf.item() == 1.0

    def state():
        return snapshot(inp.params, inp.master_params, inp.exp_avgs, inp.exp_avg_sqs, inp.steps,
                        inp.momentum_buffers, sgd_steps, inp.grads)

    before = state()
    inp.call("adam_step_", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
             decoupled_weight_decay=True, max_grad_norm=1.0)
    inp.call("sgd_step_", steps=sgd_steps, lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.1,
             nesterov=False)
    assert_bitwise_equal(before, state())


def test_empty_lists_are_noops(device):
    ops.adam_step_([], [], [], [], [], [], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                   weight_decay=0.0, decoupled_weight_decay=True)
    ops.sgd_step_([], [], [], [], [], lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                  nesterov=False)
    found, sq = scalar(0.0, device), scalar(0.0, device)
    ops.grad_stats_([], found, sq)
    assert found.item() == 0.0 and sq.item() == 0.0
