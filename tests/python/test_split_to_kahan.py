"""Converting a "split" or "split8" state to master_weights="kahan": the Kahan pair (BF16
weight + BF16 compensation) holds the split pair's FP32 value exactly wherever a Kahan pair can
(every split8 value of magnitude 2^-118 to BF16's largest finite, every value halfway between
two BF16 weights), and otherwise the pair a Kahan step stores for that value: the weight its
rounding to nearest even, the compensation the rest rounded to BF16 (docs/master_weights.md).

The split pair's weight rounds ties away from zero (math/split_math.h), the Kahan step's to
nearest even, so at a tie the two weights differ by one ulp: the cases that can go wrong.

References are independent of the engine: the split value is rebuilt from bit patterns with
torch integer ops, the Kahan pair with torch's own BF16 rounding."""
import pytest
import torch
from torch import nn

import fusedamp

_TIE = {"split": -32768, "split8": -128}  # master = weight pattern * 2^16 - 2^15: halfway
_SHIFT = {"split": 0, "split8": 8}


def split_value(weight_bf16, remainder, mode):
    """The FP32 value a split pair holds: weight pattern * 2^16 + remainder * 2^shift (for the
    non-zero finite weights these tests use)."""
    high = weight_bf16.detach().cpu().contiguous().view(torch.int16).to(torch.int32) << 16
    low = remainder.detach().cpu().to(torch.int32) << _SHIFT[mode]
    return (high + low).view(torch.float32)


def kahan_pair_of(value):
    """What a Kahan step stores for an FP32 value: round(value) to nearest even and the rest
    (exact in FP32) rounded to BF16."""
    weight = value.to(torch.bfloat16)
    return weight, (value - weight.float()).to(torch.bfloat16)


def kahan_value(weight, compensation):
    """weight + compensation in FP64 (exact: the compensation is within an ulp of its weight)."""
    return weight.detach().cpu().double() + compensation.detach().cpu().double()


def assert_same_values(got, want):
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} of {got.numel()} values moved, e.g. {got[bad[:3]].tolist()} "
        f"instead of {want[bad[:3]].tolist()}")


def is_halfway(value_fp32):
    """Values whose lower 16 bits are 0x8000: exactly halfway between two BF16 values."""
    return (value_fp32.contiguous().view(torch.int32) & 0xFFFF) == 0x8000


def ties_away_from_even(value_fp32, weight_bf16):
    """Halfway values whose split weight (the neighbour away from zero) is odd: there the
    nearest-even weight is the other neighbour, the case a conversion can get wrong."""
    odd = (weight_bf16.detach().cpu().view(torch.int16) & 1).bool()
    return is_halfway(value_fp32) & odd


