"""Values, reference implementations and comparisons shared by the tests (op_inputs.py builds
the ops' inputs from these values), and the parameters and optimizers several test files start
from."""
import math
import struct

import pytest
import torch

import fusedamp

ops = torch.ops.fusedamp

# Odd sizes, an empty tensor, and sizes that span several CPU chunks / vector tails.
SIZES = [(0,), (1,), (7,), (33, 3), (1000,), (257, 129), (40001,)]
LOW = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def scalar(value, device, dtype=torch.float32):
    return torch.full((1,), value, dtype=dtype, device=device)


def randn_list(device, dtype=torch.float32, sizes=SIZES, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g, dtype=torch.float64) * scale).to(dtype).to(device) for s in sizes]


def snapshot(*lists):
    return [[t.detach().clone() for t in lst] if isinstance(lst, (list, tuple)) else lst.detach().clone() for lst in lists]


def _bits(t):
    t = t.to_dense() if t.is_sparse else t
    return t.reshape(-1).view(torch.uint8) if t.numel() else t


def assert_bitwise_equal(before, after):
    for a, b in zip(before, after):
        if isinstance(a, list):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert x.dtype == y.dtype and x.shape == y.shape
                assert torch.equal(_bits(x), _bits(y))
        else:
            assert torch.equal(_bits(a), _bits(b))


def max_abs_diff(xs, ys):
    m = 0.0
    for x, y in zip(xs, ys):
        if x.numel():
            m = max(m, (x.double().cpu() - y.double().cpu()).abs().max().item())
    return m


def f32(x):
    """Round a Python float to FP32 (to nearest even, overflowing to inf like a cast)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def scale_model(found_seq, init_scale, growth, backoff, interval, hysteresis=1, min_scale=None,
                max_scale=None):
    """Plain-Python model of update_scale_: yields (scale, growth_tracker, hysteresis_tracker).
    Hysteresis is Megatron-Core's: only a completed growth interval refills the tracker."""
    scale, gt, ht = f32(init_scale), 0, hysteresis
    for found in found_seq:
        if found:
            gt = 0
            ht = max(ht - 1, 0)
            if ht <= 0:
                s = f32(scale * backoff)
                if min_scale is not None and s < min_scale:
                    s = f32(min_scale)
                scale = s
        else:
            if gt + 1 == interval:
                ht = hysteresis
                s = f32(scale * growth)
                if max_scale is not None and s > max_scale:
                    s = f32(max_scale)
                if math.isfinite(s):
                    scale = s
                gt = 0
            else:
                gt += 1
        yield scale, gt, ht


def adam_reference_fp64(p, m, v, g, step, lr, beta1, beta2, eps, wd, decoupled, maximize=False):
    """One Adam/AdamW step in float64 (tensors updated in place); step is the new count."""
    if maximize:
        g = -g
    if wd:
        if decoupled:
            p.mul_(1 - lr * wd)
        else:
            g = g + wd * p
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    p.addcdiv_(m, (v.sqrt() / math.sqrt(bc2)).add_(eps), value=-lr / bc1)


def sgd_reference_fp64(p, buf, g, first, lr, momentum, dampening, wd, nesterov, maximize=False):
    if maximize:
        g = -g
    if wd:
        g = g + wd * p
    if momentum:
        if first:
            buf.copy_(g)
        else:
            buf.mul_(momentum).add_(g, alpha=1 - dampening)
        g = g + momentum * buf if nesterov else buf
    p.add_(g, alpha=-lr)


def max_rel_error(xs, refs):
    """Largest ||x - ref|| / ||ref|| over the tensors of a list (norms in float64)."""
    worst = 0.0
    for x, r in zip(xs, refs):
        if x.numel():
            r = r.double().cpu()
            worst = max(worst, ((x.double().cpu() - r).norm() / r.norm()).item())
    return worst


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA-only: torch.cuda.is_available() is False (no GPU or no CUDA torch)")


def sum_sq_fp64(tensors, piece=1 << 26):
    """Sum of squares of every element, in float64, a piece at a time (bounded memory)."""
    total = 0.0
    for t in tensors:
        flat = t.reshape(-1)
        for k in range(0, flat.numel(), piece):
            total += flat[k:k + piece].double().square().sum().item()
    return total


def assert_rel_close(value, ref, rtol):
    rel = abs(value - ref) / abs(ref)
    assert rel < rtol, (value, ref, rel)


# ---- parameters and optimizers of the fusedamp.optim / GradScaler tests ---------------------
def _model_params(device, dtype=torch.float32, seed=0):
    """Three parameters of `dtype` (33, 7x5 and 129 elements), seeded."""
    return [torch.nn.Parameter(t) for t in randn_list(device, dtype, sizes=[(33,), (7, 5), (129,)],
                                                      seed=seed)]


def _grads(device, dtype, step, scale=1.0, sizes=((33,), (7, 5), (129,))):
    """FP32 gradients of _model_params' shapes for step `step` (seeded by it); the caller casts
    them, `dtype` is not used."""
    return randn_list(device, torch.float32, sizes=list(sizes), seed=1000 + step, scale=scale)


def three_fp16_params_and(kind, device, numel):
    """Three FP16 parameters of `numel` elements and a fusedamp optimizer of `kind` over them."""
    params = [torch.nn.Parameter(torch.randn(numel, device=device).half()) for _ in range(3)]
    opt = (fusedamp.optim.AdamW(params, lr=1e-2) if kind == "AdamW"
           else fusedamp.optim.SGD(params, lr=1e-2, momentum=0.9))
    return params, opt
