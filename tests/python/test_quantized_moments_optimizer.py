"""state_dtype=torch.int8 in the optimizers: Adam's moments as 8-bit codes with block scales
(the op: test_quantized_moments_op.py). The optimizer tests that SGD's 8-bit momentum buffer
shares are parametrized over both (ALGOS); its own are in test_quantized_momentum.py.

The optimizer's training, conversions, checkpoints, skipped steps and refusals are checked
against what the other state dtypes promise and against the FP64 reference of the format in
quantized_helpers.py."""
import copy
import io

import pytest
import torch

import fusedamp
from quantized_helpers import (_batches, _model, _train, check_initialize_takes_int8_state,
                               check_skipped_step_changes_nothing, ref_dequantize, ref_quantize)


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
    check_initialize_takes_int8_state(
        device, lambda params: torch.optim.AdamW(params, lr=1e-3), "exp_avg")
