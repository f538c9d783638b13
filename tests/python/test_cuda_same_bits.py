"""CPU against CUDA, bit for bit (docs/engine.md, "Same bits everywhere": an element's result
depends on its own inputs and the step's scalars, not on the device):

* capability_worker.py's steps (every optimizer, master-weight mode and state dtype, 8-bit
  states and non-finite gradients stepped without a skip included, over sizes with partial
  vectors and blocks), run on each device: every tensor they leave, weights and state.
* the 8-bit states' op steps of test_quantized_moments_cuda.py (device scalars, a skipped step,
  maximize, every weight store) with every tensor at an odd offset of a longer one on CUDA,
  against the same values as tensors of their own on the CPU.

test_position_independence.py's CUDA cases step the same values as their own tensor and at odd
offsets inside longer parameters. A NaN equals a NaN here whatever its bits: the CPU makes
0xFFC00000 where CUDA makes 0x7FFFFFFF. What the promise leaves out is left out: reductions (no
clipping), and the per-tensor coefficients, which each side takes from its own FP64 pow (at
these steps' counts no FP64 ulp decides their FP32 rounding).
"""
import pytest
import torch

import capability_worker
from test_quantized_moments_cuda import F16, F32, STORES, problem, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_same_bits(cuda, cpu, what):
    assert cuda.dtype == cpu.dtype and cuda.shape == cpu.shape, what
    bits = _INT_OF_SIZE[cpu.element_size()]
    a, b = cuda.reshape(-1).view(bits), cpu.reshape(-1).view(bits)
    same = a == b
    if cpu.is_floating_point():
        same |= cuda.reshape(-1).isnan() & cpu.reshape(-1).isnan()
    assert bool(same.all()), f"{what}: {int((~same).sum())} of {same.numel()} differ"


@pytest.mark.parametrize("name,cls,dtype,kwargs", capability_worker.CASES,
                         ids=[c[0] for c in capability_worker.CASES])
def test_optimizer_steps_give_the_cpus_bits(name, cls, dtype, kwargs):
    cpu = capability_worker.run_case(name, cls, dtype, kwargs, device="cpu")
    cuda = capability_worker.run_case(name, cls, dtype, kwargs, device="cuda")
    assert cuda.keys() == cpu.keys()
    for key in cpu:
        assert_same_bits(cuda[key], cpu[key], f"{name}/{key}")


def test_split_stores_give_the_cpus_bits():
    cpu = capability_worker.split_edges("cpu")
    cuda = capability_worker.split_edges("cuda")
    assert cuda.keys() == cpu.keys()
    for key in cpu:
        assert_same_bits(cuda[key], cpu[key], key)


@pytest.mark.parametrize("op", ["adam_step_", "sgd_step_"])
@pytest.mark.parametrize("store, pdtype", STORES,
                         ids=[f"{s}-{str(d).replace('torch.', '')}" for s, d in STORES])
def test_8bit_steps_at_odd_offsets_give_the_cpus_bits(op, store, pdtype):
    gdtype = F32 if pdtype == F16 else pdtype  # FP32 grads of FP16 params too
    shapes = [(1,), (33,), (1000,), (37, 29)]
    state, grads, seeds = problem(store, pdtype, gdtype, shapes, seed=23, op=op)
    cpu, _ = run("cpu", state, grads, seeds, 0, op=op)
    for offset in (1, 3):
        cuda, _ = run("cuda", state, grads, seeds, offset, op=op)
        assert cuda.keys() == cpu.keys()
        for key in cpu:
            for i, (a, b) in enumerate(zip(cuda[key], cpu[key])):
                assert_same_bits(a, b, f"{key}[{i}] at offset {offset}")
    codes = cpu["exp_avgs"] if op == "adam_step_" else cpu["momentum_buffers"]
    assert any(t.ne(0).any() for t in codes)  # the state was really quantized