def _weights(device, n, seed):
    """n BF16 weights of either sign, none zero (a zero weight keeps no remainder below it)."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.rand(n, generator=gen) * 4 + 2.0 ** -6
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    return (magnitude * sign).to(device, torch.bfloat16)


def _split_at_ties(device, mode, n=4096):
    """A BF16 parameter under `mode` whose every remainder sits at the tie."""
    p = nn.Parameter(_weights(device, n, seed=1))
    opt = fusedamp.optim.SGD([p], lr=0.0, master_weights=mode)
    p.grad = torch.zeros_like(p)
    opt.step()
    opt.state[p]["param_remainder"].fill_(_TIE[mode])
    return p, opt


def _split_trained(device, mode, n, steps=5):
    """A BF16 parameter under `mode` on `device` with the state of an ordinary AdamW run, which
    runs on the CPU so that its ties are the same whatever the device."""
    p = nn.Parameter(_weights("cpu", n, seed=2))
    opt = fusedamp.optim.AdamW([p], lr=1e-3, master_weights=mode)
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        p.grad = torch.randn(n, generator=gen).to(torch.bfloat16)
        opt.step()
    on_device = nn.Parameter(p.detach().to(device))
    loaded = fusedamp.optim.AdamW([on_device], lr=1e-3, master_weights=mode)
    loaded.load_state_dict(opt.state_dict())
    return on_device, loaded


def _loaded_into_kahan(p_saved, opt_saved):
    """The checkpoint loaded into the same optimizer built with "kahan" and converted by its
    next step (lr=0, zero gradients: the step keeps the value it converted)."""
    p = nn.Parameter(p_saved.detach().clone())
    opt = type(opt_saved)([p], lr=0.0, master_weights="kahan")
    opt.load_state_dict(opt_saved.state_dict())
    opt.param_groups[0]["lr"] = 0.0  # the checkpoint's lr replaced it
    assert opt.param_groups[0]["master_weights"] == "kahan"
    p.grad = torch.zeros_like(p)
    opt.step()
    return p, opt.state[p]["kahan_compensation"]


def _converted_outside(p_saved, opt_saved):
    """convert_param_state, which the sharded optimizers' checkpoints use: the weight it
    returns is the one the state belongs beside."""
    from fusedamp import _C

    weight, state = _C.convert_param_state(p_saved.detach(), dict(opt_saved.state[p_saved]),
                                           "kahan", torch.float32, 0)
    return weight, state["kahan_compensation"]


_PATHS = {"load_state_dict": _loaded_into_kahan, "convert_param_state": _converted_outside}


@pytest.mark.parametrize("path", sorted(_PATHS))
@pytest.mark.parametrize("mode", ["split", "split8"])
def test_split_at_ties_converts_to_kahan_exactly(device, mode, path):
    """Every remainder at the tie: the value is halfway between two BF16 weights, which a Kahan
    pair holds exactly (half an ulp of compensation). The split weight is the neighbour away
    from zero; where that is not the even one (about half of them), the Kahan weight is."""
    p_saved, opt_saved = _split_at_ties(device, mode)
    value = split_value(p_saved, opt_saved.state[p_saved]["param_remainder"], mode)
    weight, compensation = _PATHS[path](p_saved, opt_saved)
    assert compensation.dtype == torch.bfloat16
    assert_same_values(kahan_value(weight, compensation), value.double())
    want_weight, want_compensation = kahan_pair_of(value)
    assert torch.equal(weight.detach().cpu(), want_weight)
    assert torch.equal(compensation.cpu(), want_compensation)
    # the split weights that were not the even neighbour moved by their ulp, and only those
    moved = weight.detach().cpu() != p_saved.detach().cpu()
    assert torch.equal(moved, ties_away_from_even(value, p_saved)) and moved.any()


@pytest.mark.parametrize("path", sorted(_PATHS))
def test_trained_split8_converts_to_kahan_exactly(device, path):
    """A 24-bit master (16 significant bits) minus its BF16 rounding fits a BF16 compensation,
    so every value of an ordinary run survives, ties included."""
    p_saved, opt_saved = _split_trained(device, "split8", n=4096)
    value = split_value(p_saved, opt_saved.state[p_saved]["param_remainder"], "split8")
    assert ties_away_from_even(value, p_saved).any()
    weight, compensation = _PATHS[path](p_saved, opt_saved)
    assert_same_values(kahan_value(weight, compensation), value.double())


@pytest.mark.parametrize("path", sorted(_PATHS))
def test_trained_split_converts_to_the_kahan_pair_of_its_master(device, path):
    """An FP32 master has more bits than a Kahan pair: the pair is the one a Kahan step stores
    for it, never a weight ulp away; exact at the ties."""
    p_saved, opt_saved = _split_trained(device, "split", n=1 << 18)
    value = split_value(p_saved, opt_saved.state[p_saved]["param_remainder"], "split")
    ties = is_halfway(value)
    assert ties_away_from_even(value, p_saved).any()
    weight, compensation = _PATHS[path](p_saved, opt_saved)
    got = kahan_value(weight, compensation)
    assert_same_values(got, kahan_value(*kahan_pair_of(value)))
    assert_same_values(got[ties], value[ties].double())

