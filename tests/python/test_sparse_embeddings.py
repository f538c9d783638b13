"""Sparse embedding gradients through fusedamp's row-wise steps: trajectories against torch's
SGD / Adagrad / SparseAdam and a plain FP64 row-wise Adagrad, FP16 tables with FP32 master rows,
skipped steps under loss scaling, state dicts to and from torch, and bad input."""
import copy

import pytest
import torch
import torch.nn as nn

import fusedamp

ROWS, DIM = 50, 20  # DIM: two full vector pairs and a tail on AVX-512 and AVX2

# Each algorithm: fusedamp's optimizer and torch's, with the same arguments.
ALGORITHMS = {
    "sgd": (fusedamp.optim.SGD, torch.optim.SGD, dict(lr=0.1)),
    "sgd_momentum": (fusedamp.optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9,
                                                              dampening=0.1)),
    "sgd_nesterov": (fusedamp.optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9,
                                                              nesterov=True)),
    "adagrad": (fusedamp.optim.Adagrad, torch.optim.Adagrad,
                dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)),
    "sparse_adam": (fusedamp.optim.SparseAdam, torch.optim.SparseAdam,
                    dict(lr=0.01, betas=(0.8, 0.99))),
    "sparse_adam_maximize": (fusedamp.optim.SparseAdam, torch.optim.SparseAdam,
                             dict(lr=0.01, maximize=True)),
}
# Everything fusedamp steps sparse tables with (the row-wise one has no torch twin).
SPARSE_OPTIMIZERS = {
    "sgd_momentum": (fusedamp.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "adagrad": (fusedamp.optim.Adagrad, dict(lr=0.1)),
    "sparse_adam": (fusedamp.optim.SparseAdam, dict(lr=0.01)),
    "rowwise_adagrad": (fusedamp.optim.RowWiseAdagrad, dict(lr=0.1)),
}


@pytest.fixture
def sparse_device(device):
    if device != "cpu":
        pytest.skip("the sparse row steps have CPU kernels only")
    return device


def sparse_grad(gen, rows=ROWS, dim=DIM, nnz=60, dtype=torch.float32, device="cpu",
                scale=1.0):
    """An uncoalesced row-wise gradient as nn.Embedding(sparse=True) gives: duplicates
    included (60 lookups into 50 rows, skewed towards the first rows)."""
    idx = (torch.rand(nnz, generator=gen) ** 2 * rows).long()
    values = torch.randn(nnz, dim, generator=gen) * scale
    return torch.sparse_coo_tensor(idx[None], values.to(dtype), (rows, dim),
                                   device=device)


def table(gen, dtype=torch.float32, device="cpu"):
    return nn.Parameter(torch.randn(ROWS, DIM, generator=gen).to(device=device, dtype=dtype))


def step_side_by_side(gen, pairs, steps):
    """The same sparse gradients, `steps` times, into each (parameter, optimizer) pair."""
    for _ in range(steps):
        g = sparse_grad(gen)
        for p, opt in pairs:
            p.grad = g.clone()
            opt.step()


@pytest.mark.parametrize("name", ALGORITHMS)
def test_trajectory_matches_torch(sparse_device, name):
    ours_cls, torch_cls, kwargs = ALGORITHMS[name]
    gen = torch.Generator().manual_seed(0)
    a = table(gen)
    b = nn.Parameter(a.detach().clone())
    step_side_by_side(gen, [(a, ours_cls([a], **kwargs)), (b, torch_cls([b], **kwargs))], 12)
    # Within FP32 rounding, not bit for bit: torch adds a row's duplicate lookups (and SGD's
    # momentum entries) to the table one at a time where fusedamp sums them first, and torch's
    # vectorised sqrt is not correctly rounded (Sleef's 0.5-ulp one: 0.7 % of 10^6 floats one
    # ulp off numpy's on this Xeon) where fusedamp's is.
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5)


def test_sgd_without_duplicates_is_bit_exact(sparse_device):
    """Nothing to sum and no sqrt: each lookup's row moves by one FMA, as torch's axpy does."""
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


