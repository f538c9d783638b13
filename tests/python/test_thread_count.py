"""The CPU kernels give the same bits whatever torch.get_num_threads() is. A list is cut into
fixed chunks of kChunk elements (cpu/chunked_for_each.h) and a table's lookups into fixed
groups of rows; threads take whole chunks or groups, and every sum across them (the gradient
norm, the telemetry, a row's lookups) is added in chunk order, not in the order threads finish.
Each case runs at one thread and at three (chunks land on other threads, one of them gets two)
and compares every tensor bit for bit: weights, masters, moments, remainders, the loss scale,
the telemetry's norm and amax.

make test runs pytest with one thread per worker (OMP_NUM_THREADS=1), so this file is where the
multi-threaded paths are checked."""
import os
import sys

import pytest
import torch
from torch import nn

import fusedamp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import capability_worker  # noqa: E402
from op_helpers import _bits  # noqa: E402

THREADS = 3


def at_threads(threads, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def assert_same_bits(one, many):
    assert one.keys() == many.keys()
    differing = [k for k in one if not torch.equal(_bits(one[k]), _bits(many[k]))]
    assert not differing, f"other bits at {THREADS} threads than at 1: {differing}"


@pytest.mark.parametrize("case", capability_worker.CASES, ids=[c[0] for c in capability_worker.CASES])
def test_every_optimizer_and_weight_store(case):
    one = at_threads(1, lambda: capability_worker.run_case(*case))
    many = at_threads(THREADS, lambda: capability_worker.run_case(*case))
    assert_same_bits(one, many)


def _clipped_fp16_run():
    # 20 tensors, three of them several chunks long: the gradient norm's sum spans threads.
    gen = torch.Generator().manual_seed(7)
    shapes = [(40000,), (300, 129), (70000,)] + [(k * 37 + 5,) for k in range(17)]
    params = [nn.Parameter((torch.randn(s, generator=gen) * 0.1).half()) for s in shapes]
    opt = fusedamp.optim.AdamW(params, lr=1e-3, weight_decay=0.1, master_weights=True,
                               max_grad_norm=0.5)
    scaler = fusedamp.GradScaler("cpu", init_scale=2.0 ** 12)
    for step in range(4):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 2.0 ** 12).half()
        if step == 2:
            params[2].grad.view(-1)[60000] = float("inf")
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()
    out = {f"param{i}": p.detach().clone() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        out.update({f"param{i}.{k}": v.clone() for k, v in opt.state[p].items()
                    if torch.is_tensor(v)})
    log = scaler.telemetry()
    for key in ("scale", "grad_norm", "amax", "underflow_fraction", "found_inf"):
        out[key] = torch.tensor(log[key], dtype=torch.float64)
    return out


def test_fp16_masters_with_clipping_and_telemetry():
    one = at_threads(1, _clipped_fp16_run)
    many = at_threads(THREADS, _clipped_fp16_run)
    assert one["found_inf"].tolist() == [0, 0, 1, 0]
    assert_same_bits(one, many)


def _sparse_run(cls, kwargs):
    # 6,000 lookups into 2,000 rows (far more than one group of rows per thread), duplicates
    # skewed towards the first rows; an FP16 table with FP32 master rows under the scaler.
    gen = torch.Generator().manual_seed(3)
    rows, dim = 2000, 24
    table = nn.Parameter((torch.randn(rows, dim, generator=gen) * 0.1).half())
    opt = cls([table], lr=0.05, master_weights=True, **kwargs)
    scaler = fusedamp.GradScaler("cpu", init_scale=2.0 ** 10)
    for _ in range(3):
        idx = (torch.rand(6000, generator=gen) ** 2 * rows).long()
        values = (torch.randn(6000, dim, generator=gen) * 2.0 ** 10).half()
        table.grad = torch.sparse_coo_tensor(idx[None], values, (rows, dim))
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()
    out = {"table": table.detach().clone()}
    out.update({k: v.clone() for k, v in opt.state[table].items() if torch.is_tensor(v)})
    log = scaler.telemetry()
    out["grad_norm"] = torch.tensor(log["grad_norm"], dtype=torch.float64)
    return out


@pytest.mark.parametrize("cls,kwargs", [
    (fusedamp.optim.SGD, dict(momentum=0.9)),
    (fusedamp.optim.Adagrad, {}),
    (fusedamp.optim.SparseAdam, {}),
], ids=["sgd_momentum", "adagrad", "sparse_adam"])
def test_sparse_tables(cls, kwargs):
    one = at_threads(1, lambda: _sparse_run(cls, kwargs))
    many = at_threads(THREADS, lambda: _sparse_run(cls, kwargs))
    assert_same_bits(one, many)
