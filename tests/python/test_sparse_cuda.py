"""The CUDA row-wise sparse steps against the CPU's: the same bits for every algorithm, table
dtype and master mode (both sum a row's lookups in FP32 in the gradient's order and share
math/sparse_rows_math.h), and an index out of range as a device-side assert. These need a GPU;
the other sparse tests run on every device of DEVICES."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import fusedamp
from sparse_helpers import OPS, SPARSE_OPTIMIZERS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="compares the CUDA kernels with the CPU's: needs a GPU")

BIT_CASES = dict(
    SPARSE_OPTIMIZERS,
    sgd=(fusedamp.optim.SGD, dict(lr=0.1)),
    sgd_nesterov_maximize=(fusedamp.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True,
                                                    maximize=True)),
    sgd_dampening=(fusedamp.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.3)),
    adagrad_decay=(fusedamp.optim.Adagrad, dict(lr=0.1, lr_decay=0.01,
                                                initial_accumulator_value=0.1)),
    sparse_adam_maximize=(fusedamp.optim.SparseAdam, dict(lr=0.01, betas=(0.8, 0.99),
                                                          maximize=True)),
)
STORAGE = [(torch.float32, True), (torch.float16, True), (torch.bfloat16, True),
           (torch.float16, False), (torch.bfloat16, False), (torch.bfloat16, "stochastic"),
           (torch.bfloat16, "split"), (torch.bfloat16, "split8")]
ROWS, DIM = 300, 37  # a row: one warp's 32 columns and a tail


def bits(t):
    """A tensor's bit patterns (torch.equal takes -0 for +0)."""
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("dtype,master", STORAGE)
@pytest.mark.parametrize("name", BIT_CASES)
def test_cuda_steps_match_cpu_bit_for_bit(name, dtype, master):
    """Through the optimizers and a loss scaler: duplicate lookups, rows looked up once and
    then not (SGD's momentum keeps moving them), rows never looked up."""
    cls, kwargs = BIT_CASES[name]
    gen = torch.Generator().manual_seed(15)
    w = torch.randn(ROWS, DIM, generator=gen).to(dtype)
    params = {dev: nn.Parameter(w.clone().to(dev)) for dev in ("cpu", "cuda")}
    opts = {dev: cls([p], master_weights=master, **kwargs) for dev, p in params.items()}
    scalers = {dev: fusedamp.GradScaler(dev, init_scale=2.0 ** 8) for dev in params}
    for _ in range(4):
        idx = (torch.rand(500, generator=gen) ** 3 * (ROWS // 2)).long()
        values = (torch.randn(500, DIM, generator=gen) * 2.0 ** 8).to(dtype)
        for dev, p in params.items():
            scalers[dev].scale(torch.ones((), device=dev))
            # A copy each: the step unscales the gradient's values in place.
            p.grad = torch.sparse_coo_tensor(idx[None], values.clone(), (ROWS, DIM), device=dev)
            scalers[dev].step(opts[dev])
            scalers[dev].update()
    cpu, cuda = (opts[dev].state[params[dev]] for dev in ("cpu", "cuda"))
    assert sorted(cpu) == sorted(cuda)
    assert same_bits(params["cpu"], params["cuda"])
    for key in cpu:
        assert same_bits(cpu[key], cuda[key]), key


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("values_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", OPS)
def test_ops_match_cpu_bit_for_bit(op, values_dtype, maximize):
    """The ops themselves: an FP16 table with its master, values of another dtype, an inverse
    loss scale, three steps from a step count of 0."""
    name, state, kwargs = OPS[op]
    fn = getattr(torch.ops.fusedamp, name)
    gen = torch.Generator().manual_seed(16)
    master = torch.randn(ROWS, DIM, generator=gen)
    shapes = {"table": (ROWS, DIM), "rows": (ROWS,)}
    cpu = ([master.half(), master.clone(), None, None]
           + [None if s is None else torch.rand(shapes[s], generator=gen) * 0.1 for s in state]
           + [torch.zeros(())])
    args = {"cpu": cpu, "cuda": [None if t is None else t.cuda() for t in cpu]}
    for _ in range(3):
        idx = (torch.rand(400, generator=gen) ** 2 * ROWS).long()[None]
        values = (torch.randn(400, DIM, generator=gen) * 4.0).to(values_dtype)
        for dev, a in args.items():
            a[2], a[3] = idx.to(dev), values.to(dev)
            fn(*a, **kwargs, maximize=maximize, inv_scale=torch.full((), 0.25, device=dev),
               found_inf=torch.zeros((), device=dev))
    written = [i for i, t in enumerate(cpu) if i not in (2, 3) and t is not None]
    for i in written:
        assert same_bits(args["cpu"][i], args["cuda"][i]), i


_OUT_OF_RANGE = """
import torch, fusedamp
t = torch.zeros(10, 4, device="cuda")
s = torch.zeros(10, 4, device="cuda")
idx = torch.tensor([[1, 10]], device="cuda")
torch.ops.fusedamp.sparse_adagrad_step_(t, None, idx, torch.ones(2, 4, device="cuda"), s,
                                        torch.zeros((), device="cuda"), lr=0.1)
torch.cuda.synchronize()
print("no error")
"""


def test_out_of_range_index_is_a_device_assert():
    """The index range is data on the GPU: checked without a host synchronisation, found as a
    device-side assert (as torch's own CUDA indexing), which ends the process's CUDA context,
    hence a separate process."""
    python = os.path.join(os.path.dirname(__file__), "..", "..", "python")
    run = subprocess.run([sys.executable, "-c", _OUT_OF_RANGE],
                         env=dict(os.environ, PYTHONPATH=python), capture_output=True,
                         text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "no error" not in out, out
    assert "device-side assert" in out or "out of range" in out, out
