"""The argument checks have a fast path (contiguous tensors) and the full checks for anything
else (op_checks.cpp). Inputs the fast path declines must still be accepted when valid and
rejected with the same message when not, also at an index after many accepted ones."""
import re

import pytest
import torch

from op_helpers import assert_bitwise_equal, ops, snapshot

KW = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
          decoupled_weight_decay=True)


def _state(device, shapes, memory_format=torch.contiguous_format):
    gen = torch.Generator().manual_seed(3)

    def rand(s):
        return torch.randn(s, generator=gen).to(device).contiguous(memory_format=memory_format)

    master = [rand(s) for s in shapes]
    params = [m.half() for m in master]
    grads = [rand(s).half() for s in shapes]
    m = [torch.zeros_like(x) for x in master]
    v = [torch.zeros_like(x) for x in master]
    steps = [torch.zeros((), device=device) for _ in shapes]
    return [params, master, grads, m, v, steps]


def test_channels_last_matches_contiguous(device):
    """Dense but not contiguous: declined by the fast path, accepted by the full checks."""
    shapes = [(2, 3, 4, 5)] * 3
    cl = _state(device, shapes, torch.channels_last)
    ref = _state(device, shapes)
    assert not cl[0][0].is_contiguous()
    for args in (cl, ref):
        ops.adam_step_(*args, **KW)
    for a, b in zip(cl[:5], ref[:5]):
        for x, y in zip(a, b):
            assert torch.equal(x.contiguous(), y)


def test_strides_mismatch_still_rejected(device):
    args = _state(device, [(2, 3, 4, 5)] * 3)
    args[2][2] = args[2][2].contiguous(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match=re.escape("grads[2] has strides")):
        ops.adam_step_(*args, **KW)


@pytest.mark.parametrize("which", ["exp_avgs vs exp_avg_sqs", "grads vs master_params"])
def test_partial_overlap_late_index(device, which):
    """Two views into one buffer at index 40 of 50: reported, and nothing modified."""
    n = 50
    args = _state(device, [(8,)] * n)
    if which == "exp_avgs vs exp_avg_sqs":
        buf = torch.zeros(12, device=device)
        args[3][40], args[4][40] = buf[:8], buf[4:]
        message = "exp_avgs[40] and exp_avg_sqs[40] share memory"
    else:
        buf = torch.zeros(12, device=device)
        args[1][40] = buf[:8]
        args[2][40] = buf[4:].view(torch.float16)[:8]
        message = "master_params[40] and grads[40] share memory"
    before = snapshot(*args)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.adam_step_(*args, **KW)
    assert_bitwise_equal(before, snapshot(*args))


def test_grad_list_fallback_messages(device):
    grads = [torch.randn(8, device=device).half() for _ in range(20)]
    grads[15] = torch.randn(8, 2, device=device).half()[:, 0]
    found_inf, sum_sq = torch.zeros(1, device=device), torch.zeros(1, device=device)
    with pytest.raises(RuntimeError, match=re.escape("grads[15] must be non-overlapping")):
        ops.grad_stats_(grads, found_inf, sum_sq)
    grads[15] = torch.randn(8, device=device).double()
    with pytest.raises(RuntimeError, match=re.escape("grads[15] has dtype Double")):
        ops.grad_stats_(grads, found_inf, sum_sq)
