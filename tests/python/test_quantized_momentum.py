"""state_dtype=torch.int8 for SGD: the momentum buffer as int8 codes in exp_avg's format (signed,
square-root companded) in blocks of 32 elements with one FP32 scale per block
(csrc/include/fusedamp/math/quantized_moments_math.h; sgd_step_'s momentum_scales).

The kernels are checked against an FP64 reference of the same quantized algorithm written here
from the format's definition."""
import copy

import pytest
import torch

import fusedamp
from quantized_helpers import (SCALES_FLAWS, _batches, _model, _train,
                               check_initialize_takes_int8_state,
                               check_op_refuses_and_changes_nothing,
                               check_op_skipped_step_touches_nothing,
                               check_skipped_step_changes_nothing, check_step_against_fp64,
                               scales_flaw_cases,
                               spoil_scales)

B = 32
LEVELS = 127.0


# ---------------------------------------------------------------- an FP64 reference
def ref_dequantize(codes, scales):
    """The values codes and scales stand for (flat, FP64)."""
    block = torch.arange(codes.numel(), device=codes.device) // B
    s = scales.double().reshape(-1)
    q = codes.reshape(-1).double()
    return q * q.abs() * s[block] / (LEVELS * LEVELS)


def ref_quantize(x):
    """Codes (as FP64 integers) and scales ([blocks, 1]) of a flat FP64 buffer."""
    n = x.numel()
    xb = torch.nn.functional.pad(x, (0, (-n) % B)).view(-1, B)
    s = xb.abs().amax(1, keepdim=True)
    u = torch.where(s > 0, xb.abs() / torch.where(s > 0, s, 1), 0)
    q = torch.round(u.sqrt() * LEVELS).clamp(0, LEVELS) * xb.sign()
    return q.reshape(-1)[:n], s


def ref_sgd_step(p, g, buf, first, lr, momentum, dampening, wd, nesterov):
    """torch.optim.SGD's single-tensor formula in FP64 on flat tensors."""
    g = g + wd * p
    buf = g.clone() if first else momentum * buf + (1 - dampening) * g
    d = g + momentum * buf if nesterov else buf
    return p - lr * d, buf


def random_quantized_buffer(n, device, gen):
    q, s = ref_quantize(torch.randn(n, generator=gen, dtype=torch.float64) * 1e-2)
    return q.to(torch.int8).to(device), s.float().to(device)


def sgd_op(p, g, codes, scales, step, **kw):
    kw.setdefault("lr", 1e-2)
    kw.setdefault("momentum", 0.9)
    kw.setdefault("dampening", 0.0)
    kw.setdefault("weight_decay", 0.0)
    kw.setdefault("nesterov", False)
    masters = kw.pop("master_params", [])
    torch.ops.fusedamp.sgd_step_([p], masters, [g], [codes], [step], momentum_scales=[scales],
                                 **kw)


# ---------------------------------------------------------------- the op
@pytest.mark.parametrize("numel", [1, 31, 32, 33, 100, 20000, 40000])
@pytest.mark.parametrize("first, nesterov, dampening, wd", [
    (False, False, 0.0, 0.0), (False, True, 0.0, 1e-2), (False, False, 0.3, 1e-2),
    (True, False, 0.0, 1e-2)])
def test_op_step_matches_fp64_reference_of_the_quantized_algorithm(device, numel, first,
                                                                     nesterov, dampening, wd,
                                                                     record_diff):
    gen = torch.Generator().manual_seed(numel)
    p = torch.randn(numel, generator=gen).to(device)
    g = (torch.randn(numel, generator=gen) * 1e-2).to(device)
    codes, scales = random_quantized_buffer(numel, device, gen)
    # An all-zero block (codes, scale and gradient): it stays exactly zero.
    if numel >= 64 and not wd:
        g[32:64] = 0
        codes[32:64] = 0
        scales[1] = 0
    step = torch.tensor(0.0 if first else 4.0, device=device)
    lr, momentum = 1e-2, 0.9
    ref_p, ref_buf = ref_sgd_step(p.double().cpu(), g.double().cpu(),
                                  ref_dequantize(codes, scales).cpu(), first, lr, momentum,
                                  dampening, wd, nesterov)
    ref_q, ref_scales = ref_quantize(ref_buf)
    sgd_op(p, g, codes, scales, step, lr=lr, momentum=momentum, dampening=dampening,
           weight_decay=wd, nesterov=nesterov)
    assert step.item() == (1.0 if first else 5.0)
    check_step_against_fp64(record_diff, "int8 momentum", lr, p, ref_p, scales, ref_scales,
                            [(codes, ref_q)])
    if numel >= 64 and not wd:
        assert (codes[32:64] == 0).all() and scales[1].item() == 0.0


