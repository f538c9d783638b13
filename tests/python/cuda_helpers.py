"""What the CUDA-only tests (test_cuda_*.py) share: the dtypes and sizes they run over, one
problem copied to the CPU and to CUDA (optionally at odd element offsets), a comparison of the
two results, tolerances for FP32 state, and guards that fail on any host synchronisation."""
import contextlib

import torch


LOW = [torch.float16, torch.bfloat16]
ALL = [torch.float32, torch.float16, torch.bfloat16]


def dtype_id(d):
    return str(d).replace("torch.", "")

# Sizes around the kernels' boundaries: vector width (4/8), one block's chunk (32768),
# several chunks with a ragged tail, empty tensors of several ranks.
SIZES = [(0,), (1,), (3,), (8,), (9,), (31, 7), (32768,), (32769,), (100_003,), (257, 129),
         (5, 0, 3), (4096, 3)]


def capture(step, scratch, state):
    """A CUDA graph of step(state), recorded, not run (`state` keeps its values). Two warm-up
    runs of step(scratch), a throwaway copy, on a side stream first (module loading, allocator),
    as torch recommends before capturing. Entering capture synchronises; the step must not."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(scratch)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), sync_forbidden():
        step(state)
    return graph


@contextlib.contextmanager
def sync_forbidden():
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def cuda_call(op, *args, **kwargs):
    """Runs a fusedamp op on CUDA tensors; any host synchronisation inside raises."""
    with sync_forbidden():
        op(*args, **kwargs)


def place(t, device, offset=0):
    """A copy of t on device, as a view starting `offset` elements into a larger buffer (an odd
    offset breaks every vector alignment, so the kernel takes its scalar path)."""
    buf = torch.zeros(t.numel() + offset, dtype=t.dtype, device=device)
    v = buf[offset:offset + t.numel()].view(t.shape)
    v.copy_(t)
    return v


def on_both(inp, offsets={}):
    """(cpu copy, cuda copy) of CPU op inputs; the tensors of field `name` start
    offsets.get(name, 0) elements into their buffers, on both devices."""
    return tuple(inp.map(lambda name, t: place(t, device, offsets.get(name, 0)))
                 for device in ("cpu", "cuda"))


def rand(shape, dtype, gen, scale=1.0, positive=False):
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    return (x.abs() if positive else x).to(dtype)


def assert_same(cuda_list, cpu_list, exact=False, **tol):
    """exact: equal values (NaN == NaN: the GPU writes its canonical NaN, the CPU keeps the
    payload, so NaN bits may differ)."""
    assert len(cuda_list) == len(cpu_list)
    if exact:
        tol = dict(rtol=0, atol=0)
    for i, (c, r) in enumerate(zip(cuda_list, cpu_list)):
        assert c.shape == r.shape and c.dtype == r.dtype, i
        torch.testing.assert_close(c.cpu(), r, equal_nan=True, **tol,
                                   msg=lambda m, i=i: f"tensor [{i}]: {m}")


def state_tol(pdtype, master):
    """Tolerance for FP32 state (moments, buffers, master weights) between CPU and CUDA. With
    FP16/BF16 params and no master copy, a param may round one step apart where FMA
    contraction moved its FP32 value across a rounding boundary; through weight decay that
    reaches the state at ~1e-4 relative."""
    if master or pdtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-6)
    return dict(rtol=1e-3, atol=1e-4)
