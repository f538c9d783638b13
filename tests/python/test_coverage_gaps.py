"""The cases issue 14 found missing from the op tests (each is named there):

* more than 2^31 elements in one tensor (element and chunk offsets past INT32_MAX);
* grad_stats_ over more tensors than one launch holds, dtypes interleaved, checked by value;
* SGD with lr_tensor + fused clipping + found_inf against torch.optim.SGD, and its skipped step;
* SGD and unscale_and_check_ captured in a CUDA graph;
* a NaN gradient norm with clipping on and no found_inf;
* one misaligned list, and FP32 lists aligned to 8 but not 16 bytes;
* every op on a non-default stream;
* the loss-scale sequence with torch's default factors, bit for bit.

Device-parametrised tests run on the CPU too; the CUDA-only ones say why they skip.
"""
import pytest
import torch

from op_helpers import (assert_bitwise_equal, assert_rel_close, needs_cuda, ops, randn_list,
                        scalar, sum_sq_fp64)
from op_inputs import op_inputs
from test_cuda import assert_same, capture, on_both, state_tol, sync_forbidden


DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# cuda/multi_tensor_apply.cuh: elements per block, and the most tensors one grad_stats_ launch
# holds ((32000 - 64) // 29 with the 32 KB argument limit of CUDA 12.1+).
CHUNK = 32768
STATS_TENSORS_PER_LAUNCH = 1101


def assert_all_tensors_equal(a, b):
    """Every tensor of OpInputs a bit-identical to the same tensor of b."""
    for (name, x), (_, y) in zip(a.named_tensors(), b.named_tensors()):
        assert torch.equal(x, y), name


# ------------------------------------------------------------ more than 2^31 elements
BIG = 2 ** 31 + 2 ** 20 + 3  # past INT32_MAX, with a ragged last chunk


def require_free_gpu_memory(gib):
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    if free < gib * 2 ** 30:
        pytest.skip(f"needs {gib} GiB of free GPU memory, {free / 2 ** 30:.1f} GiB free")


@needs_cuda
def test_unscale_and_grad_stats_past_2_31_elements():
    """An FP16 grad of 2^31 + 2^20 + 3 elements between two small ones: a poisoned element past
    index 2^31 must set found_inf and the tensor's flag, the sum of squares must match float64,
    and unscaling must reach every element (an int32 element index or chunk offset would wrap
    there, and the tensor after it would start at the wrong block)."""
    require_free_gpu_memory(16)
    gen = torch.Generator(device="cuda").manual_seed(61)
    grads = [torch.randn(n, generator=gen, device="cuda", dtype=torch.float16)
             for n in (1000, BIG, 777)]
    found, sum_sq, flags = scalar(0.0, "cuda"), scalar(0.0, "cuda"), torch.zeros(3, device="cuda")

    ops.grad_stats_(grads, found, sum_sq, flags)
    assert found.item() == 0.0 and flags.tolist() == [0.0, 0.0, 0.0]
    assert_rel_close(sum_sq.item(), sum_sq_fp64(grads), rtol=1e-5)

    poison = 2 ** 31 + 12345
    grads[1][poison] = float("inf")
    ops.grad_stats_(grads, found, sum_sq, flags)
    assert found.item() == 1.0 and flags.tolist() == [0.0, 1.0, 0.0]

    expected = [g * 0.5 for g in grads]  # exact in FP16 as in the kernel's FP32 lanes
    found.zero_()
    ops.unscale_and_check_(grads, found, scalar(0.5, "cuda"))
    assert found.item() == 1.0
    for g, e in zip(grads, expected):
        for k in range(0, g.numel(), 1 << 28):
            assert torch.equal(g[k:k + (1 << 28)], e[k:k + (1 << 28)]), k