@pytest.mark.parametrize("master_weights", ["fp32", "split", "split8", "none"])
def test_op_weight_stores_update_the_weights_alike(device, master_weights):
    """The quantized buffer beside every way of keeping BF16 weights: the same buffer codes and
    scales, and weights within one BF16 rounding of the FP32-master step's; the "split" pair is
    that step's FP32 master exactly."""
    gen = torch.Generator().manual_seed(7)
    n = 300
    p32 = torch.randn(n, generator=gen).to(device)
    g = (torch.randn(n, generator=gen) * 1e-2).to(device).bfloat16()
    base_codes, base_scales = random_quantized_buffer(n, device, gen)

    def run(kind):
        # Every store starts from the same master: the BF16 weight (remainders of 0).
        p = p32.bfloat16()
        masters = {"fp32": [p.float()],
                   "split": [torch.zeros(n, dtype=torch.int16, device=device)],
                   "split8": [torch.zeros(n, dtype=torch.int8, device=device)],
                   "none": []}[kind]
        codes, scales = base_codes.clone(), base_scales.clone()
        sgd_op(p, g.clone(), codes, scales, torch.tensor(2.0, device=device),
               master_params=masters)
        return p, masters, codes, scales

    ref_p, ref_masters, ref_codes, ref_scales = run("fp32")
    p, masters, codes, scales = run(master_weights)
    assert torch.equal(codes, ref_codes)  # no weight decay: the buffer does not see the weights
    torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
    torch.testing.assert_close(p.float(), ref_p.float(), rtol=2 ** -7, atol=1e-6)
    if master_weights == "split":  # the weight's bits above the remainder's: the FP32 master
        high = p.view(torch.int16).to(torch.int64) & 0xFFFF
        bits = ((high << 16) + masters[0].to(torch.int64)) & 0xFFFFFFFF
        bits = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)
        assert torch.equal(bits.view(torch.float32), ref_masters[0])


def test_op_skipped_step_touches_nothing(device):
    check_op_skipped_step_touches_nothing(
        device, random_quantized_buffer,
        lambda p, master, g, state, step, **scalars: sgd_op(p, g, *state, step,
                                                            master_params=[master], **scalars))


def test_op_blocks_follow_each_parameter_not_the_call(device):
    """Two parameters stepped in one call or one at a time: the same codes and scales (a block
    never spans two parameters)."""
    gen = torch.Generator().manual_seed(3)
    sizes = [45, 1, 70]
    ps = [torch.randn(n, generator=gen).to(device) for n in sizes]
    gs = [(torch.randn(n, generator=gen) * 1e-2).to(device) for n in sizes]
    bufs = [random_quantized_buffer(n, device, gen) for n in sizes]

    def state():
        return ([p.clone() for p in ps], [c.clone() for c, _ in bufs],
                [s.clone() for _, s in bufs], [torch.tensor(1.0, device=device) for _ in sizes])

    p1, c1, s1, t1 = state()
    torch.ops.fusedamp.sgd_step_(p1, [], gs, c1, t1, lr=1e-2, momentum=0.9, dampening=0.0,
                                 weight_decay=0.0, nesterov=False, momentum_scales=s1)
    p2, c2, s2, t2 = state()
    for i in range(len(sizes)):
        sgd_op(p2[i], gs[i], c2[i], s2[i], t2[i])
    for a, b in zip(p1 + c1 + s1, p2 + c2 + s2):
        assert torch.equal(a, b)


