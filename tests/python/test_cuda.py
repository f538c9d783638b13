"""CUDA-only checks of the CUDA kernels (the shared op tests in test_ops.py already run on CUDA
through the `device` fixture; these cover what only the GPU path has):

* CUDA against the CPU kernels on identical inputs: odd and empty shapes, tensors spanning
  several chunks, views at odd element offsets (unaligned: the scalar path), dense
  non-contiguous layouts, every dtype combination, more tensors than one launch's metadata
  holds.
* No host synchronisation: every op runs under torch.cuda.set_sync_debug_mode("error").
* A whole step (grad_stats_ -> adam_step_ -> update_scale_) captured in a CUDA graph and
  replayed, bit-identical to the same step run eagerly.
"""
import contextlib

import pytest
import torch

from op_helpers import ops

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA-only checks: torch.cuda.is_available() is False (no GPU or no CUDA torch)")

LOW = [torch.float16, torch.bfloat16]
ALL = [torch.float32, torch.float16, torch.bfloat16]


def dtype_id(d):
    return str(d).replace("torch.", "")

# Sizes around the kernels' boundaries: vector width (4/8), one block's chunk (32768),
# several chunks with a ragged tail, empty tensors of several ranks.
SIZES = [(0,), (1,), (3,), (8,), (9,), (31, 7), (32768,), (32769,), (100_003,), (257, 129),
         (5, 0, 3), (4096, 3)]


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


def both(t, offset=0):
    """(cpu copy, cuda copy) of a CPU tensor, each at the same element offset."""
    return place(t, "cpu", offset), place(t, "cuda", offset)


def rand(shape, dtype, gen, scale=1.0, positive=False):
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    return (x.abs() if positive else x).to(dtype)


def scalars(value):
    return (torch.full((1,), value, dtype=torch.float32),
            torch.full((1,), value, dtype=torch.float32, device="cuda"))


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


# ------------------------------------------------------------ unscale_and_check_ / grad_stats_
@pytest.mark.parametrize("offset", [0, 1, 3])
@pytest.mark.parametrize("poison", [None, "inf", "nan"])
def test_unscale_and_grad_stats_match_cpu(offset, poison):
    gen = torch.Generator().manual_seed(11)
    # Mixed dtypes in one list: the CUDA side groups them; flags must land on the right index.
    src = [rand(s, ALL[i % 3], gen, scale=300.0) for i, s in enumerate(SIZES)]
    if poison:
        src[8].view(-1)[100_002] = float(poison)  # last element of a ragged last chunk
        src[5].view(-1)[0] = float(poison)
    cpu, cuda = zip(*[both(t, offset) for t in src])
    cpu, cuda = list(cpu), list(cuda)

    found_c, found_g = scalars(0.0)
    sq_c, sq_g = scalars(2.5)
    flags_c, flags_g = torch.zeros(len(src)), torch.zeros(len(src), device="cuda")
    before = [t.clone() for t in cuda]
    ops.grad_stats_(cpu, found_c, sq_c, flags_c)
    cuda_call(ops.grad_stats_, cuda, found_g, sq_g, flags_g)
    assert found_g.item() == found_c.item() == (1.0 if poison else 0.0)
    assert flags_g.cpu().tolist() == flags_c.tolist()
    if not poison:
        torch.testing.assert_close(sq_g.cpu(), sq_c, rtol=1e-5, atol=0)
    for t, t0 in zip(cuda, before):  # grad_stats_ is read-only
        assert torch.equal(t.view(torch.uint8), t0.view(torch.uint8))

    inv_c, inv_g = scalars(3.0 / 1024.0)
    ops.unscale_and_check_(cpu, found_c, inv_c)
    cuda_call(ops.unscale_and_check_, cuda, found_g, inv_g)
    assert found_g.item() == found_c.item()
    assert_same(cuda, cpu, exact=True)  # one FP32 multiply per element: bit-exact


