"""state_dtype=torch.int8: Adam's moments as 8-bit codes in blocks of 32 elements with FP32
block scales (csrc/include/fusedamp/math/quantized_moments_math.h). The optimizer tests that
SGD's 8-bit momentum buffer shares are parametrized over both (ALGOS); its own are in
test_quantized_momentum.py.

The kernels are checked against an FP64 reference of the same quantized algorithm written
here from the formats' definitions; the optimizer's conversions, checkpoints, skipped steps and
refusals against what the other state dtypes promise."""
import copy
import io

import pytest
import torch

import fusedamp

B = 32
M_LEVELS = 127.0
V_LEVELS = 255.0


# ---------------------------------------------------------------- an FP64 reference
def ref_dequantize(m_codes, v_codes, scales):
    """The values codes and scales stand for (flat, FP64)."""
    n = m_codes.numel()
    block = torch.arange(n, device=m_codes.device) // B
    s = scales.double().reshape(-1, 2)  # any layout of the blocks' rows (canonical or flat)
    q = m_codes.reshape(-1).double()
    m = q * q.abs() * s[block, 0] / (M_LEVELS * M_LEVELS)
    t = v_codes.reshape(-1).double() * s[block, 1] / V_LEVELS
    return m, t ** 4


def ref_quantize(m, v):
    """Codes (as FP64 integers) and scales of flat FP64 moments."""
    n = m.numel()
    pad = (-n) % B
    mb = torch.nn.functional.pad(m, (0, pad)).view(-1, B)
    root = torch.nn.functional.pad(v, (0, pad)).view(-1, B).sqrt().sqrt()
    sm = mb.abs().amax(1, keepdim=True)
    sv = root.amax(1, keepdim=True)
    u = torch.where(sm > 0, mb.abs() / torch.where(sm > 0, sm, 1), 0)
    qm = torch.round(u.sqrt() * M_LEVELS).clamp(0, M_LEVELS) * mb.sign()
    qv = torch.where(sv > 0, torch.round(root / torch.where(sv > 0, sv, 1) * V_LEVELS), 0)
    scales = torch.cat([sm, sv], 1)
    return qm.reshape(-1)[:n], qv.clamp(0, V_LEVELS).reshape(-1)[:n], scales


def ref_adamw_step(p, g, m, v, step, lr, betas, eps, wd):
    """torch.optim.AdamW's single-tensor formula in FP64 on flat tensors (step: before)."""
    b1, b2 = betas
    t = step + 1
    p = p * (1 - lr * wd)
    m = m + (1 - b1) * (g - m)
    v = v * b2 + (1 - b2) * g * g
    denom = v.sqrt() / (1 - b2 ** t) ** 0.5 + eps
    return p - lr / (1 - b1 ** t) * m / denom, m, v


def random_quantized_state(n, device, gen):
    m = torch.randn(n, generator=gen, dtype=torch.float64) * 1e-3
    v = torch.rand(n, generator=gen, dtype=torch.float64) * 1e-6
    qm, qv, scales = ref_quantize(m, v)
    return (qm.to(torch.int8).to(device), qv.to(torch.uint8).to(device),
            scales.float().to(device))


