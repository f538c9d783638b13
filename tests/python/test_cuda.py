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
import functools

import pytest
import torch

from op_helpers import ops
from op_inputs import op_inputs

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
    cpu, cuda = on_both(op_inputs("cpu", grads=src, scalars=dict(
        found_inf=0.0, grad_sum_sq=2.5, tensor_flags=0.0, inv_scale=3.0 / 1024.0)),
        {"grads": offset})

    before = [t.clone() for t in cuda.grads]
    cpu.call("grad_stats_")
    cuda_call(cuda.call, "grad_stats_")
    assert cuda.found_inf.item() == cpu.found_inf.item() == (1.0 if poison else 0.0)
    assert cuda.tensor_flags.cpu().tolist() == cpu.tensor_flags.tolist()
    if not poison:
        torch.testing.assert_close(cuda.grad_sum_sq.cpu(), cpu.grad_sum_sq, rtol=1e-5, atol=0)
    for t, t0 in zip(cuda.grads, before):  # grad_stats_ is read-only
        assert torch.equal(t.view(torch.uint8), t0.view(torch.uint8))

    cpu.call("unscale_and_check_")
    cuda_call(cuda.call, "unscale_and_check_")
    assert cuda.found_inf.item() == cpu.found_inf.item()
    assert_same(cuda.grads, cpu.grads, exact=True)  # one FP32 multiply per element: bit-exact


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
def _adam_problem(pdtype, gdtype, master, gen):
    """One Adam problem on the CPU with non-zero state. Per size, in this order of draws: the
    weight, the grad, both moments, and a step count of i % 5."""
    draws = [(rand(s, torch.float32, gen), rand(s, gdtype, gen, scale=64.0),
              rand(s, torch.float32, gen, scale=0.1),
              rand(s, torch.float32, gen, scale=0.01, positive=True)) for s in SIZES]
    weights, grads, m, v = (list(x) for x in zip(*draws))
    inp = op_inputs("cpu", param_dtype=pdtype, master_weights=master, weights=weights,
                    grads=grads, scalars=dict(lr_tensor=2e-3, inv_scale=1 / 64.0, found_inf=0.0,
                                              grad_sum_sq=4.0e8))  # the clip is active
    inp.exp_avgs, inp.exp_avg_sqs = m, v
    inp.steps = [torch.full((), float(i % 5)) for i in range(len(SIZES))]
    return inp


@pytest.mark.parametrize("pdtype", ALL, ids=dtype_id)
@pytest.mark.parametrize("grad_fp32", [False, True])
@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("offsets", [{}, {"grads": 1},
                                     {"params": 3, "master_params": 1, "exp_avgs": 2,
                                      "exp_avg_sqs": 5}, {"grads": 4}],
                         ids=["aligned", "grad+1", "all-odd", "grad+4"])
def test_adam_matches_cpu(pdtype, grad_fp32, master, offsets):
    if master and pdtype == torch.float32 and offsets:
        pytest.skip("FP32 master weights for FP32 params: covered by the aligned case")
    gen = torch.Generator().manual_seed(21)
    gdtype = torch.float32 if grad_fp32 else pdtype
    cpu, cuda = on_both(_adam_problem(pdtype, gdtype, master, gen), offsets)
    for step, (wd, decoupled, maximize) in enumerate([(0.01, True, False), (0.1, False, True),
                                                       (0.0, True, False)]):
        kw = dict(lr=1e-3, beta1=0.9, beta2=0.995, eps=1e-8, weight_decay=wd,
                  decoupled_weight_decay=decoupled, maximize=maximize)
        if step != 2:
            kw.update(max_grad_norm=1.0)
        else:  # a plain step: none of the device scalars
            kw.update(lr_tensor=None, inv_scale=None, found_inf=None)
        cpu.call("adam_step_", **kw)
        cuda_call(cuda.call, "adam_step_", **kw)
    # FP32 state: the same formula, only FMA contraction differs.
    tol = state_tol(pdtype, master)
    assert_same(cuda.exp_avgs, cpu.exp_avgs, **tol)
    assert_same(cuda.exp_avg_sqs, cpu.exp_avg_sqs, **tol)
    assert_same(cuda.master_params, cpu.master_params, **tol)
    # Low-precision params may differ by one rounding step where FP32 values straddle it.
    assert_same(cuda.params, cpu.params, **({"rtol": 1e-5, "atol": 1e-6}
                                            if pdtype == torch.float32 else {}))
    assert_same(cuda.steps, cpu.steps, exact=True)
    if master:
        for p, mp in zip(cuda.params, cuda.master_params):
            assert torch.equal(p, mp.to(pdtype))