def test_grad_stats_is_deterministic_and_accumulates():
    g = torch.randn(3_000_017, device="cuda", dtype=torch.float16) * 1000
    found, first = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    cuda_call(ops.grad_stats_, [g, g[1:]], found, first)
    again = torch.zeros(1, device="cuda")
    cuda_call(ops.grad_stats_, [g, g[1:]], found, again)
    assert torch.equal(first, again)
    cuda_call(ops.grad_stats_, [g, g[1:]], found, again)  # adds
    ref = 2 * (g.double() ** 2).sum() - g[0].double() ** 2
    torch.testing.assert_close(again.double().cpu(), 2 * ref.cpu().reshape(1), rtol=1e-5, atol=0)


def test_flags_and_found_inf_are_never_reset():
    g = [torch.ones(10, device="cuda"), torch.ones(10, device="cuda")]
    found, sq = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
    flags = torch.tensor([1.0, 0.0], device="cuda")
    cuda_call(ops.grad_stats_, g, found, sq, flags)
    assert found.item() == 1.0 and flags.tolist() == [1.0, 0.0] and sq.item() == 20.0


# ------------------------------------------------------------ adam_step_
def _adam_inputs(pdtype, gdtype, master, offsets, gen):
    """CPU and CUDA copies of one Adam problem. offsets: element offset per list."""
    lists = {"p": [], "mp": [], "g": [], "m": [], "v": [], "st": []}
    for i, s in enumerate(SIZES):
        p32 = rand(s, torch.float32, gen)
        lists["p"].append(p32.to(pdtype))
        lists["mp"].append(p32)
        lists["g"].append(rand(s, gdtype, gen, scale=64.0))
        lists["m"].append(rand(s, torch.float32, gen, scale=0.1))
        lists["v"].append(rand(s, torch.float32, gen, scale=0.01, positive=True))
        lists["st"].append(torch.full((), float(i % 5), dtype=torch.float32))
    if not master:
        lists["mp"] = []
    cpu, cuda = {}, {}
    for k, ts in lists.items():
        off = offsets.get(k, 0)
        pairs = [both(t, off) for t in ts]
        cpu[k] = [a for a, _ in pairs]
        cuda[k] = [b for _, b in pairs]
    return cpu, cuda


@pytest.mark.parametrize("pdtype", ALL, ids=dtype_id)
@pytest.mark.parametrize("grad_fp32", [False, True])
@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("offsets", [{}, {"g": 1}, {"p": 3, "mp": 1, "m": 2, "v": 5}, {"g": 4}],
                         ids=["aligned", "grad+1", "all-odd", "grad+4"])
def test_adam_matches_cpu(pdtype, grad_fp32, master, offsets):
    if master and pdtype == torch.float32 and offsets:
        pytest.skip("FP32 master weights for FP32 params: covered by the aligned case")
    gen = torch.Generator().manual_seed(21)
    gdtype = torch.float32 if grad_fp32 else pdtype
    cpu, cuda = _adam_inputs(pdtype, gdtype, master, offsets, gen)
    lr_c, lr_g = scalars(2e-3)
    inv_c, inv_g = scalars(1 / 64.0)
    found_c, found_g = scalars(0.0)
    sq_c, sq_g = scalars(4.0e8)  # a large norm: the clip coefficient is active
    for step, (wd, decoupled, maximize) in enumerate([(0.01, True, False), (0.1, False, True),
                                                       (0.0, True, False)]):
        kw = dict(lr=1e-3, beta1=0.9, beta2=0.995, eps=1e-8, weight_decay=wd,
                  decoupled_weight_decay=decoupled, maximize=maximize)
        extra_c = dict(lr_tensor=lr_c, inv_scale=inv_c, found_inf=found_c, grad_sum_sq=sq_c,
                       max_grad_norm=1.0) if step != 2 else {}
        extra_g = dict(lr_tensor=lr_g, inv_scale=inv_g, found_inf=found_g, grad_sum_sq=sq_g,
                       max_grad_norm=1.0) if step != 2 else {}
        ops.adam_step_(cpu["p"], cpu["mp"], cpu["g"], cpu["m"], cpu["v"], cpu["st"], **kw,
                       **extra_c)
        cuda_call(ops.adam_step_, cuda["p"], cuda["mp"], cuda["g"], cuda["m"], cuda["v"],
                  cuda["st"], **kw, **extra_g)
    # FP32 state: the same formula, only FMA contraction differs.
    tol = state_tol(pdtype, master)
    assert_same(cuda["m"], cpu["m"], **tol)
    assert_same(cuda["v"], cpu["v"], **tol)
    assert_same(cuda["mp"], cpu["mp"], **tol)
    # Low-precision params may differ by one rounding step where FP32 values straddle it.
    assert_same(cuda["p"], cpu["p"], **({"rtol": 1e-5, "atol": 1e-6}
                                         if pdtype == torch.float32 else {}))
    assert_same(cuda["st"], cpu["st"], exact=True)
    if master:
        for p, mp in zip(cuda["p"], cuda["mp"]):
            assert torch.equal(p, mp.to(pdtype))


