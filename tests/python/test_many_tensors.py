"""More tensors than one CUDA launch holds, FP32/FP16/BF16 interleaved, on every device:
grad_stats_'s sum of squares over several launches of each dtype, and one non-finite value late
in the list flagged and found by grad_stats_, with unscale_and_check_ matching torch's unscale."""
import pytest
import torch

from op_helpers import assert_rel_close, randn_list, scalar, sum_sq_fp64
from op_inputs import op_inputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# cuda/multi_tensor_apply.cuh: the most tensors one grad_stats_ launch holds ((32000 - 64) // 29
# with the 32 KB argument limit of CUDA 12.1+).
STATS_TENSORS_PER_LAUNCH = 1101
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
