"""CUDA against the CPU kernels for the optimizer steps: adam_step_ and sgd_step_ over every
dtype combination, with and without FP32 master weights, at odd element offsets (the scalar
path) and in a channels-last layout; one step tensor shared by several entries; edited weights
taken into the masters; the 16-bit weight stores ("split", "kahan", "stochastic"). Every
fused step runs with host synchronisation forbidden."""
import pytest
import torch

from cuda_helpers import (ALL, LOW, SIZES, assert_same, cuda_call, dtype_id, on_both, place,
                          rand, state_tol)
from op_helpers import needs_cuda, ops
from op_inputs import op_inputs

pytestmark = needs_cuda


# ------------------------------------------------------------ adam_step_
def _adam_problem(pdtype, gdtype, master, gen):
    """One Adam problem on the CPU with non-zero state. Per size, in this order of draws: the
    weight, the grad, both moments, and a step count of i % 5."""
    draws = [(rand(s, torch.float32, gen), rand(s, gdtype, gen, scale=64.0),
              rand(s, torch.float32, gen, scale=0.1),
              rand(s, torch.float32, gen, scale=0.01, positive=True)) for s in SIZES]
    weights, grads, m, v = (list(x) for x in zip(*draws))
    inp = op_inputs("cpu", param_dtype=pdtype, master_weights=master, weights=weights,
                    grads=grads, scalars=dict(lr_tensor=2e-3, inv_scale=1 / 64.0, found_inf=0.0,
                                              grad_sum_sq=4.0e8))  # the clip is active
    inp.exp_avgs, inp.exp_avg_sqs = m, v
    inp.steps = [torch.full((), float(i % 5)) for i in range(len(SIZES))]
    return inp


@pytest.mark.parametrize("pdtype", ALL, ids=dtype_id)
@pytest.mark.parametrize("grad_fp32", [False, True])
@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("offsets", [{}, {"grads": 1},
                                     {"params": 3, "master_params": 1, "exp_avgs": 2,
                                      "exp_avg_sqs": 5}, {"grads": 4}],
                         ids=["aligned", "grad+1", "all-odd", "grad+4"])
def test_adam_matches_cpu(pdtype, grad_fp32, master, offsets):
    if master and pdtype == torch.float32 and offsets:
        pytest.skip("FP32 master weights for FP32 params: covered by the aligned case")
    gen = torch.Generator().manual_seed(21)
    gdtype = torch.float32 if grad_fp32 else pdtype
    cpu, cuda = on_both(_adam_problem(pdtype, gdtype, master, gen), offsets)
    for step, (wd, decoupled, maximize) in enumerate([(0.01, True, False), (0.1, False, True),
                                                       (0.0, True, False)]):
        kw = dict(lr=1e-3, beta1=0.9, beta2=0.995, eps=1e-8, weight_decay=wd,
                  decoupled_weight_decay=decoupled, maximize=maximize)
        if step != 2:
            kw.update(max_grad_norm=1.0)
        else:  # a plain step: none of the device scalars
            kw.update(lr_tensor=None, inv_scale=None, found_inf=None)
        cpu.call("adam_step_", **kw)
        cuda_call(cuda.call, "adam_step_", **kw)
    # FP32 state: the same formula, only FMA contraction differs.
    tol = state_tol(pdtype, master)
    assert_same(cuda.exp_avgs, cpu.exp_avgs, **tol)
    assert_same(cuda.exp_avg_sqs, cpu.exp_avg_sqs, **tol)
    assert_same(cuda.master_params, cpu.master_params, **tol)
    # Low-precision params may differ by one rounding step where FP32 values straddle it.
    assert_same(cuda.params, cpu.params, **({"rtol": 1e-5, "atol": 1e-6}
                                            if pdtype == torch.float32 else {}))
    assert_same(cuda.steps, cpu.steps, exact=True)
    if master:
        for p, mp in zip(cuda.params, cuda.master_params):
            assert torch.equal(p, mp.to(pdtype))


