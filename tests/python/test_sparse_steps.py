"""Sparse embedding gradients through fusedamp's row-wise steps: trajectories against torch's
SGD / Adagrad / SparseAdam and a plain FP64 row-wise Adagrad, FP16 tables with FP32 master rows,
skipped steps under loss scaling, state dicts to and from torch, the same bits on every
instruction set."""
import copy

import pytest
import torch
import torch.nn as nn

import fusedamp
from sparse_helpers import (ALGORITHMS, DIM, ROWS, SPARSE_OPTIMIZERS, sparse_grad,
                            step_side_by_side, table)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_trajectory_matches_torch(device, name):
    ours_cls, torch_cls, kwargs = ALGORITHMS[name]
    gen = torch.Generator().manual_seed(0)
    a = table(gen, device=device)
    b = nn.Parameter(a.detach().clone())
    step_side_by_side(gen, [(a, ours_cls([a], **kwargs)), (b, torch_cls([b], **kwargs))], 12)
    # Within FP32 rounding, not bit for bit: torch adds a row's duplicate lookups (and SGD's
    # momentum entries) to the table one at a time where fusedamp sums them first, and torch's
    # vectorised sqrt is not correctly rounded (Sleef's 0.5-ulp one: 0.7 % of 10^6 floats one
    # ulp off numpy's on this Xeon) where fusedamp's is.
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5)


def test_sgd_without_duplicates_is_bit_exact():
    """Nothing to sum and no sqrt: each lookup's row moves by one FMA, as torch's CPU axpy does
    (torch's CUDA sparse add is another kernel, compared within rounding above)."""
    gen = torch.Generator().manual_seed(14)
    a = table(gen)
    b = nn.Parameter(a.detach().clone())
    ours, ref = fusedamp.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)
    for _ in range(5):
        rows = torch.randperm(ROWS, generator=gen)[:30]
        g = torch.sparse_coo_tensor(rows[None], torch.randn(30, DIM, generator=gen), (ROWS, DIM))
        for p, opt in ((a, ours), (b, ref)):
            p.grad = g.clone()
            opt.step()
    assert torch.equal(a.detach(), b.detach())


def rowwise_adagrad_fp64(w, acc, grads, lr, eps):
    """Row-wise Adagrad in FP64, from its definition: per row looked up, the mean of its
    summed squared gradient added to the row's accumulator, then the row's step."""
    w, acc = w.double().clone(), acc.double().clone()
    for g in grads:
        g = g.coalesce().double()
        rows, values = g.indices()[0], g.values()
        acc[rows] += (values * values).mean(dim=1)
        w[rows] -= lr / (acc[rows].sqrt() + eps)[:, None] * values
    return w, acc


def test_rowwise_adagrad_matches_fp64_reference(device):
    gen = torch.Generator().manual_seed(1)
    p = table(gen, device=device)
    w0 = p.detach().cpu().clone()
    opt = fusedamp.optim.RowWiseAdagrad([p], lr=0.05, eps=1e-8)
    grads = [sparse_grad(gen) for _ in range(10)]
    for g in grads:
        p.grad = g.clone().to(device)
        opt.step()
    w, acc = rowwise_adagrad_fp64(w0, torch.zeros(ROWS), grads, 0.05, 1e-8)
    assert opt.state[p]["sum"].shape == (ROWS,)  # 4 bytes per row
    torch.testing.assert_close(opt.state[p]["sum"].cpu().double(), acc, rtol=1e-6, atol=0)
    torch.testing.assert_close(p.detach().cpu().double(), w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", SPARSE_OPTIMIZERS)
def test_masters_track_fp32_on_rare_rows(device, name, dtype):
    """Small updates of rarely looked-up rows (below half an ulp of the weights): the FP32
    masters of an FP16/BF16 table follow the FP32 run, the table stepped in its own dtype loses
    them."""
    cls, kwargs = SPARSE_OPTIMIZERS[name]
    kwargs = dict(kwargs, lr=kwargs["lr"] * 0.01)
    gen = torch.Generator().manual_seed(2)
    rows = 1000
    # ulp(4): 2^-8 in FP16, 2^-5 in BF16. All three start from the same low-precision values.
    w = (torch.randn(rows, DIM, generator=gen) + 4.0).to(dtype).float()
    runs = {"fp32": (w.clone(), True), "masters": (w.to(dtype), True), "own": (w.to(dtype), False)}
    runs = {k: (t.to(device), mode) for k, (t, mode) in runs.items()}
    params = {k: nn.Parameter(t) for k, (t, _) in runs.items()}
    opts = {k: cls([params[k]], master_weights=runs[k][1], **kwargs) for k in runs}
    counts = torch.zeros(rows, dtype=torch.long)
    for _ in range(40):
        idx = (torch.rand(256, generator=gen) ** 4 * rows).long()  # Zipf-like skew
        counts += torch.bincount(idx, minlength=rows)
        g = torch.sparse_coo_tensor(idx[None], torch.randn(256, DIM, generator=gen),
                                    (rows, DIM), device=device)
        for k, p in params.items():
            p.grad = g.to(p.dtype)
            opts[k].step()
    rare = (counts > 0) & (counts <= 3)
    assert rare.sum() > 50
    ref = params["fp32"].detach().cpu()
    master = opts["masters"].state[params["masters"]]["master_param"].cpu()
    assert torch.equal(params["masters"].detach().cpu(), master.to(dtype))  # its rounding
    err_masters = (master - ref)[rare].abs().mean()
    err_own = (params["own"].detach().cpu().float() - ref)[rare].abs().mean()
    assert err_masters < 0.1 * err_own, (err_masters, err_own)


@pytest.mark.parametrize("name", SPARSE_OPTIMIZERS)
def test_overflow_skips_step_and_backs_off(device, name):
    cls, kwargs = SPARSE_OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(3)
    p = table(gen, torch.float16, device)
    opt = cls([p], **kwargs)
    scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 10)
    # The iteration's scale(): these gradients stand for its backward.
    scaler.scale(torch.ones((), device=device))
    p.grad = sparse_grad(gen, dtype=torch.float16, device=device)
    scaler.step(opt)  # a finite first step: the state exists and has moved
    scaler.update()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    weights = p.detach().clone()
    g = sparse_grad(gen, dtype=torch.float16, device=device)
    g._values()[3, 5] = float("inf")
    p.grad = g
    scaler.scale(torch.ones((), device=device))
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach(), weights)
    for k, v in opt.state[p].items():
        assert torch.equal(v, before[k]), k
    assert scaler.get_scale() == 2.0 ** 9


