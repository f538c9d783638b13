"""The gradient-check ops against torch's references (CPU always, CUDA when present):
unscale_and_check_ against torch._amp_foreach_non_finite_check_and_unscale_, grad_stats_'s sum
of squares against FP64 and its per-tensor flags, over every dtype, FP64 and non-dense grads,
0-dim scalars, and a non-finite value at any position. The step ops: test_adam_sgd_step_ops.py;
the loss-scale update: test_loss_scale.py."""
import math

import pytest
import torch

from op_helpers import assert_bitwise_equal, max_abs_diff, ops, randn_list, scalar, snapshot
from op_inputs import op_inputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _tag(dtype):
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------- unscale_and_check_
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("poison", [None, "inf", "nan", "-inf"])
def test_unscale_and_check_matches_torch(device, dtype, poison, record_diff):
    # inv_scale not a power of two: exercises rounding
    inp = op_inputs(device, grads=randn_list(device, dtype, scale=100.0, seed=1),
                    scalars=dict(inv_scale=1 / 1024.0 * 3, found_inf=0.0))
    if poison:
        inp.grads[4][517] = float(poison)
    ref = [g.clone() for g in inp.grads]
    found_ref = scalar(0.0, device)
    inp.call("unscale_and_check_")
    torch._amp_foreach_non_finite_check_and_unscale_(ref, found_ref, inp.inv_scale)
    assert inp.found_inf.item() == found_ref.item() == (1.0 if poison else 0.0)
    for g, r in zip(inp.grads, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=0, equal_nan=True)
    record_diff(f"unscale_and_check_ vs torch ({_tag(dtype)})", max_abs_diff(
        [g.nan_to_num() for g in inp.grads], [r.nan_to_num() for r in ref]))


