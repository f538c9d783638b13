"""The CPU kernels are compiled once per instruction set (DEFAULT, AVX2, AVX512) and the best
one the CPU has is picked, as torch picks its own (ATEN_CPU_CAPABILITY chooses another). A
machine runs only its best one in the other tests; here the others run too, in a subprocess
each (capability_worker.py: every optimizer and weight store, 8-bit states included, over
sizes with partial vectors and blocks), against this process's results.

Every instruction set gives the same bits, DEFAULT included, in every mode: weights, masters,
moments, remainders, block scales; and the sum of squares behind clipping (the lanes and their
order are the same whatever the vector width: cpu/lane_reduce.h SquareSums), so clipped steps
too. The formulas fuse a multiply-add only where they say so
(LaneOps::fma: an FMA instruction on AVX2/AVX512, std::fma lane by lane on DEFAULT, fmaf on
CUDA) and the library is compiled with contraction off, so no compiler turns a*b+c into one
rounding in one build and two in another.
"""
import os
import subprocess
import sys

import pytest
import torch

import fusedamp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import capability_worker  # noqa: E402
from op_helpers import _bits  # noqa: E402

BEST = fusedamp._C.cpu_capability()
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
OTHERS = {"DEFAULT": ["default"], "AVX2": ["default"], "AVX512": ["default", "avx2"]}.get(
    BEST, [])


@pytest.fixture(scope="module")
def best():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return capability_worker.cpu_results()
    finally:
        torch.set_num_threads(threads)


def _run_worker(capability, tmp_path):
    out = tmp_path / f"{capability}.pt"
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    proc = subprocess.run([sys.executable, "-W", "ignore",
                           os.path.join(HERE, "capability_worker.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.skipif(not OTHERS, reason=f"no other instruction set than {BEST} is built here")
@pytest.mark.parametrize("capability", OTHERS)
def test_every_instruction_set_gives_the_same_step(capability, best, tmp_path):
    other = _run_worker(capability, tmp_path)
    assert other.pop("capability") == capability.upper()
    assert other.keys() == best.keys()
    differing = {}  # (case, tensor) -> elements whose bits differ, all reported at once
    for name, tensors in best.items():
        assert other[name].keys() == tensors.keys(), name
        for key, mine in tensors.items():
            theirs = other[name][key]
            assert theirs.dtype == mine.dtype and theirs.shape == mine.shape, (name, key)
            if not torch.equal(_bits(theirs), _bits(mine)):
                bits = _INT_OF_SIZE[mine.element_size()]
                a, b = mine.reshape(-1).view(bits), theirs.reshape(-1).view(bits)
                differing[f"{name}/{key}"] = f"{int((a != b).sum())} of {a.numel()}"
    assert not differing, f"{capability} differs from {BEST} in:\n" + "\n".join(
        f"  {key}: {count}" for key, count in differing.items())
