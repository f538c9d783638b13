"""CUDA against the CPU kernels (and torch's CUDA kernel) for the ops the loss scaler runs:
unscale_and_check_ and grad_stats_ over mixed dtypes, odd offsets, several chunks and non-finite
values; grad_stats_'s telemetry over 10^8 elements and across GPUs; update_scale_ with and
without the amax policy. Every op runs with host synchronisation forbidden."""
import functools

import pytest
import torch

from cuda_helpers import ALL, SIZES, assert_same, cuda_call, on_both, rand
from op_helpers import needs_cuda, ops
from op_inputs import op_inputs

pytestmark = needs_cuda


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