@pytest.mark.parametrize("poison", [None, "inf", "nan"])
def test_unscale_takes_fp64_and_non_dense_grads_like_torch(device, poison):
    """FP64 and strided-but-not-dense grads, mixed with ones the fused kernel walks: the same
    result as torch's op, which handles them per tensor (fusedamp passes them to it)."""
    base = randn_list(device, torch.float32, [(6, 5), (40,), (7, 9), (33,)], seed=31)

    def make():  # FP64, FP16, transposed (dense, not contiguous), every other element
        grads = [base[0].double(), base[1].half(), base[2].clone().t(), base[3].clone()[::2]]
        if poison is not None:
            grads[3][4] = float(poison)  # in a grad that is not dense
        return grads

    mine, ref = make(), make()
    found, ref_found = scalar(0.0, device), scalar(0.0, device)
    inv = scalar(0.25, device)
    ops.unscale_and_check_(mine, found, inv)
    torch._amp_foreach_non_finite_check_and_unscale_(ref, ref_found, inv)
    assert found.item() == ref_found.item() == (0.0 if poison is None else 1.0)
    for m, r in zip(mine, ref):
        assert m.dtype == r.dtype and m.stride() == r.stride()
        torch.testing.assert_close(m, r, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("poison", [None, "inf", "nan"])
def test_grad_stats_takes_fp64_and_non_dense_grads(device, poison):
    """FP64 and strided-but-not-dense grads among ones the fused kernel walks: found_inf, the
    sum of squares (vs FP64) and each grad's flag at its own position."""
    base = randn_list(device, torch.float32, [(6, 5), (40,), (7, 9), (33,), (17,)], seed=32)
    grads = [base[0].double(), base[1].half(), base[2].t(), base[3][::2], base[4].bfloat16()]
    if poison is not None:
        grads[3][4] = float(poison)  # in a grad that is not dense, between two fused ones
    inp = op_inputs(device, grads=grads, scalars=dict(found_inf=0.0, grad_sum_sq=0.5,
                                                      tensor_flags=0.0))
    inp.grads = grads  # as they are: op_inputs copies (and so densifies) what it is given
    inp.call("grad_stats_")
    expected = 0.5 + sum(g.double().square().sum().item() for g in grads)
    assert inp.found_inf.item() == (0.0 if poison is None else 1.0)
    assert inp.tensor_flags.tolist() == [0, 0, 0, 0 if poison is None else 1, 0]
    if poison is None:
        assert abs(inp.grad_sum_sq.item() - expected) <= 1e-6 * expected
    else:
        assert not math.isfinite(inp.grad_sum_sq.item())


@pytest.mark.parametrize("op", ["grad_stats_", "unscale_and_check_"])
def test_fp64_grads_with_zero_dim_scalars(device, op):
    """The one-element scalars may be 0-dim (as torch.amp's found_inf): the per-tensor path
    for FP64 grads writes them in place like the fused kernels."""
    found_inf, inv_scale, sum_sq = (torch.zeros((), device=device), torch.ones((), device=device),
                                    torch.zeros((), device=device))
    grads = [torch.tensor([3.0, float("inf")], device=device, dtype=torch.float64),
             torch.tensor([4.0], device=device)]
    if op == "grad_stats_":
        ops.grad_stats_(grads, found_inf, sum_sq)
        assert math.isinf(sum_sq.item())
    else:
        ops.unscale_and_check_(grads, found_inf, inv_scale)
    assert found_inf.shape == () and found_inf.item() == 1.0


def test_unscale_never_resets_found_inf(device):
    grads = randn_list(device, sizes=[(100,)])
    found = scalar(1.0, device)
    ops.unscale_and_check_(grads, found, scalar(0.5, device))
    assert found.item() == 1.0


def test_unscale_mixed_dtypes_and_empty_list(device):
    grads = [torch.randn(300, device=device, dtype=d) for d in DTYPES]
    ref = [g.float() * 0.25 for g in grads]
    found = scalar(0.0, device)
    ops.unscale_and_check_(grads, found, scalar(0.25, device))
    for g, r in zip(grads, ref):
        assert torch.equal(g.float(), r)
    ops.unscale_and_check_([], found, scalar(0.25, device))
    assert found.item() == 0.0


# ---------------------------------------------------------------- grad_stats_
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_stats_sum_of_squares(device, dtype, record_diff):
    inp = op_inputs(device, grads=randn_list(device, dtype, scale=3.0, seed=2),
                    scalars=dict(found_inf=0.0, grad_sum_sq=5.0,  # sum_sq accumulates
                                 tensor_flags=0.0))
    before = snapshot(inp.grads)
    inp.call("grad_stats_")
    assert_bitwise_equal(before, snapshot(inp.grads))  # read-only
    ref = 5.0 + sum((g.double() ** 2).sum().item() for g in inp.grads)
    rel = abs(inp.grad_sum_sq.item() - ref) / ref
    assert rel < 1e-5, rel
    assert inp.found_inf.item() == 0.0 and inp.tensor_flags.sum().item() == 0
    record_diff(f"grad_stats_ sum_sq rel. error vs fp64 ({_tag(dtype)})", rel)


def test_grad_stats_fp16_scaled_to_2_24(device, record_diff):
    # FP16 grads scaled by up to 2**24 sit near the FP16 maximum; their squares (~4e9) and
    # their sum over millions of elements must neither overflow nor lose accuracy.
    g = torch.full((3_000_001,), 60000.0, dtype=torch.float16, device=device)
    g[::7] = -65504.0
    found, sq = scalar(0.0, device), scalar(0.0, device)
    ops.grad_stats_([g], found, sq)
    ref = (g.double() ** 2).sum().item()
    rel = abs(sq.item() - ref) / ref
    assert math.isfinite(sq.item()) and rel < 1e-5, rel
    assert found.item() == 0.0
    record_diff("grad_stats_ rel. error, fp16 near max (3M elements)", rel)


@pytest.mark.parametrize("poison", ["inf", "nan"])
def test_grad_stats_flags_which_tensor(device, poison):
    inp = op_inputs(device, grads=randn_list(device, torch.float16, seed=3),
                    scalars=dict(found_inf=0.0, grad_sum_sq=0.0, tensor_flags=0.0))
    inp.grads[2][3] = float(poison)
    inp.grads[6][40000] = float(poison)  # the last element of the last chunk
    inp.call("grad_stats_")
    assert inp.found_inf.item() == 1.0
    assert inp.tensor_flags.tolist() == [0, 0, 1, 0, 0, 0, 1]


# ---------------------------------------------------------------- both passes
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_nonfinite_value_at_any_position_of_a_small_tensor_is_found(device, dtype):
    """The CPU passes reduce a tensor under one vector's worth of elements over its live lanes
    only. A single inf or NaN at any position of any such tensor, the last element included,
    must be found by both passes (the plain unscale and the statistics pass)."""
    for n in (1, 2, 15, 16, 17, 31, 32, 33):
        for position in sorted({0, n // 2, n - 1}):
            for bad in (float("inf"), float("nan")):
                grads = [torch.ones(k, device=device, dtype=dtype) for k in (3, n, 5)]
                grads[1][position] = bad
                found = torch.zeros(1, device=device)
                ops.unscale_and_check_(grads, found, torch.ones(1, device=device))
                assert found.item() == 1.0, (n, position, bad, "unscale")
                found = torch.zeros(1, device=device)
                sum_sq = torch.zeros(1, device=device)
                ops.grad_stats_(grads, found, sum_sq)
                assert found.item() == 1.0, (n, position, bad, "stats")
