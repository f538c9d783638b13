"""Sparse embedding tables beside dense parameters (one skip for both, unscale_ before step,
fusedamp.initialize) and bad input to the sparse steps: a clear error, nothing modified."""
import copy

import pytest
import torch
import torch.nn as nn

import fusedamp
from sparse_helpers import (DIM, ROWS, SPARSE_OPTIMIZERS, TablesAndHead, bag_batch, snapshot,
                            sparse_grad, table, unchanged)


# ---- bad input: a clear error, nothing modified ----------------------------------------------


def test_adamw_refuses_sparse_grads(device):
    gen = torch.Generator().manual_seed(5)
    p = table(gen, device=device)
    opt = fusedamp.optim.AdamW([p])
    p.grad = sparse_grad(gen, device=device)
    w = p.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(p.detach(), w)


@pytest.mark.parametrize("name", SPARSE_OPTIMIZERS)
@pytest.mark.parametrize("bad", ["out_of_range", "hybrid", "fully_sparse", "dense_then_sparse"])
def test_bad_grads_modify_nothing(device, name, bad):
    if bad == "out_of_range" and device != "cpu":
        pytest.skip("on CUDA an index out of range is a device-side assert, "
                    "test_sparse_cuda.py::test_out_of_range_index_is_a_device_assert")
    cls, kwargs = SPARSE_OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(6)
    good, p = table(gen, device=device), table(gen, device=device)
    opt = cls([good, p], **kwargs)
    good.grad, p.grad = sparse_grad(gen, device=device), sparse_grad(gen, device=device)
    opt.step()
    # A valid gradient beside the bad one: not stepped either.
    good.grad = sparse_grad(gen, device=device)
    if bad == "out_of_range":
        p.grad = sparse_grad(gen, device=device)
        p.grad._indices()[0, -1] = ROWS  # past the last row, as a hand-made gradient can be
        match = "out of range"
    elif bad == "hybrid":  # sparse rows of a 3-D parameter: two dense dimensions
        p = nn.Parameter(torch.randn(ROWS, 4, 5, device=device))
        opt.add_param_group({"params": [p]})
        p.grad = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.ones(2, 4, 5),
                                         (ROWS, 4, 5), device=device)
        match = "row-wise"
    elif bad == "fully_sparse":
        # sparse_dim 2: not row-wise
        p.grad = torch.randn(ROWS, DIM, device=device).to_sparse()
        match = "row-wise"
    else:
        p.grad = torch.randn(ROWS, DIM, device=device)
        match = "sparse"
    snaps = [snapshot(q, opt) for q in (good, p)]
    with pytest.raises(RuntimeError, match=match):
        opt.step()
    assert all(unchanged(q, opt, s) for q, s in zip((good, p), snaps))


@pytest.mark.parametrize("mode,message", [
    ("stochastic", "stochastic.*bfloat16.*torch.float16"),
    ("split", "int16/int8 .a bfloat16 table's split remainders")])
def test_bf16_only_modes_refuse_an_fp16_table_before_anything_is_written(device, mode, message):
    gen = torch.Generator().manual_seed(10)
    bf16 = table(gen, torch.bfloat16, device)
    fp16 = table(gen, torch.float16, device)
    opt = fusedamp.optim.SparseAdam([bf16, fp16], lr=0.01, master_weights=mode)
    bf16.grad = sparse_grad(gen, dtype=torch.bfloat16, device=device)
    fp16.grad = sparse_grad(gen, dtype=torch.float16, device=device)
    before = bf16.detach().clone()
    with pytest.raises(RuntimeError, match=message):
        opt.step()
    assert torch.equal(bf16.detach(), before) and not opt.state.get(bf16)


def test_adagrad_refuses_weight_decay():
    with pytest.raises(ValueError, match="weight_decay"):
        fusedamp.optim.Adagrad([nn.Parameter(torch.zeros(2, 2))], weight_decay=0.1)


def test_sgd_refuses_a_storage_mode_tables_do_not_have(device):
    gen = torch.Generator().manual_seed(8)
    p = table(gen, torch.bfloat16, device)
    opt = fusedamp.optim.SGD([p], lr=0.1, momentum=0.9, master_weights="kahan")
    p.grad = sparse_grad(gen, dtype=torch.bfloat16, device=device)
    before = p.detach().clone()
    with pytest.raises(ValueError, match='master_weights="kahan" is not supported for sparse'):
        opt.step()
    assert torch.equal(p.detach(), before) and not opt.state[p]


def test_sgd_refuses_clipping_with_sparse_tables(device):
    """The fused norm covers dense gradients only: clipping would leave the table unclipped."""
    torch.manual_seed(0)
    model = TablesAndHead().to(device)
    opt = fusedamp.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, max_grad_norm=1.0)
    model(*bag_batch(torch.Generator().manual_seed(12), device)).backward()
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="max_grad_norm is not supported with sparse"):
        opt.step()
    assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights))
    assert not opt.state