def test_adam_channels_last_layout():
    gen = torch.Generator().manual_seed(5)
    p = rand((4, 6, 5, 7), torch.float32, gen).contiguous(memory_format=torch.channels_last)
    g = rand((4, 6, 5, 7), torch.float32, gen).contiguous(memory_format=torch.channels_last)
    res = {}
    for dev in ["cpu", "cuda"]:
        # Each device starts from its own copy of p (op_inputs copies weights and grads).
        inp = op_inputs(dev, weights=[p], grads=[g])
        fn = cuda_call if dev == "cuda" else (lambda op, *a, **k: op(*a, **k))
        for _ in range(3):
            fn(inp.call, "adam_step_", lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=0.0, decoupled_weight_decay=True)
        res[dev] = inp.params[0]
    assert res["cuda"].is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(res["cuda"].cpu(), res["cpu"], rtol=1e-5, atol=1e-6)


def test_shared_step_tensor_counts_like_cpu():
    # The CPU adds 1 per list entry; the CUDA follow-up kernel must not lose increments.
    out = {}
    for dev in ["cpu", "cuda"]:
        ones = [torch.ones(5)] * 4
        inp = op_inputs(dev, weights=ones, grads=ones, moments=False)
        inp.steps = [torch.zeros((), device=dev)] * 4  # one step tensor for every entry
        fn = cuda_call if dev == "cuda" else (lambda op, *a, **k: op(*a, **k))
        fn(inp.call, "sgd_step_", lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0,
           nesterov=False)
        out[dev] = inp.steps[0].item()
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
        inp = op_inputs("cpu", param_dtype=pdtype, master_weights=master, moments=False,
                        momentum=cfg["momentum"] != 0, weights=p32, grads=[],  # drawn per step
                        scalars=dict(inv_scale=0.5))
        offsets = {"params": off, "master_params": 2 * off, "momentum_buffers": 3 * off}
        cpu, cuda = on_both(inp, offsets)
        for step in range(3):  # step 0 initialises the momentum buffers
            grads = [rand(s, gdtype, gen) for s in SIZES]
            cpu.grads = [place(g, "cpu", off) for g in grads]
            cuda.grads = [place(g, "cuda", off) for g in grads]
            cpu.call("sgd_step_", lr=0.05, maximize=step == 1, **cfg)
            cuda_call(cuda.call, "sgd_step_", lr=0.05, maximize=step == 1, **cfg)
        assert_same(cuda.momentum_buffers, cpu.momentum_buffers, **state_tol(pdtype, master))
        assert_same(cuda.master_params, cpu.master_params, **state_tol(pdtype, master))
        assert_same(cuda.params, cpu.params, **({"rtol": 1e-5, "atol": 1e-6}
                                                if pdtype == torch.float32 else {}))
        assert_same(cuda.steps, cpu.steps, exact=True)