def test_adam_channels_last_layout():
    gen = torch.Generator().manual_seed(5)
    p = rand((4, 6, 5, 7), torch.float32, gen).contiguous(memory_format=torch.channels_last)
    g = rand((4, 6, 5, 7), torch.float32, gen).contiguous(memory_format=torch.channels_last)
    res = {}
    for dev in ["cpu", "cuda"]:
        # Each device starts from its own copy of p (op_inputs copies weights and grads).
        inp = op_inputs(dev, weights=[p], grads=[g])
        fn = cuda_call if dev == "cuda" else (lambda op, *a, **k: op(*a, **k))
        for _ in range(3):
            fn(inp.call, "adam_step_", lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=0.0, decoupled_weight_decay=True)
        res[dev] = inp.params[0]
    assert res["cuda"].is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(res["cuda"].cpu(), res["cpu"], rtol=1e-5, atol=1e-6)


def test_shared_step_tensor_counts_like_cpu():
    # The CPU adds 1 per list entry; the CUDA follow-up kernel must not lose increments.
    out = {}
    for dev in ["cpu", "cuda"]:
        ones = [torch.ones(5)] * 4
        inp = op_inputs(dev, weights=ones, grads=ones, moments=False)
        inp.steps = [torch.zeros((), device=dev)] * 4  # one step tensor for every entry
        fn = cuda_call if dev == "cuda" else (lambda op, *a, **k: op(*a, **k))
        fn(inp.call, "sgd_step_", lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0,
           nesterov=False)
        out[dev] = inp.steps[0].item()
    assert out["cuda"] == out["cpu"] == 4.0


# ------------------------------------------------------------ sgd_step_
@pytest.mark.parametrize("pdtype", ALL, ids=dtype_id)
@pytest.mark.parametrize("grad_fp32", [False, True])
@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("unaligned", [False, True])
def test_sgd_matches_cpu(pdtype, grad_fp32, master, unaligned):
    gdtype = torch.float32 if grad_fp32 else pdtype
    configs = [dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0),
               dict(momentum=0.9, dampening=0.1, nesterov=False, weight_decay=1e-3),
               dict(momentum=0.8, dampening=0.0, nesterov=True, weight_decay=0.0)]
    for cfg in configs:
        gen = torch.Generator().manual_seed(31)
        off = 1 if unaligned else 0
        p32 = [rand(s, torch.float32, gen) for s in SIZES]
        inp = op_inputs("cpu", param_dtype=pdtype, master_weights=master, moments=False,
                        momentum=cfg["momentum"] != 0, weights=p32, grads=[],  # drawn per step
                        scalars=dict(inv_scale=0.5))
        offsets = {"params": off, "master_params": 2 * off, "momentum_buffers": 3 * off}
        cpu, cuda = on_both(inp, offsets)
        for step in range(3):  # step 0 initialises the momentum buffers
            grads = [rand(s, gdtype, gen) for s in SIZES]
            cpu.grads = [place(g, "cpu", off) for g in grads]
            cuda.grads = [place(g, "cuda", off) for g in grads]
            cpu.call("sgd_step_", lr=0.05, maximize=step == 1, **cfg)
            cuda_call(cuda.call, "sgd_step_", lr=0.05, maximize=step == 1, **cfg)
        assert_same(cuda.momentum_buffers, cpu.momentum_buffers, **state_tol(pdtype, master))
        assert_same(cuda.master_params, cpu.master_params, **state_tol(pdtype, master))
        assert_same(cuda.params, cpu.params, **({"rtol": 1e-5, "atol": 1e-6}
                                                if pdtype == torch.float32 else {}))
        assert_same(cuda.steps, cpu.steps, exact=True)


