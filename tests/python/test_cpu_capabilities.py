"""The CPU kernels are compiled once per instruction set (DEFAULT, AVX2, AVX512) and the best
one the CPU has is picked, as torch picks its own (ATEN_CPU_CAPABILITY chooses another). A
machine runs only its best one in the other tests; here the others run too, in a subprocess
each (capability_worker.py: every optimizer and weight store, 8-bit states included, over
sizes with partial vectors and blocks), against this process's results:

- AVX2 and AVX512 give the same bits: the same FP32 operations, fused multiply-adds in both;
- DEFAULT (no FMA instructions, so a*b+c rounds twice) is within 4 ulps of the parameter
  dtype after three steps (of the weight, or of the three updates where the weight is near
  0), element by element: the same algorithm, not a different one;
- the split weight stores alone (no FP32 arithmetic: integer formulas, on vectors in AVX2 and
  AVX512, lane by lane in DEFAULT) give the same bits everywhere, DEFAULT included.
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
OTHERS = {"DEFAULT": ["default"], "AVX2": ["default"], "AVX512": ["default", "avx2"]}.get(
    BEST, [])


@pytest.fixture(scope="module")
def best():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {name: capability_worker.run_case(name, *rest)
               for name, *rest in capability_worker.CASES}
        out["split_edges"] = capability_worker.split_edges()
        return out
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
    for name, tensors in best.items():
        assert other[name].keys() == tensors.keys(), name
        for key, mine in tensors.items():
            theirs = other[name][key]
            assert theirs.dtype == mine.dtype and theirs.shape == mine.shape, (name, key)
            if capability != "default" or name == "split_edges":
                assert torch.equal(_bits(theirs), _bits(mine)), (name, key)
            elif key.startswith("param") and "." not in key:  # the weights: 4 ulps
                a, b = mine.double(), theirs.double()
                # of the weight, or of the steps' updates (lr each) where it is near 0
                size = torch.maximum(a.abs(), b.abs()) + capability_worker.LR * 3
                ulp = torch.finfo(mine.dtype).eps * size
                assert bool(((a - b).abs() <= 4 * ulp).all()), \
                    (name, key, float((a - b).abs().max()))