@needs_cuda
@pytest.mark.parametrize("elements", [2 ** 28 - 2 ** 15, 2 ** 28, 3 * 2 ** 28 - 5])
def test_grad_stats_final_reduction_on_both_sides_of_one_block(elements):
    """grad_stats_ adds its per-chunk partials (one per 32,768 elements of each grad) in one
    block up to 8,192 of them and in two levels beyond. With the 999-element grad beside it:
    8,192 partials (one block, at the edge), 8,193 (two levels, a last range of one), 24,577:
    each time the sum of squares matches float64 and is the same bit for bit on every call
    (the order depends only on the number of partials)."""
    require_free_gpu_memory(4)
    gen = torch.Generator(device="cuda").manual_seed(67)
    grads = [torch.randn(elements, generator=gen, device="cuda", dtype=torch.float16),
             torch.randn(999, generator=gen, device="cuda", dtype=torch.float16)]
    sums = []
    for _ in range(3):
        found, sum_sq = scalar(0.0, "cuda"), scalar(0.0, "cuda")
        ops.grad_stats_(grads, found, sum_sq)
        assert found.item() == 0.0
        sums.append(sum_sq.item())
    assert_rel_close(sums[0], sum_sq_fp64(grads), rtol=1e-5)
    assert sums[0] == sums[1] == sums[2]