@pytest.mark.parametrize("pdtype", LOW, ids=dtype_id)
def test_edit_adoption_is_bit_exact_against_cpu(pdtype):
    """Masters whose weights were edited between steps (clamped, zeroed, replaced): the CUDA step
    takes the same edits into the same masters as the CPU, bit for bit (SGD with lr=1 and no
    momentum or decay: one subtraction, no contraction for the compilers to differ on)."""
    gen = torch.Generator().manual_seed(17)
    sizes = [(40_000,), (33, 17), (5,)]
    weights = [rand(s, torch.float32, gen) for s in sizes]
    grads = [rand(s, pdtype, gen, scale=1e-3) for s in sizes]
    base = op_inputs("cpu", param_dtype=pdtype, master_weights=True, momentum=False,
                     weights=weights, grads=grads, scalars=dict(found_inf=0.0))
    cpu, cuda = on_both(base)
    for inp in (cpu, cuda):
        with torch.no_grad():
            inp.params[0].clamp_(-0.5, 0.5)
            inp.params[1][::3] = 0.0
            inp.params[2].copy_(torch.tensor([1.0, -2.0, 3.0, 0.0, 0.25]).to(pdtype))
    for _ in range(2):
        cpu.call("sgd_step_", lr=1.0, inv_scale=None, lr_tensor=None)
        cuda_call(cuda.call, "sgd_step_", lr=1.0, inv_scale=None, lr_tensor=None)
    assert_same(cuda.master_params, cpu.master_params, exact=True)
    assert_same(cuda.params, cpu.params, exact=True)


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
    cpu = op_inputs("cpu", param_dtype=torch.float16, master_weights=True, momentum=True,
                    weights=p32, grads=grads, scalars=dict(found_inf=0.0, grad_sum_sq=0.0,
                                                           tensor_flags=0.0, inv_scale=1 / 128.0))
    cuda = cpu.map(lambda _, t: t.cuda())

    cpu.call("grad_stats_")
    cuda_call(cuda.call, "grad_stats_")
    assert cuda.found_inf.item() == 1.0
    assert torch.nonzero(cuda.tensor_flags).flatten().tolist() == [4321]
    assert torch.equal(cuda.tensor_flags.cpu(), cpu.tensor_flags)

    grads[4321][0] = 1.0
    cpu.grads, cuda.grads = [g.clone() for g in grads], [g.cuda() for g in grads]
    cpu.found_inf.zero_()
    cuda.found_inf.zero_()
    cpu.call("unscale_and_check_")
    cuda_call(cuda.call, "unscale_and_check_")
    assert cuda.found_inf.item() == cpu.found_inf.item() == 0.0
    assert_same(cuda.grads, cpu.grads, exact=True)

    for _ in range(2):  # the grads are unscaled already: found_inf only
        cpu.call("adam_step_", inv_scale=None)
        cuda_call(cuda.call, "adam_step_", inv_scale=None)
    assert_same(cuda.master_params, cpu.master_params, rtol=1e-5, atol=1e-6)
    assert_same(cuda.exp_avgs, cpu.exp_avgs, rtol=1e-5, atol=1e-7)
    assert_same(cuda.params, cpu.params)
    assert torch.stack(cuda.steps).eq(2).all()

    sgd_kw = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
                  inv_scale=None, found_inf=None)
    cpu.call("sgd_step_", **sgd_kw)
    cuda_call(cuda.call, "sgd_step_", **sgd_kw)
    assert_same(cuda.momentum_buffers, cpu.momentum_buffers, rtol=1e-5, atol=1e-6)
    assert_same(cuda.master_params, cpu.master_params, rtol=1e-5, atol=1e-6)
    assert torch.stack(cuda.steps).eq(3).all()


# ------------------------------------------------------------ update_scale_
def test_update_scale_matches_cpu_and_torch():
    gen = torch.Generator().manual_seed(3)
    seq = (torch.rand(500, generator=gen) < 0.2).tolist()
    st = {dev: op_inputs(dev, [], loss_scale=2.0 ** 16, hysteresis=2) for dev in ["cpu", "cuda"]}
    founds = {dev: [torch.full((1,), float(f), device=dev) for f in seq] for dev in st}
    kw = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=7, hysteresis=2,
              min_scale=1.0, max_scale=2.0 ** 20)
    for i in range(len(seq)):
        st["cpu"].call("update_scale_", found_inf=founds["cpu"][i], **kw)
        cuda_call(st["cuda"].call, "update_scale_", found_inf=founds["cuda"][i], **kw)
    for (name, a), (_, b) in zip(st["cuda"].named_tensors(), st["cpu"].named_tensors()):
        assert torch.equal(a.cpu(), b), name
    # hysteresis 1, no bounds, non-power-of-two factors: torch's CUDA kernel, bit for bit.
    mine, ref = (op_inputs("cuda", [], loss_scale=2.0 ** 16) for _ in range(2))
    for i in range(len(seq)):
        cuda_call(mine.call, "update_scale_", found_inf=founds["cuda"][i], growth_factor=1.7,
                  backoff_factor=0.3, growth_interval=3)
        torch._amp_update_scale_(ref.scale, ref.growth_tracker, founds["cuda"][i], 1.7, 0.3, 3)
    assert torch.equal(mine.scale, ref.scale)
    assert torch.equal(mine.growth_tracker, ref.growth_tracker)