@pytest.mark.parametrize("pdtype", LOW, ids=dtype_id)
def test_edit_adoption_is_bit_exact_against_cpu(pdtype):
    """Masters whose weights were edited between steps (clamped, zeroed, replaced): the CUDA step
    takes the same edits into the same masters as the CPU, bit for bit (SGD with lr=1 and no
    momentum or decay: one subtraction, no contraction for the compilers to differ on)."""
    gen = torch.Generator().manual_seed(17)
    sizes = [(40_000,), (33, 17), (5,)]
    weights = [rand(s, torch.float32, gen) for s in sizes]
    grads = [rand(s, pdtype, gen, scale=1e-3) for s in sizes]
    base = op_inputs("cpu", param_dtype=pdtype, master_weights=True, momentum=False,
                     weights=weights, grads=grads, scalars=dict(found_inf=0.0))
    cpu, cuda = on_both(base)
    for inp in (cpu, cuda):
        with torch.no_grad():
            inp.params[0].clamp_(-0.5, 0.5)
            inp.params[1][::3] = 0.0
            inp.params[2].copy_(torch.tensor([1.0, -2.0, 3.0, 0.0, 0.25]).to(pdtype))
    for _ in range(2):
        cpu.call("sgd_step_", lr=1.0, inv_scale=None, lr_tensor=None)
        cuda_call(cuda.call, "sgd_step_", lr=1.0, inv_scale=None, lr_tensor=None)
    assert_same(cuda.master_params, cpu.master_params, exact=True)
    assert_same(cuda.params, cpu.params, exact=True)


# ------------------------------------------------------------ 16-bit weight stores
@pytest.mark.parametrize("store", ["split", "kahan", "stochastic"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("algorithm", ["adam", "sgd"])
def test_weight_stores_match_cpu(store, state_dtype, algorithm):
    """The 16-bit weight stores (master_weights "split", "kahan", "stochastic") on CUDA against
    the CPU kernels, several tensors, one misaligned by an element: FP32 results may differ by
    FMA contraction, so weights within one BF16 ulp, remainders rebuilding masters within FP32
    rounding, state close."""
    gen = torch.Generator().manual_seed(41)
    shapes = [(1000,), (37, 5), (1,), (70_003,)]

    def problem():
        params = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
        if store == "split":
            extra = [torch.randint(-3000, 3000, s, generator=gen, dtype=torch.int16)
                     for s in shapes]
        elif store == "kahan":
            extra = [(torch.randn(s, generator=gen) * 1e-3).bfloat16() for s in shapes]
        else:
            extra = []
        n_state = 2 if algorithm == "adam" else 1
        state = [[torch.rand(s, generator=gen).to(state_dtype) for s in shapes]
                 for _ in range(n_state)]
        return params, extra, state

    params, extra, state = problem()
    grads = [[torch.randn(s, generator=gen).bfloat16() for s in shapes] for _ in range(3)]

    def run(device):
        def to(ts):  # the last tensor starts one element into its storage: misaligned
            out = [t.to(device) for t in ts]
            if out:
                padded = torch.empty(out[-1].numel() + 1, dtype=out[-1].dtype, device=device)
                padded[1:].copy_(out[-1].reshape(-1))
                out[-1] = padded[1:].view(out[-1].shape)
            return out
        p, e, s = to(params), to(extra), [to(x) for x in state]
        steps = [torch.full((), 2.0, device=device) for _ in shapes]
        seeds = [5, 6, 7, 8] if store == "stochastic" else None
        for g in grads:
            g = to(g)
            if algorithm == "adam":
                ops.adam_step_(p, e, g, *s, steps, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.01, decoupled_weight_decay=True,
                               rounding_seeds=seeds)
            else:
                ops.sgd_step_(p, e, g, *s, steps, lr=0.05, momentum=0.9, dampening=0.0,
                              weight_decay=1e-3, nesterov=False, rounding_seeds=seeds)
        return [t.cpu() for t in p], [t.cpu() for t in e], [[t.cpu() for t in x] for x in s]

    cpu, cuda = run("cpu"), run("cuda")
    for a, b in zip(cuda[0], cpu[0]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-6)
    if store == "split":
        for pa, ea, pb, eb in zip(cuda[0], cuda[1], cpu[0], cpu[1]):
            rebuild = lambda w, r: ((w.view(torch.int16).to(torch.int32) << 16)  # noqa: E731
                                    + r.to(torch.int32)).view(torch.float32)
            torch.testing.assert_close(rebuild(pa, ea), rebuild(pb, eb), rtol=1e-5, atol=1e-6)
    tol = dict(rtol=1e-5, atol=1e-6) if state_dtype == torch.float32 else dict(rtol=2 ** -7,
                                                                               atol=1e-6)
    for xa, xb in zip(cuda[2], cpu[2]):
        for a, b in zip(xa, xb):
            torch.testing.assert_close(a.float(), b.float(), **tol)