# ---------------------------------------------------------------- the op
@pytest.mark.parametrize("numel", [1, 31, 32, 33, 100, 20000, 40000])
def test_op_step_matches_fp64_reference_of_the_quantized_algorithm(device, numel, record_diff):
    gen = torch.Generator().manual_seed(numel)
    p = torch.randn(numel, generator=gen).to(device)
    g = (torch.randn(numel, generator=gen) * 1e-2).to(device)
    mq, vq, scales = random_quantized_state(numel, device, gen)
    # A few exact zeros: a zero block and zero elements stay exactly zero.
    if numel >= 64:
        g[32:64] = 0
        mq[32:64] = 0
        vq[32:64] = 0
        scales[1] = 0
    step = torch.tensor(4.0, device=device)
    lr, betas, eps, wd = 1e-2, (0.9, 0.999), 1e-8, 0.1
    m0, v0 = ref_dequantize(mq, vq, scales)
    ref_p, ref_m, ref_v = ref_adamw_step(p.double().cpu(), g.double().cpu(), m0.cpu(), v0.cpu(),
                                         4.0, lr, betas, eps, wd)
    ref_qm, ref_qv, ref_scales = ref_quantize(ref_m, ref_v)
    torch.ops.fusedamp.adam_step_(
        [p], [], [g], [mq], [vq], [step], lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
        weight_decay=wd, decoupled_weight_decay=True, moment_scales=[scales])
    assert step.item() == 5.0
    # Against the weight's FP32 rounding plus FP32 arithmetic on an update of about lr.
    dp = ((p.double().cpu() - ref_p).abs() / (ref_p.abs() + lr)).max().item()
    record_diff("int8 moments: weights vs FP64 (rel to |p| + lr)", dp)
    assert dp < 1e-6
    ds = ((scales.double().cpu() - ref_scales).abs() / ref_scales.clamp_min(1e-30)).max().item()
    record_diff("int8 moments: block scales vs FP64 (rel)", ds)
    assert ds < 1e-6
    # FP32 arithmetic may put a value on the other side of a rounding boundary: one code apart
    # at most, and rarely.
    for got, want in ((mq, ref_qm), (vq, ref_qv)):
        diff = (got.double().cpu() - want).abs()
        assert diff.max().item() <= 1
        assert (diff != 0).double().mean().item() < 0.01
    if numel >= 64:
        assert (mq[32:64] == 0).all() and (vq[32:64] == 0).all()
        assert scales[1].tolist() == [0.0, 0.0]


def test_op_codes_a_block_of_subnormal_moments_by_their_companding(device):
    """A block whose largest |m| is below 2^-128, where its reciprocal overflows FP32: its codes
    are those of the same block scaled up, not +-127 for every nonzero element."""
    p = torch.zeros(64, device=device)
    g = torch.zeros(64, device=device)
    g[:32] = torch.linspace(-1.0, 1.0, 32) * 1e-38  # m = (1 - beta1) g: at most 1e-39
    g[32:64] = torch.linspace(-1.0, 1.0, 32)  # a normal block beside it
    mq = torch.zeros(64, dtype=torch.int8, device=device)
    vq = torch.zeros(64, dtype=torch.uint8, device=device)
    scales = torch.zeros(2, 2, device=device)
    step = torch.tensor(0.0, device=device)
    torch.ops.fusedamp.adam_step_(
        [p], [], [g], [mq], [vq], [step], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
        weight_decay=0.0, decoupled_weight_decay=True, moment_scales=[scales])
    m = (g.double() * 0.1).cpu()  # the FP32 m, to FP32's precision of subnormals
    ref_qm, _, ref_scales = ref_quantize(m, (g.double() ** 2 * 1e-3).cpu())
    assert scales[0, 0].item() < 2.0 ** -128
    torch.testing.assert_close(scales[:, 0].double().cpu(), ref_scales[:, 0], rtol=1e-5, atol=0)
    diff = (mq.double().cpu() - ref_qm).abs()
    assert diff.max().item() <= 1, mq[:32].tolist()
    assert mq[:32].abs().tolist() != [127] * 32