def test_adam_channels_last_layout():
    gen = torch.Generator().manual_seed(5)
    p = rand((4, 6, 5, 7), torch.float32, gen).contiguous(memory_format=torch.channels_last)
    g = rand((4, 6, 5, 7), torch.float32, gen).contiguous(memory_format=torch.channels_last)
    res = {}
    for dev in ["cpu", "cuda"]:
        pp, gg = p.to(dev), g.to(dev)
        m, v = torch.zeros_like(pp), torch.zeros_like(pp)
        st = torch.zeros((), device=dev)
        fn = cuda_call if dev == "cuda" else (lambda op, *a, **k: op(*a, **k))
        for _ in range(3):
            fn(ops.adam_step_, [pp], [], [gg], [m], [v], [st], lr=1e-2, beta1=0.9, beta2=0.999,
               eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True)
        res[dev] = pp
    assert res["cuda"].is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(res["cuda"].cpu(), res["cpu"], rtol=1e-5, atol=1e-6)


def test_shared_step_tensor_counts_like_cpu():
    # The CPU adds 1 per list entry; the CUDA follow-up kernel must not lose increments.
    out = {}
    for dev in ["cpu", "cuda"]:
        ps = [torch.ones(5, device=dev) for _ in range(4)]
        st = torch.zeros((), device=dev)
        fn = cuda_call if dev == "cuda" else (lambda op, *a, **k: op(*a, **k))
        fn(ops.sgd_step_, ps, [], [torch.ones_like(p) for p in ps], [], [st] * 4, lr=0.1,
           momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)
        out[dev] = st.item()
    assert out["cuda"] == out["cpu"] == 4.0