def test_fp16_duplicates_summed_in_fp32(device):
    """Each lookup's scaled FP16 gradient is finite, their sum is not in FP16: the step is
    applied (summed in FP32), where coalescing in FP16 would have skipped it."""
    p = nn.Parameter(torch.zeros(4, DIM, dtype=torch.float16, device=device))
    opt = fusedamp.optim.Adagrad([p], lr=0.1)
    scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 15)
    values = torch.full((3, DIM), 40000.0, dtype=torch.float16)  # 3 x 40000 > 65504
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1, 1, 1]]), values, (4, DIM), device=device)
    scaler.scale(torch.ones((), device=device))
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 15
    assert opt.state[p]["step"].item() == 1
    assert (p.detach()[1] < 0).all() and (p.detach()[[0, 2, 3]] == 0).all()


@pytest.mark.parametrize("name", ["adagrad", "sparse_adam"])
def test_state_dict_from_and_to_torch(device, name):
    ours_cls, torch_cls, kwargs = ALGORITHMS[name]
    gen = torch.Generator().manual_seed(4)
    a = table(gen, device=device)
    b = nn.Parameter(a.detach().clone())
    ref = torch_cls([b], **kwargs)
    for _ in range(3):
        b.grad = sparse_grad(gen, device=device)
        ref.step()
    a.data.copy_(b.detach())
    ours = ours_cls([a], **kwargs)
    ours.load_state_dict(ref.state_dict())
    c = nn.Parameter(a.detach().clone())
    back = torch_cls([c], **kwargs)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))  # torch keeps the tensors it is given
    step_side_by_side(gen, [(a, ours), (b, ref), (c, back)], 3)
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c.detach(), b.detach(), rtol=1e-5, atol=1e-5)


# Inputs from numpy: torch's own random numbers differ between instruction sets.
_SAME_BITS_WORKER = """
import hashlib, itertools, numpy as np, torch, fusedamp
out = []
for (name, (cls, kwargs)), d in itertools.product({names}.items(), (37, 20)):
    rng = np.random.default_rng(12)
    p = torch.nn.Parameter(torch.from_numpy(rng.standard_normal((300, d), np.float32))
                           .to(torch.bfloat16))
    opt = getattr(fusedamp.optim, cls)([p], **kwargs)
    scaler = fusedamp.GradScaler("cpu", init_scale=3.0)  # an inexact inverse: rounding
    for _ in range(3):
        idx = torch.from_numpy((rng.random(500) ** 2 * 300).astype(np.int64))
        values = torch.from_numpy(rng.standard_normal((500, d), np.float32))
        p.grad = torch.sparse_coo_tensor(idx[None], values, (300, d)).to(torch.bfloat16)
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()
    norms = torch.tensor(scaler.telemetry()["grad_norm"], dtype=torch.float64)
    state = [p.detach(), p.grad._values(), norms] + [v for v in opt.state[p].values()]
    out.append(hashlib.sha256(b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes()
                                       for t in state)).hexdigest())
print(",".join(out))
"""


def test_same_bits_on_every_instruction_set():
    """The row loops in vectors of 8 (DEFAULT, AVX2) or 16 (AVX-512) lanes, rows of 37 (read
    row by row, with a tail) and of 20 (read flat for the statistics), under a loss scale of 3
    (the unscale rounds, in the pass that sums the rows), BF16 tables with masters, split8
    remainders or stochastic rounding: the same bits (weights, state, the unscaled gradient,
    the gradient norm the telemetry reports), FMAs written out and contraction off. The
    machine's best instruction set runs here, each lesser one in a subprocess
    (ATEN_CPU_CAPABILITY)."""
    import contextlib
    import io
    import os
    import subprocess
    import sys

    names = {k: (cls.__name__, kw) for k, (cls, kw) in SPARSE_OPTIMIZERS.items()}
    names["adagrad_stochastic"] = ("Adagrad", dict(lr=0.1, master_weights="stochastic",
                                                   rounding_seed=5))
    names["sparse_adam_split8"] = ("SparseAdam", dict(lr=0.01, master_weights="split8"))
    script = _SAME_BITS_WORKER.format(names=repr(names))
    python = os.path.join(os.path.dirname(__file__), "..", "..", "python")
    best = fusedamp._C.cpu_capability()
    lesser = {"AVX2": ["default"], "AVX512": ["default", "avx2"]}.get(best, [])
    if not lesser:
        pytest.skip(f"no other instruction set than {best} is built here")
    here = io.StringIO()
    with contextlib.redirect_stdout(here):
        exec(script, {})
    bits = {best.lower(): here.getvalue().split()[-1]}
    for cap in lesser:
        env = dict(os.environ, ATEN_CPU_CAPABILITY=cap, PYTHONPATH=python)
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        bits[cap] = run.stdout.split()[-1]
    assert len(set(bits.values())) == 1, bits