def test_op_skipped_step_touches_nothing(device):
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(70, generator=gen).to(device).bfloat16()
    master = p.float()
    g = torch.full_like(p, float("inf"))
    mq, vq, scales = random_quantized_state(70, device, gen)
    before = [t.clone() for t in (p, master, mq, vq, scales)]
    step = torch.tensor(3.0, device=device)
    torch.ops.fusedamp.adam_step_(
        [p], [master], [g], [mq], [vq], [step], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
        weight_decay=0.0, decoupled_weight_decay=True,
        found_inf=torch.ones(1, device=device), inv_scale=torch.ones(1, device=device),
        moment_scales=[scales])
    for a, b in zip((p, master, mq, vq, scales), before):
        assert torch.equal(a, b)
    assert step.item() == 3.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_op_applied_nonfinite_gradient_spoils_only_its_element(device, bad):
    # No loss scaler: a non-finite gradient is applied, as torch's AdamW would apply it. Its
    # weight becomes non-finite and its codes 0; its block's scales are those of the other
    # elements, which step as beside a zero moment (test_quantized_nonfinite.py: the optimizer).
    gen = torch.Generator().manual_seed(1)
    n = 3 * B
    p = torch.randn(n, generator=gen).to(device)
    g = (torch.randn(n, generator=gen) * 1e-2).to(device)
    mq, vq, scales = random_quantized_state(n, device, gen)
    g[B + 7], mq[B + 7], vq[B + 7] = 0, 0, 0
    clean = [t.clone() for t in (p, g, mq, vq, scales)]
    g[B + 7] = bad

    def step(p, g, mq, vq, scales):
        torch.ops.fusedamp.adam_step_(
            [p], [], [g], [mq], [vq], [torch.tensor(2.0, device=device)], lr=1e-2, beta1=0.9,
            beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True,
            moment_scales=[scales])

    step(p, g, mq, vq, scales)
    step(*clean)
    assert scales.isfinite().all() and scales[1].gt(0).all()
    assert mq[B + 7] == 0 and vq[B + 7] == 0
    assert not p[B + 7].isfinite()
    others = torch.arange(n, device=device) != B + 7
    assert torch.equal(p[others], clean[0][others])
    assert torch.equal(mq[others], clean[2][others]) and torch.equal(vq[others], clean[3][others])
    assert torch.equal(scales, clean[4])