def test_telemetry_of_1e8_elements_is_exact_and_repeatable():
    """grad_stats_'s telemetry over 10^8 FP16 elements (3,052 chunks, every block's atomics):
    two runs bitwise equal, counts exact against torch's own reductions."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    sizes = [60_000_000, 40_000_000]
    grads = [torch.randn(n, generator=gen, device="cuda").to(torch.float16) for n in sizes]
    grads[0][::7] = 0.0
    grads[1][::5] = 2.0 ** -20  # subnormal in FP16
    runs = []
    for _ in range(2):
        telemetry = torch.tensor([0.0, 0.0, 0.0, float("inf")], dtype=torch.float64,
                                 device="cuda")
        cuda_call(ops.grad_stats_, grads, torch.zeros(1, device="cuda"),
                  torch.zeros(1, device="cuda"), None, telemetry)
        runs.append(telemetry.cpu())
    assert torch.equal(runs[0], runs[1])
    tiny = 2.0 ** -14  # FP16's smallest normal
    zeros = sum(int((g == 0).sum()) for g in grads)
    subnormal = sum(int(((g != 0) & (g.abs() < tiny)).sum()) for g in grads)
    amax = max(float(g.abs().max()) for g in grads)
    assert runs[0].tolist() == [amax, float(subnormal), float(zeros), float("inf")]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_telemetry_of_grads_on_another_gpu_than_the_scaler():
    """The scaler's state on cuda:0, the parameters and grads on cuda:1: the record is the
    gradients' own statistics (the pass runs on cuda:1 and is combined on cuda:0)."""
    import fusedamp

    gen = torch.Generator().manual_seed(23)
    grad = (torch.randn(5000, generator=gen) * 8.0).to(torch.float16)
    grad[::9] = 0.0
    p = torch.nn.Parameter(torch.zeros(5000, dtype=torch.float16, device="cuda:1"))
    opt = fusedamp.optim.SGD([p], lr=0.1)
    scaler = fusedamp.GradScaler("cuda:0", init_scale=8.0)
    scaler.scale(torch.ones((), device="cuda:0"))
    p.grad = grad.to("cuda:1")
    scaler.step(opt)
    scaler.update()
    log = scaler.telemetry()
    assert log["amax"] == [grad.abs().max().item()]
    assert log["underflow_fraction"] == [float((grad.abs() < 2.0 ** -14).sum()) / 5000]
    assert log["found_inf"] == [False]


@pytest.mark.parametrize("amax", [0.0, 2.0 ** -30, 1.0, 70000.0])
@pytest.mark.parametrize("found", [0.0, 1.0])
def test_amax_policy_matches_cpu(amax, found):
    """The amax policy's scale update on CUDA against the CPU op, at amax 0 (all gradients
    zero), tiny, ordinary and above FP16's 65504, with and without an overflow."""
    st = {dev: op_inputs(dev, [], loss_scale=2.0 ** 12) for dev in ["cpu", "cuda"]}
    for dev, s in st.items():
        call = s.call if dev == "cpu" else functools.partial(cuda_call, s.call)
        call("update_scale_", found_inf=torch.full((1,), found, device=dev), growth_factor=2.0,
             backoff_factor=0.5, growth_interval=2000,
             amax=torch.tensor([amax], dtype=torch.float64, device=dev), amax_target=256.0)
    for (name, a), (_, b) in zip(st["cuda"].named_tensors(), st["cpu"].named_tensors()):
        assert torch.equal(a.cpu(), b), name


# ------------------------------------------------------------ devices and streams
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_runs_on_the_tensors_device():
    inp = op_inputs("cuda:1", [(1000,)], moments=False)
    ref = inp.params[0].cpu()
    with torch.cuda.device(0):
        cuda_call(inp.call, "sgd_step_", lr=0.5, momentum=0.0, dampening=0.0, weight_decay=0.0,
                  nesterov=False)
    torch.testing.assert_close(inp.params[0].cpu(), ref - 0.5 * inp.grads[0].cpu())


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
    return op_inputs("cuda", param_dtype=pdtype, master_weights=True,
                     weights=[rand(s, torch.float32, gen) for s in sizes],
                     grads=[torch.zeros(s, dtype=pdtype) for s in sizes], loss_scale=2.0 ** 10,
                     scalars=dict(found_inf=0.0, grad_sum_sq=0.0, inv_scale=1.0, lr_tensor=1e-3,
                                  tensor_flags=0.0))


def _step(s):
    """One whole training step after backward, all on the device."""
    s.found_inf.zero_()
    s.grad_sum_sq.zero_()
    torch.reciprocal(s.scale, out=s.inv_scale)
    s.call("grad_stats_")
    s.call("adam_step_", lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
           decoupled_weight_decay=True, max_grad_norm=5.0)
    s.call("update_scale_", growth_factor=2.0, backoff_factor=0.5, growth_interval=3)


