"""master_weights="split8": a 24-bit master kept as the BF16 weight plus an int8 remainder
(csrc/include/fusedamp/math/split_math.h). The references here are built from bit patterns
with torch integer ops, independently of the kernels."""
import io

import pytest
import torch
from torch import nn

import fusedamp

ops = torch.ops.fusedamp


def combine8_reference(weight_bf16, remainder_int8):
    """The FP32 value of a split8 pair: (weight pattern * 2^8 + remainder) * 2^8."""
    high = weight_bf16.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    bits = ((high << 16) + (remainder_int8.to(torch.int64) << 8)) & 0xFFFFFFFF
    bits = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits)
    return bits.to(torch.int32).view(torch.float32)


def round24_reference(x_fp32):
    """x rounded to nearest 24-bit pattern, ties to even, as FP32 (finite x)."""
    bits = x_fp32.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    low = bits & 0xFF
    keep = bits >> 8
    up = (low > 0x80) | ((low == 0x80) & ((keep & 1) == 1))
    out = ((keep + up.to(torch.int64)) << 8) & 0xFFFFFFFF
    out = torch.where(out >= 2 ** 31, out - 2 ** 32, out)
    return out.to(torch.int32).view(torch.float32)


def _sgd_plain(params, masters, grads, device, lr=1.0):
    steps = [torch.zeros((), device=device) for _ in params]
    ops.sgd_step_(params, masters, grads, [], steps, lr=lr, momentum=0.0, dampening=0.0,
                  weight_decay=0.0, nesterov=False)


def test_step_stores_the_24_bit_rounding_of_the_fp32_result(device):
    """SGD with lr=1 and no decay: the new value is master - g in FP32, rounded to 24 bits;
    the pair holds exactly that, and the weight is its rounding half away from zero."""
    gen = torch.Generator().manual_seed(0)
    n = 40000
    w = (torch.randn(n, generator=gen)).bfloat16()
    r = torch.randint(-128, 128, (n,), generator=gen, dtype=torch.int8)
    g = torch.randn(n, generator=gen) * 1e-3
    before = combine8_reference(w, r)
    expected = round24_reference(before - g)
    p, m = w.to(device, copy=True), r.to(device, copy=True)
    _sgd_plain([p], [m], [g.to(device)], device)
    got = combine8_reference(p.cpu(), m.cpu())
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    # The weight is the 24-bit value's BF16 rounding (half away from zero at its lowest byte):
    # the remainder stays within [-128, 127] and the weight within half a BF16 ulp.
    assert torch.equal((got - p.cpu().float()).abs() <= p.cpu().float().abs() * 2 ** -8,
                       torch.ones(n, dtype=torch.bool))


def test_every_remainder_of_a_weight_is_one_24_bit_value(device):
    """All 256 remainders beside even, odd, negative and zero weights: a step that changes
    nothing (lr=0) keeps every pair's value, and the pairs are the 24-bit values themselves."""
    for weight in (1.0, 1.0078125, -3.0, 0.0):
        r = torch.arange(-128, 128, dtype=torch.int8)
        w = torch.full((256,), weight, dtype=torch.bfloat16)
        value = combine8_reference(w, r)
        p, m = w.to(device, copy=True), r.to(device, copy=True)
        _sgd_plain([p], [m], [torch.zeros(256, device=device)], device, lr=0.0)
        after = combine8_reference(p.cpu(), m.cpu())
        if weight == 0.0:  # a remainder below a zero weight is ignored: the value is 0
            assert torch.equal(after[r >= 0], value[r >= 0])
            assert (after[r < 0] == 0).all()
        else:
            assert torch.equal(after.view(torch.int32), value.view(torch.int32))


def _bf16_model(device, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)).to(device,
                                                                          torch.bfloat16)