def test_op_blocks_follow_each_parameter_not_the_call(device):
    """The same parameters stepped in one call or one call each: the same bits (blocks are
    fixed in each parameter's own elements)."""
    sizes = [5, 33, 64, 1000, 17000]

    def make():
        g2 = torch.Generator().manual_seed(2)
        out = []
        for n in sizes:
            mq, vq, sc = random_quantized_state(n, device, g2)
            out.append([torch.randn(n, generator=g2).to(device),
                        torch.randn(n, generator=g2).to(device), mq, vq, sc,
                        torch.tensor(1.0, device=device)])
        return out

    kw = dict(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01,
              decoupled_weight_decay=True)
    together, apart = make(), make()
    cols = list(zip(*together))
    torch.ops.fusedamp.adam_step_(list(cols[0]), [], list(cols[1]), list(cols[2]),
                                  list(cols[3]), list(cols[5]), moment_scales=list(cols[4]), **kw)
    for p, g, mq, vq, sc, st in apart:
        torch.ops.fusedamp.adam_step_([p], [], [g], [mq], [vq], [st], moment_scales=[sc], **kw)
    for a, b in zip(together, apart):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def _quantized_args(device, n=40):
    p = torch.randn(n, device=device)
    return dict(params=[p], master_params=[], grads=[torch.randn(n, device=device)],
                exp_avgs=[torch.zeros(n, dtype=torch.int8, device=device)],
                exp_avg_sqs=[torch.zeros(n, dtype=torch.uint8, device=device)],
                steps=[torch.zeros((), device=device)],
                moment_scales=[torch.zeros((n + 31) // 32, 2, device=device)])


@pytest.mark.parametrize("flaw, message", [
    ("no_scales", "need their moment_scales"),
    ("scales_shape", "must be a contiguous float32 tensor of shape"),
    ("scales_dtype", "must be a contiguous float32 tensor of shape"),
    ("sq_dtype", "quantized state"),
    ("float_moments", "exp_avgs must be int8 codes"),
    ("amsgrad", "without AMSGrad"),
    ("length", "moment_scales has"),
])
def test_op_refuses_bad_quantized_state_and_changes_nothing(device, flaw, message):
    a = _quantized_args(device)
    n = a["params"][0].numel()
    if flaw == "no_scales":
        del a["moment_scales"]
    elif flaw == "scales_shape":
        a["moment_scales"] = [torch.zeros(3, 2, device=device)]
    elif flaw == "scales_dtype":
        a["moment_scales"] = [torch.zeros(2, 2, device=device, dtype=torch.float64)]
    elif flaw == "sq_dtype":
        a["exp_avg_sqs"] = [torch.zeros(n, dtype=torch.int8, device=device)]
    elif flaw == "float_moments":
        a["exp_avgs"] = [torch.zeros(n, device=device)]
        a["exp_avg_sqs"] = [torch.zeros(n, device=device)]
    elif flaw == "amsgrad":
        a["max_exp_avg_sqs"] = [torch.zeros(n, dtype=torch.uint8, device=device)]
    elif flaw == "length":
        a["moment_scales"] = a["moment_scales"] * 2
    given = {k: list(v) for k, v in a.items()}
    before = {k: [t.clone() for t in v] for k, v in given.items()}
    with pytest.raises(RuntimeError, match=message):
        torch.ops.fusedamp.adam_step_(
            a.pop("params"), a.pop("master_params"), a.pop("grads"), a.pop("exp_avgs"),
            a.pop("exp_avg_sqs"), a.pop("steps"), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=0.0, decoupled_weight_decay=True, **a)
    for k, ts in given.items():
        for t, b in zip(ts, before[k]):
            assert torch.equal(t, b), k


# ---------------------------------------------------------------- the optimizer
def _model(device, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    return model.to(device=device, dtype=dtype)


def _batches(device, steps, dtype):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(16, 4, generator=gen)
    out = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=gen)
        out.append((x.to(device, dtype), (x @ w).to(device)))
    return out


def _train(model, opt, batches):
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# The 8-bit states: how each optimizer is made, its code tensors and their dtypes, its scales.
ALGOS = {
    "adamw": dict(make=lambda params, **kw: fusedamp.optim.AdamW(params, lr=3e-3,
                                                                 weight_decay=0.01, **kw),
                  codes={"exp_avg": torch.int8, "exp_avg_sq": torch.uint8},
                  scales="moment_scales", columns=2),
    "sgd": dict(make=lambda params, **kw: fusedamp.optim.SGD(params, lr=0.02, momentum=0.9,
                                                             nesterov=True, weight_decay=1e-3,
                                                             **kw),
                codes={"momentum_buffer": torch.int8}, scales="momentum_scales", columns=1),
}


def scales_shape(p, columns):
    """[rows, row / 32, columns] where a parameter's rows are whole blocks, else [blocks,
    columns]."""
    rows = p.shape[0] if p.dim() >= 2 else 0
    if rows and (p.numel() // rows) % 32 == 0:
        return (rows, p.numel() // rows // 32, columns)
    return ((p.numel() + 31) // 32, columns)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("master_weights, dtype", [
    (True, torch.bfloat16), ("split", torch.bfloat16), ("kahan", torch.bfloat16),
    ("stochastic", torch.bfloat16), (False, torch.float32), (True, torch.float16)])
def test_optimizer_keeps_codes_and_trains_like_fp32_state(device, master_weights, dtype, algo):
    spec = ALGOS[algo]
    batches = _batches(device, 150, dtype)
    results = {}
    for state_dtype in (torch.float32, torch.int8):
        model = _model(device, dtype)
        opt = spec["make"](model.parameters(), master_weights=master_weights,
                           state_dtype=state_dtype)
        results[state_dtype] = _train(model, opt, batches)
        if state_dtype == torch.int8:
            for p in model.parameters():
                s = opt.state[p]
                for name, code_dtype in spec["codes"].items():
                    assert s[name].dtype == code_dtype and s[name].shape == p.shape
                assert s[spec["scales"]].dtype == torch.float32
                assert s[spec["scales"]].shape == scales_shape(p, spec["columns"])
    fp32, int8 = results[torch.float32], results[torch.int8]
    assert int8[-1] < 0.2 * int8[0]  # it trains
    # The last 20 steps' mean loss within 10 % of FP32 state's (quantization noise).
    mean = lambda xs: sum(xs[-20:]) / 20  # noqa: E731
    assert abs(mean(int8) - mean(fp32)) <= 0.1 * mean(fp32) + 1e-4


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("scales_layout", ["as_saved", "flat"])
def test_resume_from_a_state_dict_is_bit_exact(device, scales_layout, algo):
    """Also from scales laid out flat, [blocks, columns] (the same blocks in the same order:
    what a parameter whose rows are not whole blocks keeps, and earlier checkpoints kept for
    all)."""
    spec = ALGOS[algo]
    batches = _batches(device, 12, torch.bfloat16)
    model = _model(device, torch.bfloat16)
    opt = spec["make"](model.parameters(), master_weights="split", state_dtype=torch.int8)
    _train(model, opt, batches[:6])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, batches[6:])

    buf.seek(0)
    saved = torch.load(buf)
    if scales_layout == "flat":
        shapes = {tuple(st[spec["scales"]].shape) for st in saved["opt"]["state"].values()}
        assert any(len(shape) == 3 for shape in shapes)  # a weight's rows are whole blocks
        for st in saved["opt"]["state"].values():
            st[spec["scales"]] = st[spec["scales"]].reshape(-1, spec["columns"])
    model2 = _model(device, torch.bfloat16)
    model2.load_state_dict(saved["model"])
    opt2 = spec["make"](model2.parameters(), master_weights="split", state_dtype=torch.int8)
    opt2.load_state_dict(saved["opt"])
    _train(model2, opt2, batches[6:])
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), model2.parameters()):
        for k in (*spec["codes"], spec["scales"], "param_remainder", "step"):
            assert torch.equal(opt.state[p][k], opt2.state[q][k]), k


def check_skipped_step_changes_nothing(device, make_opt):
    """An inf in one gradient under the loss scaler: the step leaves codes, scales, every other
    state and the weights bit for bit, and counts the skip."""
    model = _model(device, torch.float16)
    opt = make_opt(model.parameters())
    scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 10)
    x, y = _batches(device, 1, torch.float16)[0]
    for inject in (False, True):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        if inject:
            next(model.parameters()).grad[0, 0] = float("inf")
            before = copy.deepcopy(opt.state_dict())
            weights = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
    after = opt.state_dict()
    for i, s in before["state"].items():
        for k, t in s.items():
            assert torch.equal(t, after["state"][i][k]), k
    for w, p in zip(weights, model.parameters()):
        assert torch.equal(w, p)
    assert opt.skipped_steps == 1