# ------------------------------------------------------------ sgd_step_
@pytest.mark.parametrize("pdtype", ALL, ids=dtype_id)
@pytest.mark.parametrize("grad_fp32", [False, True])
@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("unaligned", [False, True])
def test_sgd_matches_cpu(pdtype, grad_fp32, master, unaligned):
    gdtype = torch.float32 if grad_fp32 else pdtype
    configs = [dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0),
               dict(momentum=0.9, dampening=0.1, nesterov=False, weight_decay=1e-3),
               dict(momentum=0.8, dampening=0.0, nesterov=True, weight_decay=0.0)]
    for cfg in configs:
        gen = torch.Generator().manual_seed(31)
        off = 1 if unaligned else 0
        p32 = [rand(s, torch.float32, gen) for s in SIZES]
        cpu_p, cuda_p = zip(*[both(p.to(pdtype), off) for p in p32])
        cpu_mp, cuda_mp = (zip(*[both(p, 2 * off) for p in p32]) if master else ([], []))
        cpu_b, cuda_b = (zip(*[both(torch.zeros_like(p), 3 * off) for p in p32])
                         if cfg["momentum"] else ([], []))
        cpu_st, cuda_st = zip(*[both(torch.zeros(())) for _ in p32])
        cpu_p, cuda_p, cpu_mp, cuda_mp = list(cpu_p), list(cuda_p), list(cpu_mp), list(cuda_mp)
        cpu_b, cuda_b, cpu_st, cuda_st = list(cpu_b), list(cuda_b), list(cpu_st), list(cuda_st)
        for step in range(3):  # step 0 initialises the momentum buffers
            grads = [rand(s, gdtype, gen) for s in SIZES]
            cpu_g, cuda_g = zip(*[both(g, off) for g in grads])
            inv_c, inv_g = scalars(0.5)
            ops.sgd_step_(cpu_p, cpu_mp, list(cpu_g), cpu_b, cpu_st, lr=0.05, maximize=step == 1,
                          inv_scale=inv_c, **cfg)
            cuda_call(ops.sgd_step_, cuda_p, cuda_mp, list(cuda_g), cuda_b, cuda_st, lr=0.05,
                      maximize=step == 1, inv_scale=inv_g, **cfg)
        assert_same(cuda_b, cpu_b, **state_tol(pdtype, master))
        assert_same(cuda_mp, cpu_mp, **state_tol(pdtype, master))
        assert_same(cuda_p, cpu_p, **({"rtol": 1e-5, "atol": 1e-6}
                                      if pdtype == torch.float32 else {}))
        assert_same(cuda_st, cpu_st, exact=True)


# ------------------------------------------------------------ many tensors
def test_more_tensors_than_one_launch_holds():
    # 5000 tensors exceed every kernel's per-launch metadata (the largest holds ~1100 tensors,
    # the step-count kernel ~4000), so each op spans several launches.
    gen = torch.Generator().manual_seed(41)
    n = 5000
    sizes = [(1 + (i * 7) % 13,) for i in range(n)]
    p32 = [rand(s, torch.float32, gen) for s in sizes]
    grads = [rand(s, torch.float16, gen, scale=100.0) for s in sizes]
    grads[4321][0] = float("inf")
    cpu_g, cuda_g = [g.clone() for g in grads], [g.cuda() for g in grads]

    found_c, found_g = scalars(0.0)
    sq_c, sq_g = scalars(0.0)
    flags_c, flags_g = torch.zeros(n), torch.zeros(n, device="cuda")
    ops.grad_stats_(cpu_g, found_c, sq_c, flags_c)
    cuda_call(ops.grad_stats_, cuda_g, found_g, sq_g, flags_g)
    assert found_g.item() == 1.0
    assert torch.nonzero(flags_g).flatten().tolist() == [4321]
    assert torch.equal(flags_g.cpu(), flags_c)

    grads[4321][0] = 1.0
    cpu_g, cuda_g = [g.clone() for g in grads], [g.cuda() for g in grads]
    inv_c, inv_g = scalars(1 / 128.0)
    found_c.zero_()
    found_g.zero_()
    ops.unscale_and_check_(cpu_g, found_c, inv_c)
    cuda_call(ops.unscale_and_check_, cuda_g, found_g, inv_g)
    assert found_g.item() == found_c.item() == 0.0
    assert_same(cuda_g, cpu_g, exact=True)

    cpu_p = [p.half() for p in p32]
    cuda_p = [p.half().cuda() for p in p32]
    cpu_mp, cuda_mp = [p.clone() for p in p32], [p.cuda() for p in p32]
    cpu_m, cuda_m = [torch.zeros_like(p) for p in p32], [torch.zeros_like(p).cuda() for p in p32]
    cpu_v, cuda_v = [torch.zeros_like(p) for p in p32], [torch.zeros_like(p).cuda() for p in p32]
    cpu_st, cuda_st = [torch.zeros(()) for _ in p32], [torch.zeros((), device="cuda") for _ in p32]
    for _ in range(2):
        kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                  decoupled_weight_decay=True)
        ops.adam_step_(cpu_p, cpu_mp, cpu_g, cpu_m, cpu_v, cpu_st, **kw, found_inf=found_c)
        cuda_call(ops.adam_step_, cuda_p, cuda_mp, cuda_g, cuda_m, cuda_v, cuda_st, **kw,
                  found_inf=found_g)
    assert_same(cuda_mp, cpu_mp, rtol=1e-5, atol=1e-6)
    assert_same(cuda_m, cpu_m, rtol=1e-5, atol=1e-7)
    assert_same(cuda_p, cpu_p)
    assert torch.stack(cuda_st).eq(2).all()

    bufs_c = [torch.zeros_like(p) for p in p32]
    bufs_g = [b.cuda() for b in bufs_c]
    sgd_kw = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False)
    ops.sgd_step_(cpu_p, cpu_mp, cpu_g, bufs_c, cpu_st, **sgd_kw)
    cuda_call(ops.sgd_step_, cuda_p, cuda_mp, cuda_g, bufs_g, cuda_st, **sgd_kw)
    assert_same(bufs_g, bufs_c, rtol=1e-5, atol=1e-6)
    assert_same(cuda_mp, cpu_mp, rtol=1e-5, atol=1e-6)
    assert torch.stack(cuda_st).eq(3).all()


