"""The sharded gradient pass (fusedamp._C.ShardedGradStats) on its own, every device: the
gradients of three parameters split into "ranks" (row chunks, as FSDP2 shards them), each
rank's pass reduced by summing and maximising its tensors here (what fsdp.py's collectives do),
against one scaler that saw the whole gradients. A rank that holds no gradients joins with
neutral values and ends with the same record."""
import pytest
import torch

import fusedamp
from fusedamp import _C

SHAPES = [(6, 4), (5,), (7, 3)]


def full_grads(device):
    g = torch.Generator().manual_seed(7)
    grads = [(torch.randn(s, generator=g) * 300).to(device, torch.float16) for s in SHAPES]
    grads[0][1:3].zero_()                 # zeros in the first rank's rows only
    grads[0][4, 1] = 1e-6                 # FP16-subnormal, in the last rank's rows
    grads[2][5, 2] = float("inf")         # the first non-finite parameter is the third...
    grads[1][0] = 60000.0                 # ...and amax sits in the first rank's rows
    return grads


def chunks(t, ranks, r):
    parts = torch.chunk(t, ranks, dim=0)
    return parts[r].clone() if r < len(parts) else t.new_empty((0,) + tuple(t.shape[1:]))


def scaler_on(device):
    scaler = fusedamp.GradScaler(device, init_scale=256.0)
    scaler.scale(torch.ones((), device=device))  # creates the scale, as a first loss does
    return scaler


def sharded_records(device, ranks, empty_rank=None, grads=None):
    """Each rank's scaler record after unscale_ of its shards of `grads` (full_grads()), the
    passes reduced here; and each rank's scale after the update."""
    grads = full_grads(device) if grads is None else grads
    holders = [r for r in range(ranks) if r != empty_rank]
    scalers, passes, named = [], [], []
    for r in range(ranks):
        params = []
        if r != empty_rank:
            for g in grads:
                shard = chunks(g, len(holders), holders.index(r))
                p = torch.zeros_like(shard)
                p.grad = shard
                params.append(p)
        scaler = scaler_on(device)
        pass_stats = _C.ShardedGradStats(scaler._engine)
        scaler._engine.unscale_(1, params, pass_stats)
        scalers.append(scaler)
        passes.append(pass_stats)
        named.append([(f"p{i}", p) for i, p in enumerate(params)])
    sums = torch.stack([p.sums() for p in passes]).sum(0)
    maxima = torch.stack([p.maxima() for p in passes]).amax(0)
    elements = sum(g.numel() for g in grads)
    for pass_stats in passes:
        pass_stats.sums().copy_(sums)
        pass_stats.maxima().copy_(maxima)
        pass_stats.finish(elements)
    logs = []
    for scaler, names in zip(scalers, named):
        scaler._engine.end_step(1)
        scaler.update()
        logs.append(scaler.telemetry(names))
    return logs, [s.get_scale() for s in scalers]


def whole_record(device):
    grads = full_grads(device)
    params = []
    for g in grads:
        p = torch.zeros_like(g)
        p.grad = g.clone()
        params.append(p)
    scaler = scaler_on(device)
    scaler._engine.unscale_(1, params)
    scaler._engine.end_step(1)
    scaler.update()
    return scaler.telemetry([(f"p{i}", p) for i, p in enumerate(params)]), scaler.get_scale()


@pytest.mark.parametrize("ranks,empty_rank", [(2, None), (3, None), (3, 1)])
def test_reduced_passes_give_every_rank_the_whole_record(device, ranks, empty_rank):
    want, want_scale = whole_record(device)
    logs, scales = sharded_records(device, ranks, empty_rank)
    assert want["found_inf"] == [True] and want["first_nonfinite"] == ["p2"]
    for r, (log, scale) in enumerate(zip(logs, scales)):
        assert scale == want_scale == 128.0  # every rank backs off on the one rank's inf
        for key in ("step", "scale", "found_inf", "amax", "underflow_fraction",
                    "subnormal_fraction", "grad_norm"):
            assert log[key] == want[key], key
        # A rank without gradients has no parameter to name, nor a gradient dtype.
        assert log["first_nonfinite"] == ([None] if r == empty_rank else ["p2"])
        assert log["dtype_max"] == (float("inf") if r == empty_rank else want["dtype_max"])
    assert want["amax"] == [60000.0] and 0 < want["subnormal_fraction"][0]
    assert want["underflow_fraction"][0] > want["subnormal_fraction"][0]


def test_finite_passes_give_the_global_norm(device):
    """Without an overflow: the norm from the summed squares equals one process's (the FP32
    partial sums are added in FP64, one process sums in FP32: rounding apart)."""
    grads = full_grads(device)
    grads[2][5, 2] = 1.0
    want_sq = sum(g.double().square().sum().item() for g in grads)
    logs, _ = sharded_records(device, 2, grads=grads)
    for log in logs:
        assert log["found_inf"] == [False]
        assert log["grad_norm"][0] == pytest.approx(want_sq ** 0.5 / 256.0, rel=1e-6)


def test_a_pass_is_reduced_once_and_misuse_is_refused(device):
    scaler = scaler_on(device)
    pass_stats = _C.ShardedGradStats(scaler._engine)
    with pytest.raises(RuntimeError, match="no pass yet"):
        pass_stats.sums()
    p = torch.zeros(3, device=device)
    p.grad = torch.ones(3, device=device)
    scaler._engine.unscale_(1, [p], pass_stats)
    with pytest.raises(RuntimeError, match="holds one pass"):
        pass_stats.seed(torch.zeros(1, device=device))
    no_record = _C.ShardedGradStats()
    no_record.seed(torch.zeros(1, device=device))
    assert no_record.maxima() is None and no_record.sums().shape == (2,)
