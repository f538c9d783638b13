"""state_dtype=torch.int8 in adam_step_: Adam's moments as 8-bit codes in blocks of 32 elements
with FP32 block scales (csrc/include/fusedamp/math/quantized_moments_math.h), checked against
the FP64 reference of the same quantized algorithm in quantized_helpers.py: one step, subnormal
blocks, skipped steps, non-finite gradients, blocks per parameter, and the refusals of a bad
quantized state. The optimizer over these codes: test_quantized_moments_optimizer.py."""
import pytest
import torch

from quantized_helpers import (SCALES_FLAWS, B, check_op_refuses_and_changes_nothing,
                               check_op_skipped_step_touches_nothing, check_step_against_fp64,
                               random_quantized_state,
                               ref_adamw_step, ref_dequantize, ref_quantize, scales_flaw_cases,
                               spoil_scales)


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
    check_step_against_fp64(record_diff, "int8 moments", lr, p, ref_p, scales, ref_scales,
                            [(mq, ref_qm), (vq, ref_qv)])
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
    def step_op(p, master, g, state, step, **scalars):
        mq, vq, scales = state
        torch.ops.fusedamp.adam_step_(
            [p], [master], [g], [mq], [vq], [step], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=0.0, decoupled_weight_decay=True, moment_scales=[scales], **scalars)

    check_op_skipped_step_touches_nothing(device, random_quantized_state, step_op)


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


@pytest.mark.parametrize("flaw, message", scales_flaw_cases("moment_scales") + [
    ("scales_shape", "must be a contiguous float32 tensor of shape"),
    ("sq_dtype", "quantized state"),
    ("float_moments", "exp_avgs must be int8 codes"),
    ("amsgrad", "without AMSGrad"),
])
def test_op_refuses_bad_quantized_state_and_changes_nothing(device, flaw, message):
    a = _quantized_args(device)
    n = a["params"][0].numel()
    if flaw in SCALES_FLAWS:
        spoil_scales(a, "moment_scales", flaw)
    elif flaw == "scales_shape":
        a["moment_scales"] = [torch.zeros(3, 2, device=device)]
    elif flaw == "sq_dtype":
        a["exp_avg_sqs"] = [torch.zeros(n, dtype=torch.int8, device=device)]
    elif flaw == "float_moments":
        a["exp_avgs"] = [torch.zeros(n, device=device)]
        a["exp_avg_sqs"] = [torch.zeros(n, device=device)]
    elif flaw == "amsgrad":
        a["max_exp_avg_sqs"] = [torch.zeros(n, dtype=torch.uint8, device=device)]
    check_op_refuses_and_changes_nothing(
        torch.ops.fusedamp.adam_step_, a, message, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
        weight_decay=0.0, decoupled_weight_decay=True)
