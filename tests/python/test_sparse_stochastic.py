"""master_weights="stochastic" for embedding tables: a bfloat16 table with no master, each
step's FP32 result rounded to BF16 up or down at random (math/stochastic_rounding_math.h), the
bits a function of (the table's seed, its step count, the element's index in the table)."""
import pytest
import torch
import torch.nn as nn

import fusedamp
from sparse_helpers import DIM, ROWS, sparse_grad

LR, STEPS = 1e-4, 120  # each update ~1/78 of a BF16 ulp at 1.0: rounding to nearest stalls


def _constant_steps(device, mode, steps=STEPS):
    """Every row looked up once a step with a gradient of -1: each row should rise by LR."""
    table = nn.Parameter(torch.ones(ROWS, DIM, device=device, dtype=torch.bfloat16))
    opt = fusedamp.optim.SGD([table], lr=LR, master_weights=mode, rounding_seed=3)
    idx = torch.arange(ROWS, device=device)[None]
    for _ in range(steps):
        table.grad = torch.sparse_coo_tensor(
            idx, -torch.ones(ROWS, DIM, device=device, dtype=torch.bfloat16), (ROWS, DIM))
        opt.step()
    return table.detach().float(), opt


def test_stochastic_rounding_moves_a_table_that_rounding_to_nearest_leaves(device):
    nearest, _ = _constant_steps(device, False)
    assert torch.equal(nearest, torch.ones_like(nearest))  # every update lost
    stochastic, opt = _constant_steps(device, "stochastic")
    assert "master_param" not in opt._table_state[opt.param_groups[0]["params"][0]]
    rise = (stochastic - 1).mean().item()
    assert abs(rise - LR * STEPS) < 0.1 * LR * STEPS  # unbiased: the expected rise, within 10 %
    assert len(stochastic.unique()) > 1  # elements drew their own bits


def test_stochastic_bits_depend_on_seed_step_and_element_only(device):
    """Two runs agree; a run resumed from a state dict continues bit for bit; another seed
    draws other bits."""
    def run(steps, seed, resume_from=None):
        gen = torch.Generator().manual_seed(9)
        w = torch.randn(ROWS, DIM, generator=gen).to(device=device, dtype=torch.bfloat16)
        p = nn.Parameter(w)
        opt = fusedamp.optim.Adagrad([p], lr=0.05, master_weights="stochastic",
                                     rounding_seed=seed)
        grads = [sparse_grad(gen, dtype=torch.bfloat16, device=device) for _ in range(6)]
        start = 0
        if resume_from is not None:
            table, saved, start = resume_from
            p.data.copy_(table)
            opt.load_state_dict(saved)
        for g in grads[start:steps]:
            p.grad = g
            opt.step()
        return p.detach().clone(), opt

    full, _ = run(6, 11)
    again, _ = run(6, 11)
    assert torch.equal(full.view(torch.int16), again.view(torch.int16))
    half, opt = run(3, 11)
    resumed, _ = run(6, 11, (half, opt.state_dict(), 3))
    assert torch.equal(full.view(torch.int16), resumed.view(torch.int16))
    other, _ = run(6, 12)
    assert not torch.equal(full.view(torch.int16), other.view(torch.int16))


def test_op_refuses_a_seed_with_a_master_or_another_dtype(device):
    table = torch.zeros(ROWS, DIM, device=device, dtype=torch.bfloat16)
    idx = torch.zeros(1, 2, dtype=torch.long, device=device)
    values = torch.ones(2, DIM, device=device)
    step = torch.zeros((), device=device)
    op = torch.ops.fusedamp.sparse_sgd_step_
    for t, master, message in [(table, table.float(), "without a master"),
                               (table.half(), None, "bfloat16 table")]:
        with pytest.raises(RuntimeError, match=message):
            op(t, master, idx, values, None, step, lr=0.1, rounding_seed=1)
        assert step.item() == 0 and not t.any()
    # A table's seed is any 64 bits (derived from its group's seed and its index).
    op(table, None, idx, values, None, step, lr=0.1, rounding_seed=-(2 ** 63))
    assert step.item() == 1 and table.any()


def test_every_group_seed_steps(device):
    """The seeds the engine derives for tables are any 64 bits, negative ones included: the
    default seed 0 and others step a table."""
    for seed in range(8):
        p = nn.Parameter(torch.ones(ROWS, DIM, device=device, dtype=torch.bfloat16))
        opt = fusedamp.optim.Adagrad([p], lr=0.1, master_weights="stochastic",
                                     rounding_seed=seed)
        p.grad = sparse_grad(torch.Generator().manual_seed(seed), dtype=torch.bfloat16,
                             device=device)
        opt.step()
        assert opt.state[p]["step"].item() == 1 and not torch.equal(p.detach(),
                                                                    torch.ones_like(p))