# ------------------------------------------------------------ update_scale_
def test_update_scale_matches_cpu_and_torch():
    gen = torch.Generator().manual_seed(3)
    seq = (torch.rand(500, generator=gen) < 0.2).tolist()
    st = {}
    for dev in ["cpu", "cuda"]:
        st[dev] = (torch.full((1,), 2.0 ** 16, device=dev), torch.zeros(1, dtype=torch.int32, device=dev),
                   torch.full((1,), 2, dtype=torch.int32, device=dev))
    founds = {dev: [torch.full((1,), float(f), device=dev) for f in seq] for dev in st}
    ref = (torch.full((1,), 2.0 ** 16, device="cuda"), torch.zeros(1, dtype=torch.int32, device="cuda"))
    for i in range(len(seq)):
        ops.update_scale_(*st["cpu"], founds["cpu"][i], 2.0, 0.5, 7, 2, 1.0, 2.0 ** 20)
        cuda_call(ops.update_scale_, *st["cuda"], founds["cuda"][i], 2.0, 0.5, 7, 2, 1.0, 2.0 ** 20)
    for a, b in zip(st["cuda"], st["cpu"]):
        assert torch.equal(a.cpu(), b)
    # hysteresis 1, no bounds, non-power-of-two factors: torch's CUDA kernel, bit for bit.
    mine = (torch.full((1,), 2.0 ** 16, device="cuda"), torch.zeros(1, dtype=torch.int32, device="cuda"),
            torch.ones(1, dtype=torch.int32, device="cuda"))
    for i in range(len(seq)):
        cuda_call(ops.update_scale_, *mine, founds["cuda"][i], 1.7, 0.3, 3)
        torch._amp_update_scale_(ref[0], ref[1], founds["cuda"][i], 1.7, 0.3, 3)
    assert torch.equal(mine[0], ref[0]) and torch.equal(mine[1], ref[1])


# ------------------------------------------------------------ devices and streams
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_runs_on_the_tensors_device():
    p = torch.randn(1000, device="cuda:1")
    ref = p.cpu()
    g = torch.randn(1000, device="cuda:1")
    st = torch.zeros((), device="cuda:1")
    with torch.cuda.device(0):
        cuda_call(ops.sgd_step_, [p], [], [g], [], [st], lr=0.5, momentum=0.0, dampening=0.0,
                  weight_decay=0.0, nesterov=False)
    torch.testing.assert_close(p.cpu(), ref - 0.5 * g.cpu())