def _args(device, n=40):
    return dict(params=[torch.randn(n, device=device)], master_params=[],
                grads=[torch.randn(n, device=device)],
                momentum_buffers=[torch.zeros(n, dtype=torch.int8, device=device)],
                steps=[torch.zeros((), device=device)],
                momentum_scales=[torch.zeros((n + 31) // 32, 1, device=device)])


@pytest.mark.parametrize("flaw, message", scales_flaw_cases("momentum_scales") + [
    ("two_columns", r"shape \[\.\.\., 1\]"),
    ("float_buffer", "momentum_buffers must be int8 codes"),
    ("no_momentum", "without a state to quantize"),
])
def test_op_refuses_bad_quantized_buffer_and_changes_nothing(device, flaw, message):
    a = _args(device)
    n = a["params"][0].numel()
    momentum = 0.9
    if flaw in SCALES_FLAWS:
        spoil_scales(a, "momentum_scales", flaw)
    elif flaw == "two_columns":
        a["momentum_scales"] = [torch.zeros(2, 2, device=device)]
    elif flaw == "float_buffer":
        a["momentum_buffers"] = [torch.zeros(n, device=device)]
    elif flaw == "no_momentum":
        momentum = 0.0
        a["momentum_buffers"] = []
    check_op_refuses_and_changes_nothing(
        torch.ops.fusedamp.sgd_step_, a, message, lr=1e-2, momentum=momentum, dampening=0.0,
        weight_decay=0.0, nesterov=False)


# ---------------------------------------------------------------- the optimizer
def _sgd(params, **kw):
    kw.setdefault("lr", 0.02)
    kw.setdefault("momentum", 0.9)
    return fusedamp.optim.SGD(params, **kw)


def test_skipped_step_changes_nothing(device):
    check_skipped_step_changes_nothing(
        device, lambda params: _sgd(params, state_dtype=torch.int8))


def test_state_conversions_between_fp32_and_int8(device):
    """FP32 -> int8 gives the codes and scales a quantization of the FP32 buffer gives; int8 ->
    FP32 the values the codes stand for (convert_param_state, which the optimizer's load and
    the ZeRO front end use)."""
    from fusedamp import _C

    model = _model(device, torch.float32)
    fp32_opt = _sgd(model.parameters())
    _train(model, fp32_opt, _batches(device, 5, torch.float32))
    for i, p in enumerate(model.parameters()):
        s = fp32_opt.state[p]
        q, scales = ref_quantize(s["momentum_buffer"].double().reshape(-1).cpu())
        _, got = _C.convert_param_state(p.detach(), dict(s), True, torch.int8, i)
        assert got["momentum_buffer"].dtype == torch.int8
        assert (got["momentum_buffer"].reshape(-1).double().cpu() - q).abs().max() <= 1
        assert list(got["momentum_scales"].shape) == _C.momentum_scales_shape(p)
        assert torch.allclose(got["momentum_scales"].double().reshape(-1, 1).cpu(), scales,
                              rtol=1e-6, atol=0)
        _, back = _C.convert_param_state(p.detach(), got, True, torch.float32, i)
        want = ref_dequantize(got["momentum_buffer"].cpu(), got["momentum_scales"].cpu())
        assert back["momentum_buffer"].dtype == torch.float32 and "momentum_scales" not in back
        assert torch.allclose(back["momentum_buffer"].reshape(-1).double().cpu(), want,
                              rtol=1e-6, atol=0)


def test_a_torch_sgd_checkpoint_loads_and_converts_back(device):
    """torch.optim.SGD's checkpoint into an int8 optimizer (quantized by its first step, which
    then goes on as torch's does, up to the quantization), and the int8 state back into an
    FP32 one (dequantized)."""
    batches = _batches(device, 8, torch.float32)
    model = _model(device, torch.float32)
    torch_opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    _train(model, torch_opt, batches[:3])
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.02, momentum=0.9)
    twin_opt.load_state_dict(torch_opt.state_dict())
    int8_opt = _sgd(model.parameters(), state_dtype=torch.int8)
    int8_opt.load_state_dict(torch_opt.state_dict())
    start = [q.detach().clone() for q in twin.parameters()]
    _train(model, int8_opt, batches[3:6])
    _train(twin, twin_opt, batches[3:6])
    for p, q, q0 in zip(model.parameters(), twin.parameters(), start):
        assert int8_opt.state[p]["momentum_buffer"].dtype == torch.int8
        # The quantized buffer's error is a few % of the block's largest value: the weights'
        # three-step change agrees to within 10 % of the largest change.
        moved = (q - q0).abs().max().item()
        assert (p - q).abs().max().item() <= 0.1 * moved
    fp32_opt = _sgd(model.parameters())
    fp32_opt.load_state_dict(int8_opt.state_dict())
    _train(model, fp32_opt, batches[6:])
    for p in model.parameters():
        assert fp32_opt.state[p]["momentum_buffer"].dtype == torch.float32
        assert "momentum_scales" not in fp32_opt.state[p]


def test_bad_int8_state_dicts_are_refused_and_change_nothing(device):
    model = _model(device, torch.float32)
    opt = _sgd(model.parameters(), state_dtype=torch.int8)
    _train(model, opt, _batches(device, 2, torch.float32))
    good = copy.deepcopy(opt.state_dict())
    for flaw, message in (("no_scales", "with their 'momentum_scales'"),
                          ("bad_shape", "must be a float32 tensor of shape"),
                          ("scales_without_codes", "beside int8 'momentum_buffer' codes")):
        bad = copy.deepcopy(good)
        st = bad["state"][0]
        if flaw == "no_scales":
            del st["momentum_scales"]
        elif flaw == "bad_shape":
            st["momentum_scales"] = torch.zeros(3, 2, device=device)
        else:
            st["momentum_buffer"] = st["momentum_buffer"].float()
        with pytest.raises((RuntimeError, ValueError), match=message):
            opt.load_state_dict(bad)
        after = opt.state_dict()
        for i, s in good["state"].items():
            for k, t in s.items():
                assert torch.equal(t, after["state"][i][k]), (flaw, k)


def test_state_bytes_per_parameter(device):
    """BF16 weights and gradients, "split" remainders, an int8 buffer: 2 + 2 + 1.125 B."""
    model = _model(device, torch.bfloat16)
    opt = _sgd(model.parameters(), master_weights="split", state_dtype=torch.int8)
    _train(model, opt, _batches(device, 1, torch.bfloat16))
    n = sum(p.numel() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for p in model.parameters()
                for k, t in opt.state[p].items() if k != "step")
    blocks = sum((p.numel() + 31) // 32 for p in model.parameters())
    assert state / n == pytest.approx((2 * n + n + 4 * blocks) / n)


def test_initialize_takes_int8_state_for_sgd(device):
    check_initialize_takes_int8_state(
        device, lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), "momentum_buffer")
