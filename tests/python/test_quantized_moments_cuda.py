"""adam_step_ with quantized moments (moment_scales: int8 exp_avg and uint8 exp_avg_sq codes with
FP32 block scales, csrc/include/fusedamp/math/quantized_moments_math.h), and sgd_step_ with a
quantized momentum buffer (momentum_scales), on CUDA against the CPU kernel on identical
inputs, for every weight store, param and grad dtype, sizes around a moment block (32) and a
chunk (32768), tensors starting at odd element offsets, device scalars, a skipped step, and
more tensors than one launch's metadata holds.

The kernels compute the same formulas in FP32 with the same roundings (docs/engine.md, "Same
bits everywhere"; test_cuda_same_bits.py compares the bits), but the per-tensor coefficients
come from each side's FP64 pow: a moment one FP32 rounding apart may sit on the other side of a
code's rounding boundary, and the next step starts from stored moments a code apart. So few
codes differ at all; the stored values, scales and weights agree to FP32 rounding plus how far
such codes can carry them (quantized_spread.py: a median 1-2 % of a weight's change over these
steps, which a block scale 5 % off exceeds: test_quantized_spread.py); the step counts
exactly."""
import pytest
import torch

from quantized_spread import StepSpread, adam_values, assert_within, momentum_values

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

B = 32
# One element, a block less one, one block, one more, an odd size, three chunks with a partial
# last block, a 2-D tensor, an empty one.
SHAPES = [(1,), (31,), (32,), (33,), (1000,), (70000,), (37, 29), (0,)]

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (master_weights, param dtype): every weight store the CPU kernel has.
STORES = [("none", F32), ("none", F16), ("none", BF16), ("master", F32), ("master", F16),
          ("master", BF16), ("split", BF16), ("kahan", F16), ("kahan", BF16),
          ("stochastic", BF16)]

# Hyper-parameters of the successive steps: AdamW with the device scalars, Adam with L2 decay
# maximizing and writing the multiplied grads back, a step skipped by found_inf, a plain one;
# SGD's: its first step (the buffer becomes the gradient) with the device scalars, Nesterov
# maximizing and writing the grads back, a skipped step, dampening.
SGD_STEPS = [
    dict(weight_decay=0.01, nesterov=False, dampening=0.0,
         scalars=dict(inv_scale=0.5, found_inf=0.0)),
    dict(weight_decay=0.1, nesterov=True, dampening=0.0, maximize=True, write_back_grads=True,
         scalars=dict(lr_tensor=2e-2, inv_scale=0.25)),
    dict(weight_decay=0.01, nesterov=False, dampening=0.0, scalars=dict(found_inf=1.0)),
    dict(weight_decay=0.0, nesterov=False, dampening=0.3, scalars={}),
]
STEPS = [
    dict(weight_decay=0.01, decoupled_weight_decay=True, scalars=dict(inv_scale=0.5,
                                                                    found_inf=0.0)),
    dict(weight_decay=0.1, decoupled_weight_decay=False, maximize=True, write_back_grads=True,
         scalars=dict(lr_tensor=2e-3, inv_scale=0.25)),
    dict(weight_decay=0.01, decoupled_weight_decay=True, scalars=dict(found_inf=1.0)),
    dict(weight_decay=0.0, decoupled_weight_decay=True, scalars={}),
]
ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
SGD = dict(lr=1e-2, momentum=0.9)


def dtype_id(d):
    return str(d).replace("torch.", "")


