"""grad_stats_'s telemetry (amax, subnormal and zero counts, first non-finite grad) against a
torch reference computed separately, on every device, for FP16/BF16/FP32 grads and the grads
the op walks per tensor (FP64, non-dense); and update_scale_'s amax policy against the rule
written out in Python."""
import math

import pytest
import torch

from op_helpers import ops

INF = float("inf")


def reference(grads):
    """amax (largest finite |g|), subnormal count (nonzero, below the dtype's smallest normal),
    zero count, position of the first grad holding inf/NaN (inf: none) — in FP64, per grad."""
    amax, subnormal, zero, first = 0.0, 0, 0, INF
    for i, g in enumerate(grads):
        x = g.detach().to(torch.float64)
        finite = torch.isfinite(x)
        if x.numel():
            amax = max(amax, x.abs().where(finite, 0.0).max().item())
        tiny = torch.finfo(g.dtype).tiny
        subnormal += int(((x.abs() < tiny) & (x != 0)).sum())
        zero += int((x == 0).sum())
        if not bool(finite.all()) and first == INF:
            first = float(i)
    return [amax, float(subnormal), float(zero), first]


def grads_with_extremes(device, dtype, sizes, seed):
    """Random grads with zeros, subnormals of `dtype` and values near its maximum planted."""
    gen = torch.Generator().manual_seed(seed)
    tiny = torch.finfo(dtype).tiny
    grads = []
    for k, n in enumerate(sizes):
        x = torch.randn(n, generator=gen, dtype=torch.float64) * 10.0 ** (k % 5 - 2)
        picks = torch.randperm(n, generator=gen)
        x[picks[: n // 7]] = 0.0
        x[picks[n // 7: n // 7 + n // 5]] = tiny * torch.rand(n // 5, generator=gen,
                                                               dtype=torch.float64) * 0.9
        if k == 2:
            x[picks[-1]] = float(torch.finfo(dtype).max) * 0.75
        grads.append(x.to(dtype).to(device))
    return grads


def run(grads, device, seed_telemetry=None):
    found = torch.zeros(1, device=device)
    sum_sq = torch.zeros(1, device=device)
    telemetry = torch.tensor(seed_telemetry or [0.0, 0.0, 0.0, INF], dtype=torch.float64,
                             device=device)
    ops.grad_stats_(grads, found, sum_sq, None, telemetry)
    return telemetry.tolist(), found.item()


SIZES = [1, 7, 33, 4096 + 5, 70_000, 0, 3]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_telemetry_matches_reference(device, dtype):
    grads = grads_with_extremes(device, dtype, SIZES, seed=1)
    got, found = run(grads, device)
    want = reference(grads)
    assert found == 0.0
    assert want[1] > 0 and want[2] > 0  # the planted values are really there
    assert got == want


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_telemetry_first_nonfinite_and_finite_amax(device, dtype):
    grads = grads_with_extremes(device, dtype, SIZES, seed=2)
    grads[4][123] = float("nan")
    grads[6][1] = -INF
    grads[5] = torch.full((0,), INF, dtype=dtype, device=device)  # empty: nothing to see
    got, found = run(grads, device)
    assert found == 1.0
    want = reference(grads)
    assert want[3] == 4.0
    assert got == want


def test_telemetry_accumulates_over_calls(device):
    """Seeded values combine as documented: max, sums, min."""
    grads = grads_with_extremes(device, torch.float16, [100, 300], seed=3)
    got, _ = run(grads, device, seed_telemetry=[1e9, 5.0, 7.0, 1.0])
    want = reference(grads)
    assert got == [1e9, want[1] + 5.0, want[2] + 7.0, 1.0]
    grads[0][0] = INF
    got, _ = run(grads, device, seed_telemetry=[0.0, 0.0, 0.0, 9.0])
    assert got[3] == 0.0


def test_telemetry_seeded_below_zero_combines_by_value(device):
    """Slots may hold negative values (the engine shifts an earlier pass's first non-finite
    position below zero): max and min compare them as numbers on every device (on CUDA the
    atomics compare the doubles' bits as signed integers, which keeps that order)."""
    grads = grads_with_extremes(device, torch.float16, [100, 300], seed=4)
    grads[1][5] = INF
    got, found = run(grads, device, seed_telemetry=[-1.0, 0.0, 0.0, -7.0])
    want = reference(grads)
    assert found == 1.0 and want[0] > 0
    assert got[0] == want[0]  # the measured amax, not the seed below zero
    assert got[3] == -7.0     # the earlier pass's position stays the first
    got, _ = run(grads, device, seed_telemetry=[-1.0, 0.0, 0.0, INF])
    assert got[3] == 1.0      # a fresh record: this pass's first


def test_telemetry_mixed_dtypes_and_per_tensor_grads(device):
    """FP64 and non-dense grads take the per-tensor path; positions stay the list's."""
    fp16 = grads_with_extremes(device, torch.float16, [50, 60], seed=4)
    fp64 = grads_with_extremes(device, torch.float64, [40], seed=5)[0]
    strided = grads_with_extremes(device, torch.float32, [80], seed=6)[0][::2]
    bf16 = grads_with_extremes(device, torch.bfloat16, [90], seed=7)[0]
    grads = [fp16[0], fp64, strided, bf16, fp16[1]]
    got, _ = run(grads, device)
    assert got == reference(grads)
    strided[3] = INF
    bf16[0] = float("nan")
    got, _ = run(grads, device)
    assert got[3] == 2.0 and got == reference(grads)
    fp16[1][5] = INF  # a later fused grad does not move the first position
    got, _ = run([fp16[0], bf16, fp16[1]], device)
    assert got[3] == 1.0


def test_telemetry_bad_argument_changes_nothing(device):
    grads = grads_with_extremes(device, torch.float16, [10], seed=8)
    found = torch.zeros(1, device=device)
    sum_sq = torch.zeros(1, device=device)
    for bad, words in [(torch.zeros(4, device=device), "float64"),
                       (torch.zeros(3, dtype=torch.float64, device=device), "4 elements"),
                       (torch.zeros(8, dtype=torch.float64, device=device)[::2], "contiguous")]:
        before = bad.clone()
        with pytest.raises(RuntimeError, match=words):
            ops.grad_stats_(grads, found, sum_sq, None, bad)
        assert torch.equal(bad, before) and found.item() == 0 and sum_sq.item() == 0


# ---- update_scale_'s amax policy ------------------------------------------------------------

def amax_rule(scale, growth, hyst, found_inf, amax, target, *, growth_factor=2.0,
              backoff=0.5, interval=2000, hysteresis=1, min_scale=None, max_scale=None):
    """math/scale_math.h's update_scale with amax_target, in Python (FP32 scale via torch)."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).item()  # noqa: E731
    measured = amax >= 0 and math.isfinite(amax)  # negative: not measured

    def target_scale():
        e = math.frexp(target * scale / amax)[1] - 1
        return f32(2.0 ** max(-126, min(127, e)))

    if found_inf:
        growth, hyst = 0, max(hyst - 1, 0)
        if hyst <= 0:
            s = f32(scale * backoff)
            amax = max(amax, 65504.0) if measured else 65504.0  # what an overflow proves
            s = min(s, target_scale())
            if min_scale is not None:
                s = max(s, min_scale)
            scale = s
        return scale, growth, hyst
    if measured:
        amax = amax if amax > 0 else 2.0 ** -24  # all zero: all were below FP16's subnormals
        s = target_scale()
        if max_scale is not None:
            s = min(s, max_scale)
        if min_scale is not None:
            s = max(s, min_scale)
        return s, 0, (hysteresis if s > scale else hyst)  # a growth refills the hysteresis
    if growth + 1 == interval:
        s = f32(scale * growth_factor)
        if max_scale is not None:
            s = min(s, max_scale)
        return (s if math.isfinite(s) else scale), 0, hysteresis
    return scale, growth + 1, hyst


@pytest.mark.parametrize("bounds", [{}, dict(min_scale=4.0, max_scale=2.0 ** 20)])
@pytest.mark.parametrize("hysteresis", [1, 2])
def test_amax_policy_follows_rule(device, bounds, hysteresis):
    gen = torch.Generator().manual_seed(11)
    scale = torch.tensor([2.0 ** 16], device=device)
    growth = torch.zeros(1, dtype=torch.int32, device=device)
    hyst = torch.full((1,), hysteresis, dtype=torch.int32, device=device)
    found = torch.zeros(1, device=device)
    amax = torch.zeros(1, dtype=torch.float64, device=device)
    state = (2.0 ** 16, 0, hysteresis)
    target = 65504.0 / 2 ** 8
    for step in range(300):
        overflow = torch.rand((), generator=gen).item() < 0.2
        kind = step % 8
        value = {0: 0.0, 1: -1.0}.get(kind, float(torch.rand((), generator=gen)) * 10.0 ** (kind - 4))
        found.fill_(1.0 if overflow else 0.0)
        amax.fill_(value)
        ops.update_scale_(scale, growth, hyst, found, 2.0, 0.5, 3, hysteresis,
                          bounds.get("min_scale"), bounds.get("max_scale"), amax, target)
        state = amax_rule(*state, overflow, value, target, interval=3, hysteresis=hysteresis,
                          **bounds)
        assert (scale.item(), growth.item(), hyst.item()) == state, step


def test_amax_policy_moves_to_the_measured_power_of_two(device):
    scale = torch.tensor([1.0], device=device)
    growth = torch.zeros(1, dtype=torch.int32, device=device)
    hyst = torch.ones(1, dtype=torch.int32, device=device)
    found = torch.zeros(1, device=device)
    # Gradients of magnitude 1e-3 at scale 1, target 256: 1e-3 * 2^17 = 131 <= 256 < 262 =
    # 1e-3 * 2^18, so the largest power of two that keeps amax under the target is 2^17.
    amax = torch.tensor([1e-3], dtype=torch.float64, device=device)
    ops.update_scale_(scale, growth, hyst, found, 2.0, 0.5, 2000, 1, None, None, amax, 256.0)
    assert scale.item() == 2.0 ** 17
    # An overflow proves some gradient passed 65504 at 2^17: the scale drops to where that would
    # sit under the target, far more than halving (65504 / 2^17 * 2^9 = 255.9 <= 256).
    found.fill_(1.0)
    amax.fill_(0.0)  # nothing finite measured
    ops.update_scale_(scale, growth, hyst, found, 2.0, 0.5, 2000, 1, None, None, amax, 256.0)
    assert scale.item() == 2.0 ** 9
    # A larger finite amax (FP32 gradients) says more: 2^20 at 2^9 -> 2^-3 (2^20 / 2^12 = 256).
    amax.fill_(2.0 ** 20)
    ops.update_scale_(scale, growth, hyst, found, 2.0, 0.5, 2000, 1, None, None, amax, 256.0)
    assert scale.item() == 2.0 ** -3
    # A clean step with every gradient zero: all were below 2^-24, so x 2^32 keeps them <= 256.
    found.fill_(0.0)
    amax.fill_(0.0)
    ops.update_scale_(scale, growth, hyst, found, 2.0, 0.5, 2000, 1, None, None, amax, 256.0)
    assert scale.item() == 2.0 ** 29
    # Not measured (negative amax): torch's rule, growth_tracker counts.
    amax.fill_(-1.0)
    ops.update_scale_(scale, growth, hyst, found, 2.0, 0.5, 2000, 1, None, None, amax, 256.0)
    assert scale.item() == 2.0 ** 29 and growth.item() == 1


def test_amax_policy_argument_errors_change_nothing(device):
    scale = torch.tensor([8.0], device=device)
    growth = torch.zeros(1, dtype=torch.int32, device=device)
    hyst = torch.ones(1, dtype=torch.int32, device=device)
    found = torch.zeros(1, device=device)
    amax32 = torch.ones(1, device=device)
    amax = torch.ones(1, dtype=torch.float64, device=device)
    for kwargs, words in [(dict(amax=amax), "without amax_target"),
                          (dict(amax_target=4.0), "needs amax"),
                          (dict(amax=amax, amax_target=-1.0), "amax_target must be"),
                          (dict(amax=amax32, amax_target=4.0), "amax")]:
        with pytest.raises(RuntimeError, match=words):
            ops.update_scale_(scale, growth, hyst, found, 2.0, 0.5, 2000, **kwargs)
        assert scale.item() == 8.0 and growth.item() == 0 and hyst.item() == 1


# ---- unscale_and_check_ with statistics: grad_stats_'s pass that also unscales ----------------

@pytest.mark.parametrize("mix", ["fused", "with per-tensor grads"])
def test_unscale_with_stats_is_grad_stats_then_unscale(device, mix):
    """One pass gives exactly what grad_stats_ gives of the scaled values and leaves exactly
    what the plain unscale leaves."""
    grads = grads_with_extremes(device, torch.float16, SIZES, seed=9)
    grads += grads_with_extremes(device, torch.bfloat16, [300, 5], seed=10)
    if mix != "fused":
        grads += [grads_with_extremes(device, torch.float64, [40], seed=11)[0],
                  grads_with_extremes(device, torch.float32, [90], seed=12)[0][::3]]
    grads[4][17] = INF
    inv = torch.tensor([2.0 ** -7], device=device)

    want_telemetry, want_found = run([g.clone() for g in grads], device)
    want_sum_sq = torch.zeros(1, device=device)
    ops.grad_stats_([g.clone() for g in grads], torch.zeros(1, device=device), want_sum_sq)
    plain = [g.clone() for g in grads]
    ops.unscale_and_check_(plain, torch.zeros(1, device=device), inv)

    found = torch.zeros(1, device=device)
    sum_sq = torch.zeros(1, device=device)
    telemetry = torch.tensor([0.0, 0.0, 0.0, INF], dtype=torch.float64, device=device)
    ops.unscale_and_check_(grads, found, inv, sum_sq, telemetry)
    assert found.item() == want_found == 1.0
    assert telemetry.tolist() == want_telemetry
    assert sum_sq.item() == want_sum_sq.item()
    for got, want in zip(grads, plain):
        assert torch.equal(got, want)


def test_unscale_telemetry_needs_sum_sq(device):
    grads = grads_with_extremes(device, torch.float16, [10], seed=13)
    before = [g.clone() for g in grads]
    telemetry = torch.zeros(4, dtype=torch.float64, device=device)
    with pytest.raises(RuntimeError, match="telemetry needs sum_sq"):
        ops.unscale_and_check_(grads, torch.zeros(1, device=device),
                               torch.ones(1, device=device), None, telemetry)
    assert all(torch.equal(a, b) for a, b in zip(grads, before))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("unscale", [False, True], ids=["grad_stats", "unscale_and_check"])
def test_telemetry_edges_at_every_length_and_offset(device, dtype, unscale):
    """The edge values of a 16-bit format (-0, the smallest normal and the largest subnormal,
    the largest finite, inf, NaN), and an overflowing grad whose finite maximum is the largest
    of all, at every length around the vector widths and at odd offsets of a longer grad."""
    info = torch.finfo(dtype)
    edges = torch.tensor([-0.0, info.tiny, -info.tiny, info.tiny * (1 - info.eps), 1.0,
                          -info.max * 0.5, info.max, -info.max], dtype=torch.float64)
    for n in list(range(1, 100)) + [4096 + 33]:
        for overflow in [None, INF, float("nan")]:
            x = torch.linspace(-3, 3, n, dtype=torch.float64).to(dtype)
            spots = torch.arange(len(edges)) * 7 % n
            x[spots] = edges[: len(spots)].to(dtype)
            if overflow is not None:
                x[(n * 5) // 9] = overflow
            long = torch.zeros(n + 37, dtype=dtype)
            long[13: 13 + n] = x
            for g in [x, long[13: 13 + n]]:
                grads = [g.to(device)]
                want = reference(grads)
                found = torch.zeros(1, device=device)
                telemetry = torch.tensor([0.0, 0.0, 0.0, INF], dtype=torch.float64,
                                         device=device)
                if unscale:
                    ops.unscale_and_check_(grads, found, torch.ones(1, device=device),
                                           torch.zeros(1, device=device), telemetry)
                else:
                    ops.grad_stats_(grads, found, torch.zeros(1, device=device), None,
                                    telemetry)
                assert telemetry.tolist() == want, (n, overflow)
                assert found.item() == float(overflow is not None), (n, overflow)