def test_op_refuses_bad_arguments_before_writing(device):
    gen = torch.Generator().manual_seed(7)
    t = torch.randn(ROWS, DIM, generator=gen).to(device)
    s = torch.zeros(ROWS, DIM, device=device)
    step = torch.zeros((), device=device)
    g = sparse_grad(gen, device=device)
    idx, vals = g._indices().clone(), g._values()
    idx[0, 7] = -1
    before = t.clone()
    if device == "cpu":  # on CUDA a device-side assert (test_sparse_cuda.py)
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
def test_opcheck(device, op, state):
    gen = torch.Generator().manual_seed(8)
    g = sparse_grad(gen, dtype=torch.float16, device=device)
    t = torch.randn(ROWS, DIM, generator=gen).half().to(device)
    shape = (ROWS,) if "rowwise" in op else (ROWS, DIM)
    states = [torch.zeros(shape, device=device) for _ in range(state)]
    kwargs = {"sparse_sgd_step_": dict(lr=0.1, momentum=0.9),
              "sparse_adagrad_step_": dict(lr=0.1),
              "sparse_adam_step_": dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8),
              "sparse_rowwise_adagrad_step_": dict(lr=0.1)}[op]
    args = (t, t.float(), g._indices(), g._values(), *states, torch.zeros((), device=device))
    torch.library.opcheck(getattr(torch.ops.fusedamp, op), args,
                          dict(kwargs, inv_scale=torch.full((), 0.5, device=device),
                               found_inf=torch.zeros((), device=device)))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_steps_tables_beside_dense_params(device, momentum):
    """fusedamp.optim.SGD over a table (sparse gradient) and a dense layer, against torch.optim.SGD
    on the same model; its state dict loads into torch's and back."""
    torch.manual_seed(0)
    ours_model = TablesAndHead().to(device)
    ref_model = TablesAndHead().to(device)
    ref_model.load_state_dict(ours_model.state_dict())
    ours = fusedamp.optim.SGD(ours_model.parameters(), lr=0.05, momentum=momentum)
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=momentum)
    gen = torch.Generator().manual_seed(9)
    for i in range(6):
        batch = bag_batch(gen, device)
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


def test_sgd_skip_covers_tables_and_dense_params(device):
    torch.manual_seed(0)
    model = TablesAndHead().to(device)
    opt = fusedamp.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 8)
    gen = torch.Generator().manual_seed(10)
    scaler.scale(model(*bag_batch(gen, device))).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    scaler.scale(model(*bag_batch(gen, device))).backward()
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
def test_unscale_before_step_steps_the_same(device, name):
    """scaler.unscale_(opt) (as before manual clipping), then scaler.step(opt): the step takes
    the unscaled gradients as they are, the same step as scaler.step(opt) alone."""
    cls, kwargs = SPARSE_OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(11)
    a = table(gen, device=device)
    b = nn.Parameter(a.detach().clone())
    runs = [(a, cls([a], **kwargs), fusedamp.GradScaler(device, init_scale=2.0 ** 12), True),
            (b, cls([b], **kwargs), fusedamp.GradScaler(device, init_scale=2.0 ** 12), False)]
    for _ in range(3):
        g = sparse_grad(gen, scale=2.0 ** 12, device=device)
        for p, opt, scaler, unscale_first in runs:
            scaler.scale(torch.ones((), device=device))
            p.grad = g.clone()
            if unscale_first:
                scaler.unscale_(opt)
                torch.testing.assert_close(p.grad.to_dense(), g.to_dense() / 2.0 ** 12)
            scaler.step(opt)
            scaler.update()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def _assert_stepped_with_master_rows(weight, state, start):
    """An FP16 table that moved, holding its FP32 master rows' rounding."""
    assert weight.dtype == torch.float16 and state["master_param"].dtype == torch.float32
    assert torch.equal(weight.detach(), state["master_param"].half())
    assert state["step"].item() >= 1 and not torch.equal(weight.detach(), start)


def test_initialize_with_sgd_gives_tables_master_rows(device):
    torch.manual_seed(0)
    model = TablesAndHead().to(device)
    model, opt, scaler = fusedamp.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), dtype=torch.float16)
    gen = torch.Generator().manual_seed(13)
    start = model.bag.weight.detach().clone()
    for _ in range(10):  # the first few overflow the head's FP16 gradient at 2^16 and skip
        opt.zero_grad()
        scaler.scale(model(*bag_batch(gen, device))).backward()
        scaler.step(opt)
        scaler.update()
    _assert_stepped_with_master_rows(model.bag.weight, opt.state[model.bag.weight], start)


def test_initialize_refuses_tables_in_an_optimizer_without_sparse_steps(device):
    model = TablesAndHead().to(device)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"bag \(EmbeddingBag with sparse=True\).*SparseAdam"):
        fusedamp.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


def test_initialize_with_the_tables_own_optimizer_as_the_error_says(device):
    """The recipe of the refusal above: initialize over the dense part, SparseAdam over the
    (converted) table with FP32 master rows, one scaler stepping both."""
    torch.manual_seed(0)
    model = TablesAndHead().to(device)
    dense = [p for n, p in model.named_parameters() if not n.startswith("bag.")]
    model, opt, scaler = fusedamp.initialize(model, torch.optim.Adam(dense, lr=1e-2),
                                             dtype=torch.float16)
    tables = fusedamp.optim.SparseAdam(model.bag.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(13)
    start = model.bag.weight.detach().clone()
    for _ in range(10):
        opt.zero_grad()
        tables.zero_grad()
        scaler.scale(model(*bag_batch(gen, device))).backward()
        scaler.step(opt)
        scaler.step(tables)
        scaler.update()
    _assert_stepped_with_master_rows(model.bag.weight, tables.state[model.bag.weight], start)
    assert int(opt.skipped_steps) < 10
