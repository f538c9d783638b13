"""What a master-weight mode's stored master converts to and from: checkpoints saved under
another mode or state_dtype (the optimizer keeps its own and converts), the FP32 export
(fusedamp.master_weights) of every mode, and the value a Kahan pair keeps across conversion,
edits and ties. Every test runs on every device."""
import copy

import pytest
import torch
from torch import nn

import fusedamp
from master_mode_helpers import bf16_mlp, combine_reference


def test_checkpoint_converts_fp32_split_fp32_exactly(device):
    model = bf16_mlp(device)
    x = torch.randn(8, 16, device=device, dtype=torch.bfloat16)

    def train(opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()

    def skipped_step(opt):  # builds (converts) the state, changes nothing else
        for p in model.parameters():
            p.grad = torch.full_like(p, float("inf"))
        opt.step()

    fp32_opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-2)
    train(fp32_opt, 5)
    saved = copy.deepcopy(fp32_opt.state_dict())
    split_opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-2, master_weights="split")
    split_opt.load_state_dict(saved)  # keeps the mode it was built with
    assert split_opt.param_groups[0]["master_weights"] == "split"
    skipped_step(split_opt)
    split_saved = copy.deepcopy(split_opt.state_dict())
    assert all("param_remainder" in s and "master_param" not in s
               for s in split_saved["state"].values())
    back = fusedamp.optim.AdamW(model.parameters(), lr=1e-2)
    back.load_state_dict(split_saved)
    assert back.param_groups[0]["master_weights"] is True
    skipped_step(back)
    for k, s in back.state_dict()["state"].items():
        assert torch.equal(s["master_param"].view(torch.int32),
                           saved["state"][k]["master_param"].view(torch.int32))
        assert torch.equal(s["exp_avg"], saved["state"][k]["exp_avg"])


@pytest.mark.parametrize("mode", ["split", "kahan"])
def test_fp32_export_rebuilds_the_master_of_every_mode(device, mode):
    """fusedamp.master_weights(model, optimizer) is the FP32 master whatever keeps it: the
    split pair exactly, weight + compensation for Kahan."""
    model = bf16_mlp(device, seed=5)
    opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-2, master_weights=mode)
    x = torch.randn(8, 16, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()
    exported = fusedamp.master_weights(model, opt)
    for name, p in model.named_parameters():
        state = opt.state[p]
        if mode == "split":
            expected = combine_reference(p.detach(), state["param_remainder"])
        else:
            expected = p.detach().float() + state["kahan_compensation"].float()
        assert torch.equal(exported[name].view(torch.int32), expected.view(torch.int32)), name
        assert not torch.equal(exported[name], p.detach().float()), name  # bits below the weight


@pytest.mark.parametrize("weight", [1.0, 1.0078125, -3.0, 0.0])  # even, odd, negative, zero
def test_split_export_is_the_pair_for_every_remainder(device, weight):
    """fusedamp.master_weights under "split" is the stored pair (weight bits << 16 plus the
    int16 remainder) for every one of the 65,536 remainders, the ties (-32768) included, where
    the weight rounds the master with ties away from zero; below a zero weight it is the
    weight itself (math/split_math.h)."""
    model = nn.Linear(1, 65536, bias=False).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(weight)
    opt = fusedamp.optim.SGD(model.parameters(), lr=0.0, master_weights="split")
    model.weight.grad = torch.zeros_like(model.weight)
    opt.step()
    remainders = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(65536, 1)
    opt.state[model.weight]["param_remainder"].copy_(remainders.to(device))
    exported = fusedamp.master_weights(model, opt)["weight"].cpu()
    high = model.weight.detach().cpu().view(torch.int16).to(torch.int32) << 16
    want = (high + remainders.to(torch.int32)).view(torch.float32)
    if weight == 0.0:  # a remainder below zero would wrap into the other sign: the weight
        want = torch.where(remainders < 0, torch.zeros_like(want), want)
    assert torch.equal(exported.view(torch.int32), want.view(torch.int32))


_MODES = [True, False, "split", "kahan", "stochastic"]
_STORE_KEY = {True: "master_param", "split": "param_remainder", "kahan": "kahan_compensation"}


def _trained(device, mode, steps=3):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(256, device=device).to(torch.bfloat16))
    opt = fusedamp.optim.AdamW([p], lr=1e-2, master_weights=mode)
    for step in range(steps):
        p.grad = torch.randn(256, generator=torch.Generator().manual_seed(step)).to(
            device, torch.bfloat16)
        opt.step()
    return p, opt


@pytest.mark.parametrize("saved,built", [(a, b) for a in _MODES for b in _MODES if a != b],
                         ids=str)
def test_a_checkpoint_of_another_mode_takes_the_mode_the_optimizer_was_built_with(
        device, saved, built):
    """The memory the user chose stays chosen: loading a checkpoint of another master-weight
    mode keeps the optimizer's own mode and converts the state to it (FP32 master <-> split
    exactly: the same FP32 value)."""
    p_saved, opt_saved = _trained(device, saved)
    p = nn.Parameter(p_saved.detach().clone())
    opt = fusedamp.optim.AdamW([p], lr=1e-2, master_weights=built)
    opt.load_state_dict(opt_saved.state_dict())
    assert opt.param_groups[0]["master_weights"] == built
    p.grad = torch.zeros_like(p)
    with torch.no_grad():
        opt.param_groups[0]["lr"] = 0.0
    opt.step()  # converts; with lr=0 and zero grads the FP32 value stays
    store_keys = set(_STORE_KEY.values()) & set(opt.state[p])
    assert store_keys == ({_STORE_KEY[built]} if built in _STORE_KEY else set())
    if {saved, built} == {True, "split"}:
        before = fusedamp.master_weights(nn.ParameterDict({"w": p_saved}), opt_saved)["w"]
        after = fusedamp.master_weights(nn.ParameterDict({"w": p}), opt)["w"]
        assert torch.equal(before, after)
    if (saved, built) == ("kahan", True):  # the exact sum, half-ulp compensations included
        exact = (p_saved.detach().double()
                 + opt_saved.state[p_saved]["kahan_compensation"].double()).float()
        assert torch.equal(opt.state[p]["master_param"], exact)


