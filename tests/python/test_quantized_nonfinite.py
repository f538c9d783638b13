"""8-bit states (state_dtype=torch.int8) stepped with a non-finite gradient element and no skip
(skip_nonfinite=False, no scaler): the damage stays in that element, as in torch's step
(math/quantized_moments_math.h says how).

Each case runs twice from the same start: once with +inf, -inf and NaN gradients at three
elements for one step, once with small finite gradients there. Those elements' gradients are
small at every step of both runs, so that their moments never make a block's scale: the
blocks' other elements must then come out bit for bit the same in both runs, weights, codes and
scales, on the step of the bad gradients and on the finite steps after it. The bad elements
themselves: their weights non-finite as torch.optim's single-tensor step makes them, their
codes 0.
"""
import pytest
import torch

import fusedamp

N = 100                # three full blocks of 32 and a partial one
BAD = {40: float("inf"), 45: float("-inf"), 97: float("nan")}  # two in a block, one in the last
STEPS = 5
BAD_STEP = 2

# (name, optimizer, param dtype, fusedamp's own arguments, the arguments torch's takes too)
CASES = [
    ("adamw_fp32", "AdamW", torch.float32, {}, dict(lr=1e-2, weight_decay=0.1)),
    ("adam_l2_bf16_master", "Adam", torch.bfloat16, dict(master_weights=True),
     dict(lr=1e-2, weight_decay=0.01)),
    ("adamw_bf16_split", "AdamW", torch.bfloat16, dict(master_weights="split"),
     dict(lr=1e-2, weight_decay=0.1)),
    ("sgd_nesterov_fp32", "SGD", torch.float32, {},
     dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("sgd_bf16_split8", "SGD", torch.bfloat16, dict(master_weights="split8"),
     dict(lr=1e-2, momentum=0.9, dampening=0.1)),
]


def gradients(seed):
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(STEPS):
        g = torch.randn(N, generator=gen) * 1e-2
        g[list(BAD)] *= 1e-3  # never a block's largest moment
        grads.append(g)
    return grads


def run(device, cls, dtype, own, hyper, grads, bad):
    """The weights (as FP32) and the state after each step, on the CPU."""
    p = torch.nn.Parameter((torch.randn(N, generator=torch.Generator().manual_seed(1)))
                           .to(dtype).to(device))
    opt = getattr(fusedamp.optim, cls)([p], skip_nonfinite=False, state_dtype=torch.int8,
                                       **own, **hyper)
    out = []
    for step, g in enumerate(grads):
        g = g.clone()
        if bad and step == BAD_STEP:
            g[list(BAD)] = torch.tensor(list(BAD.values()))
        p.grad = g.to(dtype).to(device)
        opt.step()
        state = {k: v.detach().cpu().clone() for k, v in opt.state[p].items()
                 if torch.is_tensor(v) and v.dim() > 0}
        out.append((p.detach().float().cpu().clone(), state))
    return out


def torch_weights_at_bad_step(cls, hyper, grads):
    p = torch.nn.Parameter(torch.randn(N, generator=torch.Generator().manual_seed(1))
                           .to(torch.bfloat16).float())
    opt = getattr(torch.optim, cls)([p], foreach=False, **hyper)
    for step, g in enumerate(grads[:BAD_STEP + 1]):
        g = g.clone()
        if step == BAD_STEP:
            g[list(BAD)] = torch.tensor(list(BAD.values()))
        p.grad = g
        opt.step()
    return p.detach()


@pytest.mark.parametrize("name,cls,dtype,own,hyper", CASES, ids=[c[0] for c in CASES])
def test_nonfinite_gradient_spoils_only_its_element(device, name, cls, dtype, own, hyper):
    grads = gradients(seed=len(name))
    bad_run = run(device, cls, dtype, own, hyper, grads, bad=True)
    good_run = run(device, cls, dtype, own, hyper, grads, bad=False)
    others = torch.ones(N, dtype=torch.bool)
    others[list(BAD)] = False
    for step, ((w_bad, s_bad), (w_good, s_good)) in enumerate(zip(bad_run, good_run)):
        where = f"step {step}"
        assert torch.equal(w_bad[others].view(torch.int32), w_good[others].view(torch.int32)), \
            where
        assert s_bad.keys() == s_good.keys()
        for key, t in s_bad.items():
            if t.shape == (N,):  # per element: codes, remainders
                assert torch.equal(t[others], s_good[key][others]), (where, key)
            else:  # block scales: the bad elements' moments make none of them
                assert torch.equal(t.view(torch.int32), s_good[key].view(torch.int32)), \
                    (where, key)
    w_bad, s_bad = bad_run[BAD_STEP]
    codes = [k for k, t in s_bad.items() if t.dtype in (torch.int8, torch.uint8)
             and "remainder" not in k]
    assert codes, "no 8-bit state"
    for key in codes:
        assert s_bad[key][list(BAD)].eq(0).all(), key
    want = torch_weights_at_bad_step(cls, hyper, grads)[list(BAD)]
    got = w_bad[list(BAD)]
    assert not got.isfinite().any()
    torch.testing.assert_close(got, want.to(dtype).float(), equal_nan=True, rtol=0, atol=0)


def test_a_loaded_nonfinite_moment_is_coded_as_a_step_codes_it(device):
    """FP32 moments converted to 8 bits (a state assigned or loaded, converted by the next
    step) follow the same rule: a non-finite moment is code 0 and makes no scale."""
    gen = torch.Generator().manual_seed(5)
    m = torch.randn(N, generator=gen) * 1e-3
    v = torch.rand(N, generator=gen) * 1e-6
    m[list(BAD)], v[list(BAD)] = 0.0, 0.0
    bad_m, bad_v = m.clone(), v.clone()
    bad_m[list(BAD)] = torch.tensor(list(BAD.values()))
    bad_v[[40, 97]] = torch.tensor([float("inf"), float("nan")])

    def converted(exp_avg, exp_avg_sq):
        p = torch.nn.Parameter(torch.zeros(N, device=device))
        opt = fusedamp.optim.AdamW([p], state_dtype=torch.int8)
        opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": exp_avg.to(device),
                        "exp_avg_sq": exp_avg_sq.to(device)}
        p.grad = torch.zeros_like(p)
        opt.step()
        return {k: v.cpu() for k, v in opt.state[p].items() if k != "step"}

    got, want = converted(bad_m, bad_v), converted(m, v)
    assert got.keys() == want.keys() == {"exp_avg", "exp_avg_sq", "moment_scales"}
    assert torch.equal(got["moment_scales"], want["moment_scales"])
    assert torch.equal(got["exp_avg"], want["exp_avg"])  # 0 at the bad elements in both
    assert torch.equal(got["exp_avg_sq"], want["exp_avg_sq"])
    assert want["moment_scales"].gt(0).all()