@needs_cuda
def test_adam_chunk_offsets_past_2_31_match_the_same_slices_alone():
    """adam_step_ on an FP16 param of 2^31 + 2^20 + 3 elements (FP32 moments, non-zero state):
    slices at the start, across 2^31 and at the end must equal the same kernel run on copies
    of just those slices. Each slice starts at a chunk boundary, so the kernel executes the
    same instructions per element and the results are bitwise equal; a chunk offset that
    wrapped at 2^31 would update the wrong elements or none."""
    require_free_gpu_memory(32)  # 12 bytes per element, ~26 GB
    gen = torch.Generator(device="cuda").manual_seed(62)

    def draw(n, dtype, fill):
        return fill(torch.empty(n, device="cuda", dtype=dtype))

    params = [draw(n, torch.float16, lambda t: t.normal_(generator=gen)) for n in (1000, BIG)]
    grads = [draw(p.numel(), torch.float16, lambda t: t.normal_(generator=gen)) for p in params]
    exp_avgs = [draw(p.numel(), torch.float32, lambda t: t.normal_(0, 0.1, generator=gen))
                for p in params]
    exp_avg_sqs = [draw(p.numel(), torch.float32, lambda t: t.uniform_(0, 0.01, generator=gen))
                   for p in params]
    steps = [torch.full((), 3.0, device="cuda") for _ in params]
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                 decoupled_weight_decay=True)

    windows = [(0, 2 * CHUNK), (2 ** 31 - CHUNK, 2 ** 31 + 2 * CHUNK),
               ((BIG // CHUNK - 1) * CHUNK, BIG)]
    alone = [[x[1][a:b].clone() for x in (params, grads, exp_avgs, exp_avg_sqs)]
             for a, b in windows]

    ops.adam_step_(params, [], grads, exp_avgs, exp_avg_sqs, steps, **hyper)
    assert [s.item() for s in steps] == [4.0, 4.0]
    for (a, b), (p, g, m, v) in zip(windows, alone):
        ops.adam_step_([p], [], [g], [m], [v], [torch.full((), 3.0, device="cuda")], **hyper)
        for name, big, small in (("params", params, p), ("exp_avgs", exp_avgs, m),
                                 ("exp_avg_sqs", exp_avg_sqs, v)):
            assert torch.equal(big[1][a:b], small), (name, a, b)


# ------------------------------------------------------------ many tensors, mixed dtypes


# ------------------------------------------------------------ SGD: lr_tensor + clipping + found_inf


# ------------------------------------------------------------ a NaN gradient norm


# ------------------------------------------------------------ the loss-scale sequence


# ------------------------------------------------------------ CUDA graphs: SGD and unscale
def sgd_graph_state(pdtype, master):
    sizes = [(1000,), (33, 17), (32769,), (5,)]
    return op_inputs("cuda", param_dtype=pdtype, master_weights=master, moments=False,
                     momentum=True, weights=randn_list("cpu", sizes=sizes, seed=52),
                     grads=[torch.zeros(s, dtype=pdtype) for s in sizes], loss_scale=2.0 ** 10,
                     scalars=dict(found_inf=0.0, inv_scale=1.0, lr_tensor=1e-2))


def sgd_graph_step(s):
    """One step after backward, all on the device: unscale the grads in place, SGD with
    momentum on the unscaled grads (skipped on overflow), update the loss scale."""
    s.found_inf.zero_()
    torch.reciprocal(s.scale, out=s.inv_scale)
    s.call("unscale_and_check_")
    s.call("sgd_step_", inv_scale=None, lr=0.0, momentum=0.9, dampening=0.0, weight_decay=1e-4,
           nesterov=False)
    s.call("update_scale_", growth_factor=2.0, backoff_factor=0.5, growth_interval=3)


@needs_cuda
@pytest.mark.parametrize("pdtype,master", [(torch.float16, True), (torch.bfloat16, True),
                                           (torch.float32, False)],
                         ids=["fp16-master", "bf16-master", "fp32"])
def test_sgd_and_unscale_in_a_cuda_graph_equal_eager(pdtype, master):
    """unscale_and_check_ -> sgd_step_ -> update_scale_ captured once and replayed ten times
    with new grads, a new lr and two overflowing steps: every tensor bit-identical to the same
    steps run eagerly (the ops read their scalars on the device, so the replay sees them)."""
    eager = sgd_graph_state(pdtype, master)
    graphed = eager.map(lambda _, t: t.clone())
    graph = capture(sgd_graph_step, eager.map(lambda _, t: t.clone()), graphed)

    gen = torch.Generator().manual_seed(53)
    for it in range(10):
        grads = [(torch.randn(g.shape, generator=gen) * 2.0 ** 10).to(pdtype)
                 for g in eager.grads]
        if it in (3, 4):
            grads[2].view(-1)[7] = float("inf")
        for s in (eager, graphed):
            for dst, src in zip(s.grads, grads):
                dst.copy_(src)
            s.lr_tensor.fill_(1e-2 * 0.9 ** it)
        with sync_forbidden():
            sgd_graph_step(eager)
        graph.replay()
    torch.cuda.synchronize()
    assert_all_tensors_equal(eager, graphed)
    assert all(s.item() == 8.0 for s in eager.steps)  # 10 steps, 2 skipped


# ------------------------------------------------------------ alignment: one list, 8 bytes
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


# ------------------------------------------------------------ a non-default stream
STREAM_CALLS = {
    "unscale_and_check_": {},
    "grad_stats_": {},
    "update_scale_": dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=1),
    "adam_step_": dict(max_grad_norm=1.0),
    "sgd_step_": dict(momentum=0.9, max_grad_norm=1.0),
}
SLEEP_CYCLES = 1 << 30  # ~0.5 s on a ~2 GHz GPU: far longer than the host needs below


@needs_cuda
@pytest.mark.parametrize("op", list(STREAM_CALLS))
def test_op_runs_on_the_current_side_stream_and_matches_the_default_stream(op):
    """Called under torch.cuda.stream(side), every kernel of the op (follow-up kernels and
    workspaces included) must be enqueued on `side`: with `side` held busy by a sleep, nothing
    has changed once the default stream has drained. After `side` runs, every tensor equals
    the same call made on the default stream, bit for bit."""
    inp = op_inputs("cuda", [(1 << 20,), (33, 3), (5,)], param_dtype=torch.float16,
                    master_weights=True, momentum=True, loss_scale=2.0 ** 10,
                    scalars=dict(found_inf=0.0, grad_sum_sq=100.0, inv_scale=1 / 1024.0,
                                 lr_tensor=1e-3, tensor_flags=0.0))
    default_run = inp.map(lambda _, t: t.clone())
    default_run.call(op, **STREAM_CALLS[op])  # also loads the kernels before the timed part
    torch.cuda._sleep(1)
    before = [t.clone() for _, t in inp.named_tensors()]
    torch.cuda.synchronize()

    side, slept = torch.cuda.Stream(), torch.cuda.Event()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        slept.record()
        with sync_forbidden():  # a host sync here would wait out the sleep
            inp.call(op, **STREAM_CALLS[op])
    torch.cuda.current_stream().synchronize()
    early = [t.clone() for _, t in inp.named_tensors()]  # on the default stream
    torch.cuda.current_stream().synchronize()
    assert not slept.query(), "the side stream's sleep ended before the check: inconclusive"
    assert_bitwise_equal(before, early)

    side.synchronize()
    changed = [not torch.equal(a, b) for a, (_, b) in zip(before, inp.named_tensors())]
    assert any(changed), "the op changed nothing: the comparison below would prove nothing"
    assert_all_tensors_equal(inp, default_run)