def _train(model, opt, steps, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=gen).to(device, torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.int8])
def test_split8_tracks_fp32_masters_closer_than_plain_bf16(device, state_dtype):
    """At a small lr most updates are below half a BF16 ulp: plain BF16 loses them, split8's
    24-bit master keeps them (its weights stay near the FP32-master run's)."""
    runs = {}
    for mode in (True, "split8", False):
        model = _bf16_model(device)
        opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-4, master_weights=mode,
                                   state_dtype=state_dtype)
        _train(model, opt, 30, device)
        runs[mode] = (model, opt)
    ref = fusedamp.master_weights(*runs[True])
    split8 = fusedamp.master_weights(*runs["split8"])
    plain = dict((k, v.detach().float()) for k, v in runs[False][0].named_parameters())
    for name in ref:
        err8 = (split8[name] - ref[name]).abs().mean()
        err_plain = (plain[name] - ref[name]).abs().mean()
        assert err8 < 0.1 * err_plain, name
    for p in runs["split8"][0].parameters():
        r = runs["split8"][1].state[p]["param_remainder"]
        assert r.dtype == torch.int8 and r.shape == p.shape


def test_resume_bit_exact_and_checkpoints_convert(device):
    model = _bf16_model(device)
    opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3, master_weights="split8",
                               state_dtype=torch.int8)
    _train(model, opt, 4, device)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, 3, device, seed=9)
    buf.seek(0)
    saved = torch.load(buf)
    again = _bf16_model(device, seed=3)
    again.load_state_dict(saved["model"])
    opt2 = fusedamp.optim.AdamW(again.parameters(), lr=1e-3, master_weights="split8",
                                state_dtype=torch.int8)
    opt2.load_state_dict(saved["opt"])
    _train(again, opt2, 3, device, seed=9)
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["param_remainder"], opt2.state[b]["param_remainder"])

    # split8 -> FP32 master: the 24-bit value exactly; FP32 -> split8: its 24-bit rounding.
    # (lr 0 after the load: a state dict brings its own lr, as torch's does.)
    fp32 = fusedamp.optim.AdamW(again.parameters(), master_weights=True)
    fp32.load_state_dict(opt2.state_dict())
    fp32.param_groups[0]["lr"] = 0.0
    pairs = {p: combine8_reference(p.detach().cpu(), opt2.state[p]["param_remainder"].cpu())
             for p in again.parameters()}
    for p in again.parameters():
        p.grad = torch.zeros_like(p)
    fp32.step()
    for p in again.parameters():
        assert torch.equal(fp32.state[p]["master_param"].cpu(), pairs[p])
    back = fusedamp.optim.AdamW(again.parameters(), master_weights="split8")
    back.load_state_dict(fp32.state_dict())
    back.param_groups[0]["lr"] = 0.0
    back.step()
    for p in again.parameters():
        rebuilt = combine8_reference(p.detach().cpu(), back.state[p]["param_remainder"].cpu())
        assert torch.equal(rebuilt, round24_reference(fp32.state[p]["master_param"].cpu()))
    exported = fusedamp.master_weights(again, back)
    for name, p in again.named_parameters():
        assert torch.equal(exported[name].cpu(),
                           combine8_reference(p.detach().cpu(),
                                              back.state[p]["param_remainder"].cpu()))


def test_skipped_step_and_refusals_change_nothing(device):
    model = _bf16_model(device)
    opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3, master_weights="split8")
    _train(model, opt, 2, device)
    state = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    weights = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    opt.step()  # skip_nonfinite: skipped
    for p, w in zip(model.parameters(), weights):
        assert torch.equal(p, w)
        for k, v in state[p].items():
            assert torch.equal(opt.state[p][k], v), k
    half = nn.Linear(4, 4).to(device, torch.float16)
    opt16 = fusedamp.optim.AdamW(half.parameters(), master_weights="split8")
    before = [p.detach().clone() for p in half.parameters()]
    for p in half.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="keeps bfloat16 weights"):
        opt16.step()
    for p, b in zip(half.parameters(), before):
        assert torch.equal(p, b)
