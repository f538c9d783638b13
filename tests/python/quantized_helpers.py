"""What the 8-bit-state tests share: an FP64 reference of Adam's quantized moments (int8 codes
of m, square-root companded, and uint8 codes of v's fourth root, in blocks of 32 elements with
FP32 block scales: csrc/include/fusedamp/math/quantized_moments_math.h) written from the
formats' definitions, and the small model the optimizer tests of Adam's moments and SGD's
momentum buffer train, with the checks both run: a skipped step changes nothing, and
fusedamp.initialize takes int8 state; and the checks of both ops: a step against the FP64
reference of its algorithm, a skipped step touches nothing, the refusals of bad block scales,
and a refused call changes nothing."""
import copy

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


# ---------------------------------------------------------------- a model to train
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


def check_op_skipped_step_touches_nothing(device, random_state, step_op):
    """A step with found_inf set leaves the BF16 weights, their FP32 masters, the quantized state
    (random_state(n, device, gen): its codes and scales) and the step count as they were.
    step_op(p, master, g, state, step, **scalars) runs the op on one tensor."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(70, generator=gen).to(device).bfloat16()
    master = p.float()
    g = torch.full_like(p, float("inf"))
    state = random_state(70, device, gen)
    before = [t.clone() for t in (p, master, *state)]
    step = torch.tensor(3.0, device=device)
    step_op(p, master, g, state, step,
            found_inf=torch.ones(1, device=device), inv_scale=torch.ones(1, device=device))
    for a, b in zip((p, master, *state), before):
        assert torch.equal(a, b)
    assert step.item() == 3.0


def check_step_against_fp64(record_diff, what, lr, p, ref_p, scales, ref_scales, codes):
    """An op's quantized step against the FP64 reference of its algorithm (record_diff states
    each error, named by `what`): the weights to their FP32 rounding plus FP32 arithmetic on an
    update of about lr, the block scales to 1e-6, and every code of `codes` ((got, reference)
    pairs) at most one apart, and rarely: FP32 arithmetic may put a value on the other side of
    a rounding boundary."""
    dp = ((p.double().cpu() - ref_p).abs() / (ref_p.abs() + lr)).max().item()
    record_diff(f"{what}: weights vs FP64 (rel to |p| + lr)", dp)
    assert dp < 1e-6
    ds = ((scales.double().cpu() - ref_scales).abs() / ref_scales.clamp_min(1e-30)).max().item()
    record_diff(f"{what}: block scales vs FP64 (rel)", ds)
    assert ds < 1e-6
    for got, want in codes:
        diff = (got.double().cpu() - want).abs()
        assert diff.max().item() <= 1
        assert (diff != 0).double().mean().item() < 0.01


# The refusals of a quantized state's block scales, one check for adam_step_'s moment_scales
# and sgd_step_'s momentum_scales (ops/step_checks.cpp, with the op's name of its scales).
SCALES_FLAWS = ("no_scales", "scales_dtype", "length")


def scales_flaw_cases(scales):
    """(flaw, message) of each of SCALES_FLAWS for an op whose scales argument is `scales`."""
    return [("no_scales", f"need their {scales}"),
            ("scales_dtype", "must be a contiguous float32 tensor of shape"),
            ("length", f"{scales} has")]


def spoil_scales(args, scales, flaw):
    """Makes args' list `scales` bad as flaw (one of SCALES_FLAWS) says: absent, FP64, or one
    tensor per parameter too many."""
    if flaw == "no_scales":
        del args[scales]
    elif flaw == "scales_dtype":
        args[scales] = [t.double() for t in args[scales]]
    elif flaw == "length":
        args[scales] = args[scales] * 2


def check_op_refuses_and_changes_nothing(op, args, message, **hyper):
    """op(**args, **hyper) raises a RuntimeError matching message, and every tensor of args (a
    dict of tensor lists) is as it was."""
    before = {k: [t.clone() for t in v] for k, v in args.items()}
    with pytest.raises(RuntimeError, match=message):
        op(**{k: list(v) for k, v in args.items()}, **hyper)
    for k, ts in args.items():
        for t, b in zip(ts, before[k]):
            assert torch.equal(t, b), k


def check_initialize_takes_int8_state(device, make_torch_opt, state_key):
    """fusedamp.initialize of a torch optimizer with state_dtype=torch.int8: after one step every
    parameter's `state_key` holds int8 codes."""
    model = _model(device, torch.float32)
    opt = make_torch_opt(model.parameters())
    model, opt, scaler = fusedamp.initialize(model, opt, torch.bfloat16,
                                             master_weights="split", state_dtype=torch.int8)
    x, y = _batches(device, 1, torch.float32)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert all(opt.state[p][state_key].dtype == torch.int8 for p in model.parameters())
