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
import math

import pytest
import torch

from op_helpers import (assert_bitwise_equal, assert_rel_close, f32, needs_cuda, ops, randn_list,
                        scalar, snapshot, sum_sq_fp64)
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
MANY = 3 * STATS_TENSORS_PER_LAUNCH + 300  # each dtype group spans two launches on CUDA


def many_mixed_grads(device):
    """MANY grads, FP32/FP16/BF16 interleaved, 1 to 13 elements, every 600th spanning two
    chunks; large enough values that the FP16/BF16 squares are far from 1."""
    sizes = [(40_001,) if i % 600 == 0 else (1 + (i * 7) % 13,) for i in range(MANY)]
    return [g.to(DTYPES[i % 3]) for i, g in
            enumerate(randn_list(device, torch.float32, sizes, scale=30.0, seed=71))]


def test_grad_stats_sum_sq_over_several_launches_of_mixed_dtypes(device):
    """sum_sq over more tensors of each dtype than one CUDA launch holds equals the float64
    sum (and adds to the value it had): partials from every launch of every dtype group must
    land in distinct workspace slots and all be added."""
    inp = op_inputs(device, grads=many_mixed_grads(device), moments=False,
                    scalars=dict(found_inf=0.0, grad_sum_sq=7.0, tensor_flags=0.0))
    inp.call("grad_stats_")
    assert inp.found_inf.item() == 0.0 and inp.tensor_flags.sum().item() == 0.0
    assert_rel_close(inp.grad_sum_sq.item(), 7.0 + sum_sq_fp64(inp.grads), rtol=1e-5)


@pytest.mark.parametrize("poison", ["inf", "nan"])
def test_one_poisoned_tensor_late_in_many_sets_found_inf(device, poison):
    """One non-finite element in tensor MANY - 2 (an FP16 grad in the second launch of its
    dtype group on CUDA): grad_stats_ flags exactly that tensor, and both passes set found_inf;
    unscale_and_check_ matches torch's own unscale on the same list."""
    late = MANY - 2
    inp = op_inputs(device, grads=many_mixed_grads(device), moments=False,
                    scalars=dict(found_inf=0.0, grad_sum_sq=0.0, tensor_flags=0.0,
                                 inv_scale=3.0 / 1024.0))
    inp.grads[late][-1] = float(poison)
    inp.call("grad_stats_")
    assert inp.found_inf.item() == 1.0
    assert torch.nonzero(inp.tensor_flags).flatten().tolist() == [late]

    ref, ref_found = [g.clone() for g in inp.grads], scalar(0.0, device)
    torch._amp_foreach_non_finite_check_and_unscale_(ref, ref_found, inp.inv_scale)
    inp.found_inf.zero_()
    inp.call("unscale_and_check_")
    assert inp.found_inf.item() == ref_found.item() == 1.0
    for g, r in zip(inp.grads, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=0, equal_nan=True)


# ------------------------------------------------------------ SGD: lr_tensor + clipping + found_inf
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


# ------------------------------------------------------------ a NaN gradient norm
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
