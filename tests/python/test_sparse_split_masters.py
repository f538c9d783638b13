"""master_weights="split" / "split8" for embedding tables: a bfloat16 table and its int16 (or
int8) remainders in state["param_remainder"], together the FP32 master (a 24-bit one for
split8) at 4 (3) bytes an element instead of 6."""
import pytest
import torch
import torch.nn as nn

import fusedamp
from master_mode_helpers import combine_reference
from sparse_helpers import DIM, ROWS, sparse_grad

LR, STEPS = 1e-4, 120  # each update ~1/78 of a BF16 ulp at 1.0


def _run(device, mode, cls=fusedamp.optim.Adagrad, steps=4, dtype=torch.bfloat16, **kw):
    gen = torch.Generator().manual_seed(21)
    p = nn.Parameter(torch.randn(ROWS, DIM, generator=gen).to(device=device, dtype=dtype))
    opt = cls([p], lr=0.05, master_weights=mode, **kw)
    for _ in range(steps):
        p.grad = sparse_grad(gen, dtype=dtype, device=device)
        opt.step()
    return p, opt


def test_split_pair_is_the_fp32_master_bit_for_bit(device):
    p_master, opt_master = _run(device, True)
    p_split, opt_split = _run(device, "split")
    remainder = opt_split.state[p_split]["param_remainder"]
    assert remainder.dtype == torch.int16 and "master_param" not in opt_split.state[p_split]
    master = opt_master.state[p_master]["master_param"]
    assert torch.equal(combine_reference(p_split.detach(), remainder).view(torch.int32),
                       master.view(torch.int32))


# split8's master has 24 bits: at 1.0 its step is 2^-15, and each update of 1e-4 rounds to three
# of them (8.4 % short); split's is the FP32 master exactly.
@pytest.mark.parametrize("mode,tolerance", [("split", 1e-3), ("split8", 0.1)])
def test_split_tables_keep_updates_far_below_half_an_ulp(device, mode, tolerance):
    """Every row looked up each step with a gradient of -1 rises by LR a step: nearest rounding
    of a bare BF16 table loses every update, the remainders keep them."""
    table = nn.Parameter(torch.ones(ROWS, DIM, device=device, dtype=torch.bfloat16))
    opt = fusedamp.optim.SGD([table], lr=LR, master_weights=mode)
    idx = torch.arange(ROWS, device=device)[None]
    for _ in range(STEPS):
        table.grad = torch.sparse_coo_tensor(
            idx, -torch.ones(ROWS, DIM, device=device, dtype=torch.bfloat16), (ROWS, DIM))
        opt.step()
    assert (table.detach().float() - 1).max() > 0  # the BF16 weights themselves moved
    remainder = opt._table_state[table]["param_remainder"]
    if mode == "split":
        full = combine_reference(table.detach(), remainder)
    else:  # the 24-bit master: weight pattern * 2^16 + remainder * 2^8
        high = table.detach().view(torch.int16).to(torch.int32) << 16
        full = (high + (remainder.to(torch.int32) << 8)).view(torch.float32)
    torch.testing.assert_close((full - 1).mean().item(), LR * STEPS, rtol=tolerance, atol=0)


@pytest.mark.parametrize("mode", ["split", "split8"])
def test_split_state_dict_resumes_bit_for_bit(device, mode):
    full, _ = _run(device, mode, steps=6)
    half, opt = _run(device, mode, steps=3)
    saved = opt.state_dict()
    assert saved["state"][0]["param_remainder"].dtype == {"split": torch.int16,
                                                          "split8": torch.int8}[mode]
    gen = torch.Generator().manual_seed(21)
    torch.randn(ROWS, DIM, generator=gen)
    grads = [sparse_grad(gen, dtype=torch.bfloat16, device=device) for _ in range(6)]
    p = nn.Parameter(half.detach().clone())
    resumed = fusedamp.optim.Adagrad([p], lr=0.05, master_weights=mode)
    resumed.load_state_dict(saved)
    for g in grads[3:]:
        p.grad = g
        resumed.step()
    assert torch.equal(p.detach().view(torch.int16), full.detach().view(torch.int16))