def test_skipped_step_changes_nothing(device):
    check_skipped_step_changes_nothing(
        device, lambda params: fusedamp.optim.AdamW(params, lr=1e-3, state_dtype=torch.int8))


def test_state_conversions_between_fp32_and_int8(device):
    """FP32 -> int8 gives the codes and scales a quantization of the FP32 moments gives;
    int8 -> FP32 the values the codes stand for (convert_param_state, which the optimizer's
    load and the ZeRO front end use)."""
    from fusedamp import _C

    batches = _batches(device, 5, torch.float32)
    model = _model(device, torch.float32)
    fp32_opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, fp32_opt, batches)
    for i, p in enumerate(model.parameters()):
        s = fp32_opt.state[p]
        qm, qv, scales = ref_quantize(s["exp_avg"].double().reshape(-1).cpu(),
                                      s["exp_avg_sq"].double().reshape(-1).cpu())
        _, got = _C.convert_param_state(p.detach(), dict(s), True, torch.int8, i)
        assert got["exp_avg"].dtype == torch.int8 and got["exp_avg_sq"].dtype == torch.uint8
        assert (got["exp_avg"].reshape(-1).double().cpu() - qm).abs().max() <= 1
        assert (got["exp_avg_sq"].reshape(-1).double().cpu() - qv).abs().max() <= 1
        assert list(got["moment_scales"].shape) == fusedamp._C.moment_scales_shape(p)
        assert torch.allclose(got["moment_scales"].double().reshape(-1, 2).cpu(), scales,
                              rtol=1e-6, atol=0)
        _, back = _C.convert_param_state(p.detach(), got, True, torch.float32, i)
        m, v = ref_dequantize(got["exp_avg"].cpu(), got["exp_avg_sq"].cpu(),
                              got["moment_scales"].cpu())
        assert back["exp_avg"].dtype == torch.float32 and "moment_scales" not in back
        assert torch.allclose(back["exp_avg"].reshape(-1).double().cpu(), m, rtol=1e-6, atol=0)
        assert torch.allclose(back["exp_avg_sq"].reshape(-1).double().cpu(), v, rtol=1e-6,
                              atol=0)


