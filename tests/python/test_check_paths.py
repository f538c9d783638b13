"""The argument checks (op_checks.cpp) read each tensor's facts once and decide on them in one
fixed order. Inputs beyond the common case (dense but not contiguous, views into one buffer)
must be accepted when valid and rejected with the same message when not, also at an index after
many accepted ones, and a call with several mistakes reports the same first one."""
import re

import pytest
import torch

from op_helpers import assert_bitwise_equal, snapshot
from op_inputs import op_inputs


def _inputs(device, shapes, memory_format=torch.contiguous_format):
    """FP16 params, FP32 master weights, FP16 grads and Adam state, each (but the 0-dim step
    counts) in memory_format."""
    inp = op_inputs(device, shapes, param_dtype=torch.float16, master_weights=True, seed=3)
    return inp.map(lambda name, t: t if name == "steps" else
                   t.contiguous(memory_format=memory_format))


def test_channels_last_matches_contiguous(device):
    """Dense but not contiguous: declined by the fast path, accepted by the full checks."""
    shapes = [(2, 3, 4, 5)] * 3
    cl = _inputs(device, shapes, torch.channels_last)
    ref = _inputs(device, shapes)
    assert not cl.params[0].is_contiguous()
    for inp in (cl, ref):
        inp.call("adam_step_")
    for name in ("params", "master_params", "grads", "exp_avgs", "exp_avg_sqs"):
        for x, y in zip(getattr(cl, name), getattr(ref, name)):
            assert torch.equal(x.contiguous(), y)


def test_strides_mismatch_still_rejected(device):
    inp = _inputs(device, [(2, 3, 4, 5)] * 3)
    inp.grads[2] = inp.grads[2].contiguous(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match=re.escape("grads[2] has strides")):
        inp.call("adam_step_")


@pytest.mark.parametrize("which", ["exp_avgs vs exp_avg_sqs", "grads vs master_params"])
def test_partial_overlap_late_index(device, which):
    """Two views into one buffer at index 40 of 50: reported, and nothing modified."""
    n = 50
    inp = _inputs(device, [(8,)] * n)
    if which == "exp_avgs vs exp_avg_sqs":
        buf = torch.zeros(12, device=device)
        inp.exp_avgs[40], inp.exp_avg_sqs[40] = buf[:8], buf[4:]
        message = "exp_avgs[40] and exp_avg_sqs[40] share memory"
    else:
        buf = torch.zeros(12, device=device)
        inp.master_params[40] = buf[:8]
        inp.grads[40] = buf[4:].view(torch.float16)[:8]
        message = "master_params[40] and grads[40] share memory"
    before = snapshot(*inp.tensors("adam_step_"))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        inp.call("adam_step_")
    assert_bitwise_equal(before, snapshot(*inp.tensors("adam_step_")))


def test_state_overlap_reported_before_later_state_dtype(device):
    """exp_avgs[i] is tested against exp_avg_sqs[i] before exp_avg_sqs[i]'s own checks."""
    inp = _inputs(device, [(8,)] * 50)
    buf = torch.zeros(16, device=device)
    inp.exp_avgs[40], inp.exp_avg_sqs[40] = buf[:8], buf.view(torch.float16)[8:16]
    with pytest.raises(RuntimeError, match=re.escape("exp_avgs[40] and exp_avg_sqs[40] share")):
        inp.call("adam_step_")
    inp.exp_avg_sqs[40] = torch.zeros(8, device=device, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=re.escape("exp_avg_sqs[40] has dtype Half but exp_avg_sqs[0] has Float")):
        inp.call("adam_step_")


def test_grad_list_fallback_messages(device):
    inp = op_inputs(device, [(8,)] * 20, grad_dtype=torch.float16,
                    scalars=dict(found_inf=0.0, grad_sum_sq=0.0))
    inp.grads[15] = torch.randn(8, device=device).half().to_sparse()
    with pytest.raises(RuntimeError, match=re.escape("grads[15] is sparse")):
        inp.call("grad_stats_")
    inp.grads[15] = torch.ones(8, device=device, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=re.escape("grads[15] has dtype Int")):
        inp.call("grad_stats_")


@pytest.mark.parametrize("op", ["adam_step_", "sgd_step_"])
def test_copy_on_write_tensors_get_their_own_copy(device, op):
    """Lazy clones (copy-on-write storage) among the tensors a step writes: the step gives each
    its own copy before writing (the kernels' addresses are then taken through torch's mutable
    accessors), so the tensors they were cloned from keep their values, and the results are
    those of the same step on plain tensors."""
    state = ["exp_avgs", "exp_avg_sqs"] if op == "adam_step_" else ["momentum_buffers"]

    def problem():
        return op_inputs(device, [(5,), (3, 4), (7,), (2, 2)], param_dtype=torch.float16,
                         master_weights=True, moments=op == "adam_step_",
                         momentum=op == "sgd_step_", seed=3)

    plain, cow = problem(), problem()
    sources = {}
    for name in ["params", "master_params", "grads", *state, "steps"]:
        tensors = getattr(cow, name)
        sources[name] = tensors[2].clone()
        tensors[2] = torch._lazy_clone(sources[name])
    kept = {name: t.clone() for name, t in sources.items()}
    hyper = dict(momentum=0.9) if op == "sgd_step_" else {}
    for _ in range(2):  # the second step reads the momentum buffers too
        plain.call(op, write_back_grads=True, **hyper)
        cow.call(op, write_back_grads=True, **hyper)
    for name, source in sources.items():
        assert torch.equal(source, kept[name]), f"{name}[2]'s source was written through its clone"
    assert_bitwise_equal(snapshot(*plain.tensors(op)), snapshot(*cow.tensors(op)))
