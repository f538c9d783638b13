"""On CUDA, more than 2^31 elements in one tensor: element indices and chunk offsets past
INT32_MAX in grad_stats_, unscale_and_check_ and adam_step_, and grad_stats_'s final reduction
on both sides of one block. Each test skips without the GPU memory it needs."""
import pytest
import torch

from op_helpers import assert_rel_close, needs_cuda, ops, scalar, sum_sq_fp64

CHUNK = 32768  # elements per block (cuda/multi_tensor_apply.cuh)
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