def test_kahan_to_fp32_keeps_a_half_ulp_compensation_of_an_odd_weight(device):
    """An odd BF16 weight with a compensation of exactly half an ulp: the FP32 master made from
    the pair is the exact sum, a tie; the weight becomes its rounding (the even neighbour), so
    the step does not take the weight for an edit and drop the half ulp."""
    w = torch.tensor([1.0078125, -3.015625], dtype=torch.bfloat16, device=device)  # odd
    half_ulp = torch.tensor([2.0 ** -8, -(2.0 ** -7)], dtype=torch.bfloat16, device=device)
    p_saved = nn.Parameter(w.clone())
    opt_saved = fusedamp.optim.SGD([p_saved], lr=0.0, master_weights="kahan")
    p_saved.grad = torch.zeros_like(p_saved)
    opt_saved.step()
    opt_saved.state[p_saved]["kahan_compensation"].copy_(half_ulp)
    p = nn.Parameter(w.clone())
    opt = fusedamp.optim.SGD([p], lr=0.0, master_weights=True)
    opt.load_state_dict(opt_saved.state_dict())
    p.grad = torch.zeros_like(p)
    opt.step()
    exact = w.double() + half_ulp.double()
    assert torch.equal(opt.state[p]["master_param"].double(), exact)
    # beside an FP32 master the weight is its rounding to nearest even: the even neighbour
    assert torch.equal(p.detach(), exact.to(torch.bfloat16)) and not torch.equal(p.detach(), w)


def _kahan_pair(device, weights, compensations):
    """A BF16 parameter under "kahan" (SGD, lr=0) holding the given weight/compensation pairs."""
    p = nn.Parameter(torch.tensor(weights, device=device).to(torch.bfloat16))
    opt = fusedamp.optim.SGD([p], lr=0.0, master_weights="kahan")
    p.grad = torch.zeros_like(p)
    opt.step()
    opt.state[p]["kahan_compensation"].copy_(torch.tensor(compensations).to(torch.bfloat16))
    return p, opt


def _kahan_value(p, opt):
    return p.detach().double() + opt.state[p]["kahan_compensation"].double()


def test_kahan_edit_keeps_a_compensation_that_still_rounds_to_the_new_weight(device):
    """docs/master_weights.md: after an edit the compensation stays where the new weight is
    still the rounding of weight + compensation (under half an ulp of it), else it is dropped;
    the edited weight itself is always taken."""
    p, opt = _kahan_pair(device, [1.0, 1.0], [2.0 ** -10, 2.0 ** -10])
    with torch.no_grad():
        p[0] = 1.0078125  # nearby: 2^-10 is under half its ulp (2^-8): kept
        p[1] = 0.0078125  # small: 2^-10 is more than half its ulp (2^-15): dropped
    opt.step()  # lr=0: the value the step starts from is what it keeps
    value = _kahan_value(p, opt)
    assert value[0].item() == 1.0078125 + 2.0 ** -10
    assert value[1].item() == 0.0078125


def test_kahan_step_at_a_half_ulp_tie_moves_the_weight_not_the_value(device):
    """docs/master_weights.md: a compensation of exactly half an ulp of an odd weight is a tie;
    the step's round-to-nearest-even store moves the weight to its even neighbour and the
    compensation to the other side, even with lr=0; the value weight + compensation stays."""
    p, opt = _kahan_pair(device, [1.0078125], [2.0 ** -8])  # odd weight, half its ulp
    before = _kahan_value(p, opt)
    opt.step()
    assert p.item() == 1.015625  # the even neighbour
    assert opt.state[p]["kahan_compensation"].item() == -(2.0 ** -8)
    assert torch.equal(_kahan_value(p, opt), before)


@pytest.mark.parametrize("saved,built", [(torch.float32, torch.bfloat16),
                                         (torch.bfloat16, torch.float32)], ids=str)
def test_a_checkpoint_of_another_state_dtype_takes_the_optimizers(device, saved, built):
    """state_dtype, like master_weights, stays the optimizer's own: the loaded moments are
    converted to it at the next step."""
    p_saved = nn.Parameter(torch.randn(64, device=device).to(torch.bfloat16))
    opt_saved = fusedamp.optim.AdamW([p_saved], lr=1e-2, state_dtype=saved)
    p_saved.grad = torch.randn(64, device=device).to(torch.bfloat16)
    opt_saved.step()
    p = nn.Parameter(p_saved.detach().clone())
    opt = fusedamp.optim.AdamW([p], lr=1e-2, state_dtype=built)
    opt.load_state_dict(opt_saved.state_dict())
    assert opt.param_groups[0]["state_dtype"] == built
    p.grad = torch.randn(64, device=device).to(torch.bfloat16)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == built and opt.state[p]["exp_avg_sq"].dtype == built
