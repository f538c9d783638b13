"""The step ops' fused clipping (grad_stats_'s sum of squares handed to sgd_step_ / adam_step_)
against torch's clip_grad_norm_ and torch.optim: AdamW with loss-scaled gradients, SGD with its
learning rate read from a device tensor that changes every step, a step skipped through
found_inf and the step after it, and a NaN gradient norm with no found_inf."""
import math

import pytest
import torch

from op_helpers import assert_bitwise_equal, f32, max_abs_diff, randn_list, snapshot
from op_inputs import op_inputs


class SgdAgainstTorch:
    """fusedamp's SGD step (momentum 0.9, loss-scaled grads, lr from a device tensor, fused
    clipping from grad_stats_'s sum of squares, found_inf) next to torch's: grads / scale,
    clip_grad_norm_(foreach=False), torch.optim.SGD(foreach=False) with the same lr."""
    LOSS_SCALE = 2.0 ** 10
    MAX_NORM = 50.0

    def __init__(self, device):
        self.device = device
        self.inp = op_inputs(device, seed=81, moments=False, momentum=True,
                             scalars=dict(lr_tensor=0.0, inv_scale=1 / self.LOSS_SCALE,
                                          found_inf=0.0, grad_sum_sq=0.0))
        self.ref = [torch.nn.Parameter(p.clone()) for p in self.inp.params]
        self.opt = torch.optim.SGD(self.ref, lr=0.05, momentum=0.9, foreach=False)

    def step(self, k, poison=False):
        """Step k: the lr changes every step; the unscaled grad norm is ~14 on even steps (not
        clipped) and ~270 on odd steps (clipped to 50). poison: an inf in one grad, so the step
        is skipped (torch's optimizer is then not stepped, as GradScaler does)."""
        lr = f32(0.05 * 0.8 ** k)  # representable in the FP32 lr_tensor: the same lr on both
        grads = randn_list(self.device, seed=800 + k, scale=0.05 if k % 2 == 0 else 1.0)
        inp = self.inp
        inp.grads = [g * self.LOSS_SCALE for g in grads]  # exact: a power of two
        if poison:
            inp.grads[5].view(-1)[3] = float("inf")
        inp.lr_tensor.fill_(lr)
        inp.found_inf.zero_()
        inp.grad_sum_sq.zero_()
        inp.call("grad_stats_")
        inp.call("sgd_step_", lr=123.0,  # ignored: lr_tensor overrides it
                 momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
                 max_grad_norm=self.MAX_NORM)
        if not poison:
            for r, g in zip(self.ref, grads):
                r.grad = g.clone()
            torch.nn.utils.clip_grad_norm_(self.ref, self.MAX_NORM, foreach=False)
            self.opt.param_groups[0]["lr"] = lr
            self.opt.step()

    def assert_matches_torch(self):
        for p, r in zip(self.inp.params, self.ref):
            torch.testing.assert_close(p, r.detach(), rtol=2e-5, atol=2e-6)
        for buf, r in zip(self.inp.momentum_buffers, self.ref):
            torch.testing.assert_close(buf, self.opt.state[r]["momentum_buffer"], rtol=2e-5,
                                       atol=2e-6)


def test_sgd_lr_tensor_and_clipping_match_torch(device):
    """Twelve steps with lr read from a device tensor that changes every step, clipping on
    every other step, found_inf = 0: params and momentum buffers follow torch's."""
    run = SgdAgainstTorch(device)
    for k in range(12):
        run.step(k)
    assert run.inp.found_inf.item() == 0.0
    assert all(s.item() == 12.0 for s in run.inp.steps)
    run.assert_matches_torch()


def test_sgd_step_with_found_inf_is_bitwise_noop_then_resumes_like_torch(device):
    """With found_inf = 1 (an inf grad, so grad_sum_sq is inf too) sgd_step_ with lr_tensor
    and clipping changes no bit of any param, momentum buffer or step count; the next clean
    step continues exactly where torch, which skipped that step, continues."""
    run = SgdAgainstTorch(device)
    for k in range(3):
        run.step(k)
    inp = run.inp
    before = snapshot(inp.params, inp.momentum_buffers, inp.steps)
    run.step(3, poison=True)
    assert inp.found_inf.item() == 1.0 and not math.isfinite(inp.grad_sum_sq.item())
    assert_bitwise_equal(before, snapshot(inp.params, inp.momentum_buffers, inp.steps))
    run.step(4)
    assert all(s.item() == 4.0 for s in inp.steps)
    run.assert_matches_torch()


@pytest.mark.parametrize("op", ["sgd_step_", "adam_step_"])
def test_nan_grad_norm_with_clipping_and_no_found_inf_gives_nan_like_torch(device, op):
    """One NaN grad, clipping on, no found_inf passed to the step: torch's clip_grad_norm_
    (error_if_nonfinite=False) computes a NaN norm, clamp(max=1) keeps it, every grad becomes
    NaN and so does every param. The fused step must give NaN in exactly the same places."""
    sgd = op == "sgd_step_"
    inp = op_inputs(device, seed=91, moments=not sgd, momentum=sgd,
                    scalars=dict(found_inf=0.0, grad_sum_sq=0.0))
    inp.grads[4][517] = float("nan")
    inp.call("grad_stats_")
    assert math.isnan(inp.grad_sum_sq.item())

    ref = [torch.nn.Parameter(p.clone()) for p in inp.params]
    for r, g in zip(ref, inp.grads):
        r.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(ref, 1.0, error_if_nonfinite=False, foreach=False)
    if sgd:
        torch.optim.SGD(ref, lr=1e-3, momentum=0.9, foreach=False).step()
        inp.call(op, found_inf=None, max_grad_norm=1.0, momentum=0.9)
    else:
        torch.optim.AdamW(ref, lr=1e-3, weight_decay=1e-2, foreach=False).step()
        inp.call(op, found_inf=None, max_grad_norm=1.0)
    for i, (p, r) in enumerate(zip(inp.params, ref)):
        assert torch.equal(p.isnan(), r.detach().isnan()), i
        torch.testing.assert_close(p, r.detach(), rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
@pytest.mark.parametrize("loss_scale", [1.0, 2.0 ** 10])
def test_clipping_matches_clip_grad_norm(device, max_norm, loss_scale, record_diff):
    inp = op_inputs(device, seed=9,
                    scalars=dict(inv_scale=1 / loss_scale, found_inf=0.0, grad_sum_sq=0.0))
    ref = [torch.nn.Parameter(p.clone()) for p in inp.params]
    opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    for step in range(20):
        grads = randn_list(device, seed=600 + step)
        inp.grads = [g * loss_scale for g in grads]
        for r, g in zip(ref, inp.grads):
            r.grad = g.clone() / loss_scale
        torch.nn.utils.clip_grad_norm_(ref, max_norm, foreach=False)
        opt.step()
        inp.found_inf.zero_()
        inp.grad_sum_sq.zero_()
        inp.call("grad_stats_")
        inp.call("adam_step_", lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
                 decoupled_weight_decay=True, max_grad_norm=max_norm)
    diff = max_abs_diff(inp.params, [r.detach() for r in ref])
    record_diff("adam_step_ + fused clipping vs clip_grad_norm_ + AdamW (fp32)", diff)
    for p, r in zip(inp.params, ref):
        torch.testing.assert_close(p, r.detach(), rtol=2e-5, atol=2e-6)