def test_state_conversion_of_subnormal_moments(device):
    """FP32 -> int8 of a block whose largest |m| is subnormal (its reciprocal overflows FP32)
    gives the codes of its companding."""
    from fusedamp import _C

    p = torch.nn.Parameter(torch.zeros(40, device=device))
    m = torch.linspace(-1.0, 1.0, 40, device=device) * 1e-39
    v = torch.linspace(0.0, 1.0, 40, device=device) * 1e-30
    state = {"step": torch.tensor(3.0), "exp_avg": m, "exp_avg_sq": v}
    _, got = _C.convert_param_state(p.detach(), state, True, torch.int8, 0)
    qm, qv, _ = ref_quantize(m.double().cpu(), v.double().cpu())
    assert (got["exp_avg"].double().cpu() - qm).abs().max() <= 1
    assert (got["exp_avg_sq"].double().cpu() - qv).abs().max() <= 1


def test_loading_into_another_state_dtype_keeps_the_optimizers_own(device):
    batches = _batches(device, 5, torch.float32)
    model = _model(device, torch.float32)
    int8_opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3, state_dtype=torch.int8)
    _train(model, int8_opt, batches)
    fp32_opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3)
    fp32_opt.load_state_dict(int8_opt.state_dict())
    _train(model, fp32_opt, batches[:1])
    for p in model.parameters():
        assert fp32_opt.state[p]["exp_avg"].dtype == torch.float32
        assert "moment_scales" not in fp32_opt.state[p]
    again = fusedamp.optim.AdamW(model.parameters(), lr=1e-3, state_dtype=torch.int8)
    again.load_state_dict(fp32_opt.state_dict())
    _train(model, again, batches[:1])
    for p in model.parameters():
        assert again.state[p]["exp_avg"].dtype == torch.int8


def test_refusals_change_nothing(device):
    model = _model(device, torch.float32)
    with pytest.raises(ValueError, match="AMSGrad"):
        fusedamp.optim.Adam(model.parameters(), amsgrad=True, state_dtype=torch.int8)
    with pytest.raises(ValueError, match="state_dtype"):
        fusedamp.optim.AdamW(model.parameters(), state_dtype=torch.int16)
    # A group switched to int8 with amsgrad on: the step refuses before anything changes.
    opt = fusedamp.optim.Adam(model.parameters(), lr=1e-3, amsgrad=True)
    _train(model, opt, _batches(device, 2, torch.float32))
    before = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["state_dtype"] = torch.int8
    with pytest.raises(ValueError, match="AMSGrad"):
        opt.step()
    for w, p in zip(weights, model.parameters()):
        assert torch.equal(w, p)
    for i, s in before["state"].items():
        for k, t in s.items():
            assert torch.equal(t, opt.state_dict()["state"][i][k]), k


def test_state_bytes_per_parameter(device):
    """BF16 weights and gradients, "split" remainders, int8 moments: 2 + 2 + 2 + 2.25 B."""
    model = _model(device, torch.bfloat16)
    opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3, master_weights="split",
                               state_dtype=torch.int8)
    _train(model, opt, _batches(device, 1, torch.bfloat16))
    n = sum(p.numel() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for p in model.parameters()
                for k, t in opt.state[p].items() if k != "step")
    per_param = state / n
    blocks = sum((p.numel() + 31) // 32 for p in model.parameters())
    assert per_param == pytest.approx((2 * n + 2 * n + 8 * blocks) / n)


def test_initialize_takes_int8_state(device):
    model = _model(device, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, scaler = fusedamp.initialize(model, opt, torch.bfloat16,
                                             master_weights="split", state_dtype=torch.int8)
    x, y = _batches(device, 1, torch.float32)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert all(opt.state[p]["exp_avg"].dtype == torch.int8 for p in model.parameters())
