"""An element's step does not depend on where it lies: the same values stepped as a tensor of
their own and at odd offsets inside a longer tensor (other values around them, so that they
fall into other vector lanes, another tail and, on CUDA, other threads and chunks) give the same
bits in the weights and in every state tensor.

Modes whose state is per block (8-bit moments: one scale per 32 elements) or per element index
(stochastic rounding: the random bits are drawn for an element's index) depend on the position
by definition and are not in the list; capability_worker.py covers them per instruction set.
"""
import numpy as np
import pytest
import torch

import fusedamp
from capability_worker import CASES

POSITIONAL = ("int8", "stochastic")
ELEMENTWISE = [case for case in CASES if not any(word in case[0] for word in POSITIONAL)]
N = 77            # values stepped: neither a multiple of a vector width nor of a pair
OFFSETS = (1, 3, 13, 17, 31, 45)
LONG = 300


@pytest.mark.parametrize("name,cls,dtype,kwargs", ELEMENTWISE, ids=[c[0] for c in ELEMENTWISE])
def test_same_values_same_bits_at_any_offset(device, name, cls, dtype, kwargs):
    rng = np.random.default_rng(3)

    def randn(*shape):
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))

    values = randn(N) * 0.1
    own = torch.nn.Parameter(values.to(dtype).to(device))
    longs = []
    for k in OFFSETS:
        x = randn(LONG) * 0.1
        x[k:k + N] = values
        longs.append(torch.nn.Parameter(x.to(dtype).to(device)))
    params = [own] + longs
    opt = getattr(fusedamp.optim, cls)(params, lr=1e-2, **kwargs)
    for step in range(3):
        g = randn(N) * 10.0 ** -(step + 1)
        own.grad = g.to(dtype).to(device)
        for k, p in zip(OFFSETS, longs):
            full = randn(LONG) * 10.0 ** -(step + 1)
            full[k:k + N] = g
            p.grad = full.to(dtype).to(device)
        opt.step()

    def elements(p, k=None):
        tensors = {"param": p.detach()}
        tensors.update({key: v for key, v in opt.state[p].items()
                        if torch.is_tensor(v) and v.shape == p.shape})
        return {key: (t if k is None else t[k:k + N]).cpu() for key, t in tensors.items()}

    want = elements(own)
    assert len(want) > 1, "no per-element state to compare"
    for k, p in zip(OFFSETS, longs):
        got = elements(p, k)
        assert got.keys() == want.keys()
        for key in want:
            a, b = want[key], got[key]
            same = a.view(torch.uint8).reshape(N, -1).eq(b.view(torch.uint8).reshape(N, -1))
            assert bool(same.all()), f"{key} at offset {k}: {int((~same.all(1)).sum())} differ"