def test_runs_on_the_current_stream():
    s = torch.cuda.Stream()
    g = torch.randn(1 << 20, device="cuda")
    expected = g * 0.25
    found, inv = torch.zeros(1, device="cuda"), torch.full((1,), 0.25, device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cuda_call(ops.unscale_and_check_, [g], found, inv)
        done = torch.cuda.Event()
        done.record(s)
    torch.cuda.current_stream().wait_event(done)
    assert torch.equal(g, expected)


# ------------------------------------------------------------ CUDA graphs
def _make_state(gen, pdtype):
    sizes = [(1000,), (33, 17), (32769,), (5,)]
    p32 = [rand(s, torch.float32, gen).cuda() for s in sizes]
    return dict(
        p=[p.to(pdtype) for p in p32], mp=[p.clone() for p in p32],
        g=[torch.zeros(s, dtype=pdtype, device="cuda") for s in sizes],
        m=[torch.zeros_like(p) for p in p32], v=[torch.zeros_like(p) for p in p32],
        st=[torch.zeros((), device="cuda") for _ in p32],
        scale=torch.full((1,), 2.0 ** 10, device="cuda"),
        gt=torch.zeros(1, dtype=torch.int32, device="cuda"),
        ht=torch.ones(1, dtype=torch.int32, device="cuda"),
        found=torch.zeros(1, device="cuda"), sq=torch.zeros(1, device="cuda"),
        inv=torch.ones(1, device="cuda"), lr=torch.full((1,), 1e-3, device="cuda"),
        flags=torch.zeros(len(sizes), device="cuda"))


def _step(s):
    """One whole training step after backward, all on the device."""
    s["found"].zero_()
    s["sq"].zero_()
    torch.reciprocal(s["scale"], out=s["inv"])
    ops.grad_stats_(s["g"], s["found"], s["sq"], s["flags"])
    ops.adam_step_(s["p"], s["mp"], s["g"], s["m"], s["v"], s["st"], lr=0.0, beta1=0.9,
                   beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled_weight_decay=True,
                   lr_tensor=s["lr"], inv_scale=s["inv"], found_inf=s["found"],
                   grad_sum_sq=s["sq"], max_grad_norm=5.0)
    ops.update_scale_(s["scale"], s["gt"], s["ht"], s["found"], 2.0, 0.5, 3)


@pytest.mark.parametrize("pdtype", LOW, ids=dtype_id)
def test_whole_step_in_a_cuda_graph_equals_eager(pdtype):
    gen = torch.Generator().manual_seed(51)
    eager = _make_state(gen, pdtype)
    graphed = {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone())
               for k, v in eager.items()}

    # Warm up on a side stream with throwaway copies (module loading, allocator), as torch
    # recommends before capturing.
    scratch = {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone())
               for k, v in eager.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _step(scratch)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # (entering it synchronises; the step itself must not)
        with sync_forbidden():
            _step(graphed)  # recorded, not run: `graphed` keeps its initial values

    for it in range(12):
        grads = [rand(t.shape, torch.float32, gen, scale=2.0 ** 10).to(pdtype).cuda()
                 for t in eager["g"]]
        if it in (4, 5):
            grads[2].view(-1)[7] = float("inf")  # skipped steps: scale backs off
        lr = 1e-3 * (0.9 ** it)
        for s in (eager, graphed):
            for dst, src in zip(s["g"], grads):
                dst.copy_(src)
            s["lr"].fill_(lr)
        with sync_forbidden():
            _step(eager)
        graph.replay()
    torch.cuda.synchronize()

    for k in eager:
        a, b = eager[k], graphed[k]
        for x, y in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
            assert torch.equal(x, y), k  # deterministic kernels: bit-identical
    # growth every 3 clean steps, backoff on steps 4 and 5: 1024 -> 2048 -> 1024 -> 512 ->
    # 1024 -> 2048
    assert eager["scale"].item() == 2048.0
    assert eager["flags"].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert all(s.item() == 10.0 for s in eager["st"])  # 12 steps, 2 skipped