def problem(store, pdtype, gdtype, shapes, seed, op="adam_step_"):
    """CPU tensors of one problem: params, master_params, zero codes and scales, step counts,
    one list of grads per step, rounding seeds (or None)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(pdtype) for s in shapes]
    if store == "master":
        masters = [p.float().clone() for p in params]
    elif store == "split":
        masters = [torch.randint(-3000, 3000, s, generator=gen, dtype=torch.int16)
                   for s in shapes]
    elif store == "kahan":
        masters = [(torch.randn(s, generator=gen) * 1e-3).to(pdtype) for s in shapes]
    else:
        masters = []
    numels = [p.numel() for p in params]
    if op == "adam_step_":
        state = dict(
            params=params, master_params=masters,
            exp_avgs=[torch.zeros_like(p, dtype=torch.int8) for p in params],
            exp_avg_sqs=[torch.zeros_like(p, dtype=torch.uint8) for p in params],
            steps=[torch.zeros(()) for _ in params],
            moment_scales=[torch.zeros((n + B - 1) // B, 2) for n in numels])
    else:
        state = dict(
            params=params, master_params=masters,
            momentum_buffers=[torch.zeros_like(p, dtype=torch.int8) for p in params],
            steps=[torch.zeros(()) for _ in params],
            momentum_scales=[torch.zeros((n + B - 1) // B, 1) for n in numels])
    grads = [[(torch.randn(s, generator=gen) * 2e-2).to(gdtype) for s in shapes]
             for _ in STEPS]
    seeds = [1000 + 7 * i for i in range(len(shapes))] if store == "stochastic" else None
    return state, grads, seeds


def place(t, device, offset):
    """A copy of t on device starting `offset` elements into its storage (an odd offset leaves
    every pointer off its vector alignment, and a moment_scales row off 8 bytes)."""
    if t.dim() == 0:
        return t.to(device, copy=True)  # a copy on the CPU too: the problem stays as it was
    buf = torch.zeros(t.numel() + offset, dtype=t.dtype, device=device)
    v = buf[offset:].view(t.shape)
    v.copy_(t)
    return v


def _spread_before(spread, s, grads, hyper, op):
    """Tell spread (quantized_spread.StepSpread) about the step about to be taken."""
    scalars = hyper["scalars"]
    lr = scalars.get("lr_tensor", (ADAM if op == "adam_step_" else SGD)["lr"])
    for i, g in enumerate(grads):
        before = s["steps"][i].item()
        if op == "sgd_step_":
            spread.before(i, None, None, None, before, **dict(SGD, lr=lr),
                          nesterov=hyper["nesterov"])
            continue
        g = g.cpu().double() * scalars.get("inv_scale", 1.0)
        g = -g if hyper.get("maximize") else g
        if not hyper["decoupled_weight_decay"]:
            g = g + hyper["weight_decay"] * s["params"][i].cpu().double()
        spread.before(i, (s["exp_avgs"][i].cpu(), s["exp_avg_sqs"][i].cpu()),
                      s["moment_scales"][i].cpu(), g, before, **dict(ADAM, lr=lr))


def _spread_after(spread, s, op):
    names = (("exp_avgs", "exp_avg_sqs"), "moment_scales") if op == "adam_step_" else (
        ("momentum_buffers",), "momentum_scales")
    for i in range(len(s["steps"])):
        spread.after(i, [s[k][i].cpu() for k in names[0]], s[names[1]][i].cpu())


def run(device, state, grads, seeds, offset, op="adam_step_", between_steps=None):
    """The steps of STEPS (SGD_STEPS) on copies of the problem on `device`: everything they
    touched, on the CPU, and how far another run whose codes may round the other way could be
    from it (quantized_spread.StepSpread). between_steps(state, step) may change the state
    before each step."""
    s = {k: [place(t, device, offset) for t in ts] for k, ts in state.items()}
    spread = StepSpread(op, [t.numel() for t in state["params"]])
    used_grads = []
    for step, (hyper, g) in enumerate(zip(STEPS if op == "adam_step_" else SGD_STEPS, grads)):
        if between_steps is not None:
            between_steps(s, step)
        g = [place(t, device, offset) for t in g]
        applied = not hyper["scalars"].get("found_inf", 0.0)
        if applied:
            _spread_before(spread, s, g, hyper, op)
        kw = {k: v for k, v in hyper.items() if k != "scalars"}
        for name, value in hyper["scalars"].items():
            kw[name] = torch.full((1,), value, device=device)
        if op == "adam_step_":
            torch.ops.fusedamp.adam_step_(
                s["params"], s["master_params"], g, s["exp_avgs"], s["exp_avg_sqs"],
                s["steps"], rounding_seeds=seeds, moment_scales=s["moment_scales"], **ADAM,
                **kw)
        else:
            torch.ops.fusedamp.sgd_step_(
                s["params"], s["master_params"], g, s["momentum_buffers"], s["steps"],
                rounding_seeds=seeds, momentum_scales=s["momentum_scales"], **SGD, **kw)
        if applied:
            _spread_after(spread, s, op)
        used_grads.append(g)
    out = {k: [t.cpu() for t in ts] for k, ts in s.items()}
    out["grads"] = [t.cpu() for g in used_grads for t in g]
    return out, spread


def _weights(out, store, pdtype):
    """The FP32 value each step left behind per tensor: the master, the split pair, the Kahan
    sum, or the weight itself."""
    if store == "master":
        return out["master_params"]
    if store == "split":
        values = []
        for w, r in zip(out["params"], out["master_params"]):
            bits = ((w.view(torch.int16).to(torch.int64) & 0xFFFF) << 16) + r.to(torch.int64)
            bits = bits & 0xFFFFFFFF
            bits = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits)  # as int32 patterns
            values.append(bits.to(torch.int32).view(torch.float32))
        return values
    if store == "kahan":
        return [w.float() + c.float() for w, c in zip(out["params"], out["master_params"])]
    return [w.float() for w in out["params"]]


def assert_matches_cpu(cuda, cpu, store, pdtype):
    """cuda and cpu: run()'s results; the spreads are the CPU run's."""
    (cuda, _), (cpu, spread) = cuda, cpu
    assert cuda.keys() == cpu.keys()
    for name in cpu:
        assert len(cuda[name]) == len(cpu[name]), name
        for a, b in zip(cuda[name], cpu[name]):
            assert a.dtype == b.dtype and a.shape == b.shape, name
    for a, b in zip(cuda["steps"], cpu["steps"]):
        assert torch.equal(a, b)
    for name in ("exp_avgs", "exp_avg_sqs", "momentum_buffers"):
        if name not in cpu:
            continue
        a = torch.cat([t.reshape(-1).int() for t in cuda[name]])
        b = torch.cat([t.reshape(-1).int() for t in cpu[name]])
        assert (a != b).float().mean().item() <= 0.01, name  # rounded the other way: rarely
    adam = "moment_scales" in cpu
    scales = "moment_scales" if adam else "momentum_scales"
    for i, (a, b) in enumerate(zip(cuda[scales], cpu[scales])):
        assert_within(a, b, spread.scales[i], rtol=1e-5, atol=0, what=f"{scales}[{i}]")
        if adam:
            got = adam_values(cuda["exp_avgs"][i], cuda["exp_avg_sqs"][i], a)
            want = adam_values(cpu["exp_avgs"][i], cpu["exp_avg_sqs"][i], b)
        else:
            got = [momentum_values(cuda["momentum_buffers"][i], a)]
            want = [momentum_values(cpu["momentum_buffers"][i], b)]
        for j, (x, y) in enumerate(zip(got, want)):
            assert_within(x, y, spread.stored[i][j], rtol=1e-5, atol=0,
                          what=f"stored state {j} of tensor {i}")
    low = pdtype != torch.float32 and store in ("none", "stochastic")
    tol = dict(rtol=2 ** -7, atol=1e-6) if low else dict(rtol=1e-5, atol=1e-6)
    weights = zip(_weights(cuda, store, pdtype), _weights(cpu, store, pdtype))
    for i, (a, b) in enumerate(weights):
        assert_within(a, b, spread.weights[i], **tol, what=f"weights[{i}]")
    for a, b in zip(cuda["grads"], cpu["grads"]):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "odd"])
@pytest.mark.parametrize("grad_fp32", [False, True], ids=["grad_like_param", "grad_fp32"])
@pytest.mark.parametrize("store, pdtype", STORES,
                         ids=[f"{s}-{dtype_id(d)}" for s, d in STORES])
def test_quantized_adam_matches_cpu(store, pdtype, grad_fp32, offset):
    if grad_fp32 and pdtype == F32:
        pytest.skip("FP32 params: the grads are FP32 either way")
    gdtype = F32 if grad_fp32 else pdtype
    state, grads, seeds = problem(store, pdtype, gdtype, SHAPES, seed=17)
    cpu = run("cpu", state, grads, seeds, offset)
    cuda = run("cuda", state, grads, seeds, offset)
    assert_matches_cpu(cuda, cpu, store, pdtype)
    # Three steps applied (one skipped) and the moments really quantized, not left at zero.
    assert all(t.item() == 3.0 for t in cpu[0]["steps"])
    assert any(t.ne(0).any() for t in cpu[0]["exp_avgs"])
    assert any(t.ne(0).any() for t in cpu[0]["moment_scales"])


def test_quantized_adam_over_several_launches_matches_cpu():
    """More tensors than one launch's metadata holds (several launches of one call), of sizes
    around a moment block: each launch finds its tensors' scales."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(int(n),) for n in torch.randint(1, 100, (1200,), generator=gen)]
    state, grads, seeds = problem("master", BF16, BF16, shapes, seed=5)
    assert_matches_cpu(run("cuda", state, grads, seeds, 0), run("cpu", state, grads, seeds, 0),
                       "master", BF16)


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "odd"])
@pytest.mark.parametrize("store, pdtype", STORES,
                         ids=[f"{s}-{dtype_id(d)}" for s, d in STORES])
def test_quantized_sgd_matches_cpu(store, pdtype, offset):
    state, grads, seeds = problem(store, pdtype, pdtype, SHAPES, seed=19, op="sgd_step_")
    cpu = run("cpu", state, grads, seeds, offset, op="sgd_step_")
    cuda = run("cuda", state, grads, seeds, offset, op="sgd_step_")
    assert_matches_cpu(cuda, cpu, store, pdtype)
    assert all(t.item() == 3.0 for t in cpu[0]["steps"])
    assert any(t.ne(0).any() for t in cpu[0]["momentum_buffers"])
    assert any(t.ne(0).any() for t in cpu[0]["momentum_scales"])