def test_rowwise_adagrad_matches_fp64_reference(sparse_device):
    gen = torch.Generator().manual_seed(1)
    p = table(gen)
    w0 = p.detach().clone()
    opt = fusedamp.optim.RowWiseAdagrad([p], lr=0.05, eps=1e-8)
    grads = [sparse_grad(gen) for _ in range(10)]
    for g in grads:
        p.grad = g.clone()
        opt.step()
    w, acc = rowwise_adagrad_fp64(w0, torch.zeros(ROWS), grads, 0.05, 1e-8)
    assert opt.state[p]["sum"].shape == (ROWS,)  # 4 bytes per row
    torch.testing.assert_close(opt.state[p]["sum"].double(), acc, rtol=1e-6, atol=0)
    torch.testing.assert_close(p.detach().double(), w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", SPARSE_OPTIMIZERS)
def test_masters_track_fp32_on_rare_rows(sparse_device, name, dtype):
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
    params = {k: nn.Parameter(t) for k, (t, _) in runs.items()}
    opts = {k: cls([params[k]], master_weights=runs[k][1], **kwargs) for k in runs}
    counts = torch.zeros(rows, dtype=torch.long)
    for _ in range(40):
        idx = (torch.rand(256, generator=gen) ** 4 * rows).long()  # Zipf-like skew
        counts += torch.bincount(idx, minlength=rows)
        g = torch.sparse_coo_tensor(idx[None], torch.randn(256, DIM, generator=gen),
                                    (rows, DIM))
        for k, p in params.items():
            p.grad = g.to(p.dtype)
            opts[k].step()
    rare = (counts > 0) & (counts <= 3)
    assert rare.sum() > 50
    ref = params["fp32"].detach()
    master = opts["masters"].state[params["masters"]]["master_param"]
    assert torch.equal(params["masters"].detach(), master.to(dtype))  # the table: its rounding
    err_masters = (master - ref)[rare].abs().mean()
    err_own = (params["own"].detach().float() - ref)[rare].abs().mean()
    assert err_masters < 0.1 * err_own, (err_masters, err_own)


@pytest.mark.parametrize("name", SPARSE_OPTIMIZERS)
def test_overflow_skips_step_and_backs_off(sparse_device, name):
    cls, kwargs = SPARSE_OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(3)
    p = table(gen, torch.float16)
    opt = cls([p], **kwargs)
    scaler = fusedamp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(torch.ones(()))  # the iteration's scale(): these gradients stand for its backward
    p.grad = sparse_grad(gen, dtype=torch.float16)
    scaler.step(opt)  # a finite first step: the state exists and has moved
    scaler.update()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    weights = p.detach().clone()
    g = sparse_grad(gen, dtype=torch.float16)
    g._values()[3, 5] = float("inf")
    p.grad = g
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach(), weights)
    for k, v in opt.state[p].items():
        assert torch.equal(v, before[k]), k
    assert scaler.get_scale() == 2.0 ** 9


def test_fp16_duplicates_summed_in_fp32(sparse_device):
    """Each lookup's scaled FP16 gradient is finite, their sum is not in FP16: the step is
    applied (summed in FP32), where coalescing in FP16 would have skipped it."""
    p = nn.Parameter(torch.zeros(4, DIM, dtype=torch.float16))
    opt = fusedamp.optim.Adagrad([p], lr=0.1)
    scaler = fusedamp.GradScaler("cpu", init_scale=2.0 ** 15)
    values = torch.full((3, DIM), 40000.0, dtype=torch.float16)  # 3 x 40000 > 65504
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1, 1, 1]]), values, (4, DIM))
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 15
    assert opt.state[p]["step"].item() == 1
    assert (p.detach()[1] < 0).all() and (p.detach()[[0, 2, 3]] == 0).all()


@pytest.mark.parametrize("name", ["adagrad", "sparse_adam"])
def test_state_dict_from_and_to_torch(sparse_device, name):
    ours_cls, torch_cls, kwargs = ALGORITHMS[name]
    gen = torch.Generator().manual_seed(4)
    a = table(gen)
    b = nn.Parameter(a.detach().clone())
    ref = torch_cls([b], **kwargs)
    for _ in range(3):
        b.grad = sparse_grad(gen)
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


# ---- bad input: a clear error, nothing modified ----------------------------------------------
def snapshot(p, opt):
    return [p.detach().clone()] + [v.clone() for v in opt.state[p].values()
                                   if isinstance(v, torch.Tensor)]


def unchanged(p, opt, snap):
    now = snapshot(p, opt)
    return len(now) == len(snap) and all(torch.equal(x, y) for x, y in zip(now, snap))


def test_adamw_refuses_sparse_grads(sparse_device):
    gen = torch.Generator().manual_seed(5)
    p = table(gen)
    opt = fusedamp.optim.AdamW([p])
    p.grad = sparse_grad(gen)
    w = p.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(p.detach(), w)