@pytest.mark.parametrize("pdtype", LOW, ids=dtype_id)
def test_whole_step_in_a_cuda_graph_equals_eager(pdtype):
    gen = torch.Generator().manual_seed(51)
    eager = _make_state(gen, pdtype)
    graphed = eager.map(lambda _, t: t.clone())

    graph = capture(_step, eager.map(lambda _, t: t.clone()), graphed)

    for it in range(12):
        grads = [rand(t.shape, torch.float32, gen, scale=2.0 ** 10).to(pdtype).cuda()
                 for t in eager.grads]
        if it in (4, 5):
            grads[2].view(-1)[7] = float("inf")  # skipped steps: scale backs off
        lr = 1e-3 * (0.9 ** it)
        for s in (eager, graphed):
            for dst, src in zip(s.grads, grads):
                dst.copy_(src)
            s.lr_tensor.fill_(lr)
        with sync_forbidden():
            _step(eager)
        graph.replay()
    torch.cuda.synchronize()

    for (name, x), (_, y) in zip(eager.named_tensors(), graphed.named_tensors()):
        assert torch.equal(x, y), name  # deterministic kernels: bit-identical
    # growth every 3 clean steps, backoff on steps 4 and 5: 1024 -> 2048 -> 1024 -> 512 ->
    # 1024 -> 2048
    assert eager.scale.item() == 2048.0
    assert eager.tensor_flags.tolist() == [0.0, 0.0, 1.0, 0.0]
    assert all(s.item() == 10.0 for s in eager.steps)  # 12 steps, 2 skipped


@pytest.mark.parametrize("store", ["split", "kahan", "stochastic"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("algorithm", ["adam", "sgd"])
def test_weight_stores_match_cpu(store, state_dtype, algorithm):
    """The 16-bit weight stores (master_weights "split", "kahan", "stochastic") on CUDA against
    the CPU kernels, several tensors, one misaligned by an element: FP32 results may differ by
    FMA contraction, so weights within one BF16 ulp, remainders rebuilding masters within FP32
    rounding, state close."""
    gen = torch.Generator().manual_seed(41)
    shapes = [(1000,), (37, 5), (1,), (70_003,)]

    def problem():
        params = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
        if store == "split":
            extra = [torch.randint(-3000, 3000, s, generator=gen, dtype=torch.int16)
                     for s in shapes]
        elif store == "kahan":
            extra = [(torch.randn(s, generator=gen) * 1e-3).bfloat16() for s in shapes]
        else:
            extra = []
        n_state = 2 if algorithm == "adam" else 1
        state = [[torch.rand(s, generator=gen).to(state_dtype) for s in shapes]
                 for _ in range(n_state)]
        return params, extra, state

    params, extra, state = problem()
    grads = [[torch.randn(s, generator=gen).bfloat16() for s in shapes] for _ in range(3)]

    def run(device):
        def to(ts):  # the last tensor starts one element into its storage: misaligned
            out = [t.to(device) for t in ts]
            if out:
                padded = torch.empty(out[-1].numel() + 1, dtype=out[-1].dtype, device=device)
                padded[1:].copy_(out[-1].reshape(-1))
                out[-1] = padded[1:].view(out[-1].shape)
            return out
        p, e, s = to(params), to(extra), [to(x) for x in state]
        steps = [torch.full((), 2.0, device=device) for _ in shapes]
        seeds = [5, 6, 7, 8] if store == "stochastic" else None
        for g in grads:
            g = to(g)
            if algorithm == "adam":
                ops.adam_step_(p, e, g, *s, steps, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.01, decoupled_weight_decay=True,
                               rounding_seeds=seeds)
            else:
                ops.sgd_step_(p, e, g, *s, steps, lr=0.05, momentum=0.9, dampening=0.0,
                              weight_decay=1e-3, nesterov=False, rounding_seeds=seeds)
        return [t.cpu() for t in p], [t.cpu() for t in e], [[t.cpu() for t in x] for x in s]

    cpu, cuda = run("cpu"), run("cuda")
    for a, b in zip(cuda[0], cpu[0]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-6)
    if store == "split":
        for pa, ea, pb, eb in zip(cuda[0], cuda[1], cpu[0], cpu[1]):
            rebuild = lambda w, r: ((w.view(torch.int16).to(torch.int32) << 16)  # noqa: E731
                                    + r.to(torch.int32)).view(torch.float32)
            torch.testing.assert_close(rebuild(pa, ea), rebuild(pb, eb), rtol=1e-5, atol=1e-6)
    tol = dict(rtol=1e-5, atol=1e-6) if state_dtype == torch.float32 else dict(rtol=2 ** -7,
                                                                               atol=1e-6)
    for xa, xb in zip(cuda[2], cpu[2]):
        for a, b in zip(xa, xb):
            torch.testing.assert_close(a.float(), b.float(), **tol)
