"""On CUDA, tensors off their vector alignment: one list of a step misaligned by an element (the
others aligned), or every FP32 list 8 but not 16 bytes aligned, against the CPU kernels on
identical inputs."""
import pytest
import torch

from cuda_helpers import assert_same, on_both, state_tol, sync_forbidden
from op_helpers import needs_cuda, randn_list
from op_inputs import op_inputs

ALIGN_SIZES = [(1,), (9,), (31, 7), (32769,), (100_003,)]
EVERY_LIST_8_BYTES = {name: 2 for name in ("params", "master_params", "grads", "exp_avgs",
                                           "exp_avg_sqs", "momentum_buffers")}
STEP_HYPER = {"adam_step_": dict(lr=1e-3, beta1=0.9, beta2=0.995, eps=1e-8, weight_decay=0.01,
                                 decoupled_weight_decay=True),
              "sgd_step_": dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=1e-3,
                                nesterov=False)}


@needs_cuda
@pytest.mark.parametrize("op,pdtype,master,offsets", [
    ("adam_step_", torch.float16, True, {"exp_avg_sqs": 1}),
    ("adam_step_", torch.float16, True, {"master_params": 1}),
    ("adam_step_", torch.float32, False, {"exp_avg_sqs": 1}),
    ("adam_step_", torch.float32, False, EVERY_LIST_8_BYTES),
    ("sgd_step_", torch.bfloat16, True, {"momentum_buffers": 1}),
    ("sgd_step_", torch.bfloat16, True, {"master_params": 1}),
    ("sgd_step_", torch.float32, False, EVERY_LIST_8_BYTES),
], ids=["adam-fp16-exp_avg_sqs+1", "adam-fp16-masters+1", "adam-fp32-exp_avg_sqs+1",
        "adam-fp32-8-byte", "sgd-bf16-buffers+1", "sgd-bf16-masters+1", "sgd-fp32-8-byte"])
def test_step_with_one_misaligned_list_matches_cpu(op, pdtype, master, offsets):
    """Only one list off its vector alignment (the others aligned), or every FP32 list 8 but
    not 16 bytes aligned: the kernel must take the element-wise path for those tensors (a
    16-byte access there would fault or read the wrong elements) and agree with the CPU kernel
    on identical inputs over three steps with non-zero state, clipping and loss scaling."""
    gen = torch.Generator().manual_seed(61)
    sgd = op == "sgd_step_"
    inp = op_inputs("cpu", ALIGN_SIZES, param_dtype=pdtype, master_weights=master, seed=61,
                    moments=not sgd, momentum=sgd,
                    grads=randn_list("cpu", pdtype, ALIGN_SIZES, scale=64.0, seed=62),
                    scalars=dict(inv_scale=1 / 64.0, found_inf=0.0, grad_sum_sq=4.0e8,
                                 lr_tensor=2e-3))
    inp.exp_avgs = [torch.randn(t.shape, generator=gen) * 0.1 for t in inp.exp_avgs]
    inp.exp_avg_sqs = [torch.rand(t.shape, generator=gen) * 0.01 for t in inp.exp_avg_sqs]
    cpu, cuda = on_both(inp, offsets)
    for _ in range(3):
        cpu.call(op, max_grad_norm=1.0, **STEP_HYPER[op])
        with sync_forbidden():
            cuda.call(op, max_grad_norm=1.0, **STEP_HYPER[op])
    tol = state_tol(pdtype, master)
    for field in ("exp_avgs", "exp_avg_sqs", "momentum_buffers", "master_params"):
        assert_same(getattr(cuda, field), getattr(cpu, field), **tol)
    assert_same(cuda.params, cpu.params, **({"rtol": 1e-5, "atol": 1e-6}
                                            if pdtype == torch.float32 else {}))
    assert_same(cuda.steps, cpu.steps, exact=True)


@needs_cuda
def test_fp32_grads_8_byte_aligned_unscale_and_grad_stats_match_cpu():
    """FP32 grads starting 8 bytes past a 16-byte boundary (a float4 access would fault):
    unscale_and_check_ bit-exact and grad_stats_ within FP32 summation error of the CPU."""
    inp = op_inputs("cpu", ALIGN_SIZES, seed=63, moments=False,
                    grads=randn_list("cpu", torch.float32, ALIGN_SIZES, scale=300.0, seed=64),
                    scalars=dict(found_inf=0.0, grad_sum_sq=0.0, tensor_flags=0.0,
                                 inv_scale=3.0 / 1024.0))
    cpu, cuda = on_both(inp, {"grads": 2})
    for s in (cpu, cuda):
        s.call("grad_stats_")
        s.call("unscale_and_check_")
    assert cuda.found_inf.item() == cpu.found_inf.item() == 0.0
    torch.testing.assert_close(cuda.grad_sum_sq.cpu(), cpu.grad_sum_sq, rtol=1e-5, atol=0)
    assert_same(cuda.grads, cpu.grads, exact=True)