@pytest.mark.parametrize("name", SPARSE_OPTIMIZERS)
@pytest.mark.parametrize("bad", ["out_of_range", "hybrid", "fully_sparse", "dense_then_sparse"])
def test_bad_grads_modify_nothing(sparse_device, name, bad):
    cls, kwargs = SPARSE_OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(6)
    good, p = table(gen), table(gen)
    opt = cls([good, p], **kwargs)
    good.grad, p.grad = sparse_grad(gen), sparse_grad(gen)
    opt.step()
    good.grad = sparse_grad(gen)  # a valid gradient beside the bad one: not stepped either
    if bad == "out_of_range":
        p.grad = sparse_grad(gen)
        p.grad._indices()[0, -1] = ROWS  # past the last row, as a hand-made gradient can be
        match = "out of range"
    elif bad == "hybrid":  # sparse rows of a 3-D parameter: two dense dimensions
        p = nn.Parameter(torch.randn(ROWS, 4, 5))
        opt.add_param_group({"params": [p]})
        p.grad = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2, 4, 5),
                                         (ROWS, 4, 5))
        match = "row-wise"
    elif bad == "fully_sparse":
        p.grad = torch.randn(ROWS, DIM).to_sparse()  # sparse_dim 2: not row-wise
        match = "row-wise"
    else:
        p.grad = torch.randn(ROWS, DIM)
        match = "sparse"
    snaps = [snapshot(q, opt) for q in (good, p)]
    with pytest.raises(RuntimeError, match=match):
        opt.step()
    assert all(unchanged(q, opt, s) for q, s in zip((good, p), snaps))


def test_adagrad_refuses_weight_decay():
    with pytest.raises(ValueError, match="weight_decay"):
        fusedamp.optim.Adagrad([nn.Parameter(torch.zeros(2, 2))], weight_decay=0.1)


def test_op_refuses_bad_arguments_before_writing(sparse_device):
    gen = torch.Generator().manual_seed(7)
    t = torch.randn(ROWS, DIM, generator=gen)
    s = torch.zeros(ROWS, DIM)
    step = torch.zeros(())
    g = sparse_grad(gen)
    idx, vals = g._indices().clone(), g._values()
    idx[0, 7] = -1
    before = t.clone()
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.fusedamp.sparse_adagrad_step_(t, None, idx, vals, s, step, lr=0.1)
    with pytest.raises(RuntimeError, match="values must be"):
        torch.ops.fusedamp.sparse_adagrad_step_(t, None, g._indices(), vals[:, :3], s, step,
                                                lr=0.1)
    with pytest.raises(RuntimeError, match="state"):
        torch.ops.fusedamp.sparse_adagrad_step_(t, None, g._indices(), vals, s[:, :3], step,
                                                lr=0.1)
    assert torch.equal(t, before) and not s.any() and step.item() == 0


@pytest.mark.parametrize("op,state", [
    ("sparse_sgd_step_", 1), ("sparse_adagrad_step_", 1), ("sparse_adam_step_", 2),
    ("sparse_rowwise_adagrad_step_", 1)])
def test_opcheck(sparse_device, op, state):
    gen = torch.Generator().manual_seed(8)
    g = sparse_grad(gen, dtype=torch.float16)
    t = torch.randn(ROWS, DIM, generator=gen).half()
    shape = (ROWS,) if "rowwise" in op else (ROWS, DIM)
    states = [torch.zeros(shape) for _ in range(state)]
    kwargs = {"sparse_sgd_step_": dict(lr=0.1, momentum=0.9),
              "sparse_adagrad_step_": dict(lr=0.1),
              "sparse_adam_step_": dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8),
              "sparse_rowwise_adagrad_step_": dict(lr=0.1)}[op]
    args = (t, t.float(), g._indices(), g._values(), *states, torch.zeros(()))
    torch.library.opcheck(getattr(torch.ops.fusedamp, op), args,
                          dict(kwargs, inv_scale=torch.full((), 0.5),
                               found_inf=torch.zeros(())))


class TablesAndHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids, offsets):
        return self.head(self.bag(ids, offsets)).sum()


def bag_batch(gen):
    ids = (torch.rand(48, generator=gen) ** 2 * ROWS).long()
    return ids, torch.arange(0, 48, 6)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_steps_tables_beside_dense_params(sparse_device, momentum):
    """fusedamp.optim.SGD over a table (sparse gradient) and a dense layer, against torch.optim.SGD
    on the same model; its state dict loads into torch's and back."""
    torch.manual_seed(0)
    ours_model = TablesAndHead()
    ref_model = TablesAndHead()
    ref_model.load_state_dict(ours_model.state_dict())
    ours = fusedamp.optim.SGD(ours_model.parameters(), lr=0.05, momentum=momentum)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=momentum)
    gen = torch.Generator().manual_seed(9)
    for i in range(6):
        batch = bag_batch(gen)
        for model, opt in ((ours_model, ours), (ref_model, ref)):
            opt.zero_grad()
            model(*batch).backward()
            opt.step()
        if i == 2:  # a checkpoint round trip half-way
            ours.load_state_dict(ours.state_dict())
    for a, b in zip(ours_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5)
    if momentum:
        assert not ours.state[ours_model.bag.weight]["momentum_buffer"].is_sparse
        resumed = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=momentum)
        resumed.load_state_dict(copy.deepcopy(ours.state_dict()))


def test_sgd_skip_covers_tables_and_dense_params(sparse_device):
    torch.manual_seed(0)
    model = TablesAndHead()
    opt = fusedamp.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = fusedamp.GradScaler("cpu", init_scale=2.0 ** 8)
    gen = torch.Generator().manual_seed(10)
    scaler.scale(model(*bag_batch(gen))).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    scaler.scale(model(*bag_batch(gen))).backward()
    model.bag.weight.grad._values()[0, 0] = float("nan")  # only the table's gradient
    weights = [p.detach().clone() for p in model.parameters()]
    buffers = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(opt.state[p]["momentum_buffer"], b)
               for p, b in zip(model.parameters(), buffers))
    assert scaler.get_scale() == 2.0 ** 7


@pytest.mark.parametrize("name", SPARSE_OPTIMIZERS)
def test_unscale_before_step_steps_the_same(sparse_device, name):
    """scaler.unscale_(opt) (as before manual clipping), then scaler.step(opt): the step takes
    the unscaled gradients as they are, the same step as scaler.step(opt) alone."""
    cls, kwargs = SPARSE_OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(11)
    a = table(gen)
    b = nn.Parameter(a.detach().clone())
    runs = [(a, cls([a], **kwargs), fusedamp.GradScaler("cpu", init_scale=2.0 ** 12), True),
            (b, cls([b], **kwargs), fusedamp.GradScaler("cpu", init_scale=2.0 ** 12), False)]
    for _ in range(3):
        g = sparse_grad(gen, scale=2.0 ** 12)
        for p, opt, scaler, unscale_first in runs:
            scaler.scale(torch.ones(()))
            p.grad = g.clone()
            if unscale_first:
                scaler.unscale_(opt)
                torch.testing.assert_close(p.grad.to_dense(), g.to_dense() / 2.0 ** 12)
            scaler.step(opt)
            scaler.update()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


# Inputs from numpy: torch's own random numbers differ between instruction sets.
_SAME_BITS_WORKER = """
import hashlib, numpy as np, torch, fusedamp
out = []
for name, (cls, kwargs) in {names}.items():
    rng = np.random.default_rng(12)
    p = torch.nn.Parameter(torch.from_numpy(rng.standard_normal((300, 37), np.float32))
                           .to(torch.bfloat16))
    opt = getattr(fusedamp.optim, cls)([p], **kwargs)
    for _ in range(3):
        idx = torch.from_numpy((rng.random(500) ** 2 * 300).astype(np.int64))
        values = torch.from_numpy(rng.standard_normal((500, 37), np.float32))
        p.grad = torch.sparse_coo_tensor(idx[None], values, (300, 37)).to(torch.bfloat16)
        opt.step()
    state = [p.detach()] + [v for v in opt.state[p].values()]
    out.append(hashlib.sha256(b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes()
                                       for t in state)).hexdigest())
print(",".join(out))
"""


def test_same_bits_on_every_instruction_set(sparse_device):
    """The row loops in vectors of 4 (DEFAULT), 8 (AVX2) or 16 (AVX-512) lanes, and a row of 37
    with its tail: the same bits, FMAs written out and contraction off."""
    import os
    import subprocess
    import sys

    names = {k: (cls.__name__, kw) for k, (cls, kw) in SPARSE_OPTIMIZERS.items()}
    script = _SAME_BITS_WORKER.format(names=repr(names))
    python = os.path.join(os.path.dirname(__file__), "..", "..", "python")
    bits = {}
    for cap in ("default", "avx2", "avx512"):
        env = dict(os.environ, ATEN_CPU_CAPABILITY=cap, PYTHONPATH=python)
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        bits[cap] = run.stdout.split()[-1]
    assert bits["default"] == bits["avx2"] == bits["avx512"], bits


def test_initialize_with_sgd_gives_tables_master_rows(sparse_device):
    torch.manual_seed(0)
    model = TablesAndHead()
    model, opt, scaler = fusedamp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), dtype=torch.float16)
    gen = torch.Generator().manual_seed(13)
    start = model.bag.weight.detach().clone()
    for _ in range(10):  # the first few overflow the head's FP16 gradient at 2^16 and skip
        opt.zero_grad()
        scaler.scale(model(*bag_batch(gen))).backward()
        scaler.step(opt)
        scaler.update()
    state = opt.state[model.bag.weight]
    assert model.bag.weight.dtype == torch.float16 and state["master_param"].dtype == torch.float32
    assert torch.equal(model.bag.weight.detach(), state["master_param"].half())
    assert state["step"].item() >= 1 and not torch.equal(model.bag.weight.detach(), start)
