"""fusedamp.release_gradients: each parameter stepped inside backward, its gradient freed.

The reference is the normal mode (one fused step after backward) from the same weights and
batches: without overflow the two agree bit for bit, whatever order the gradients arrive in;
with an overflow the release mode skips exactly the overflowing parameter."""
import io
import warnings

import pytest
import torch
from torch import nn

import fusedamp
from fusedamp.optim import SGD, Adam, AdamW, Lion

CONFIGS = [
    pytest.param(torch.float16, AdamW, dict(master_weights=True), True, id="fp16-adamw-fp32"),
    pytest.param(torch.bfloat16, AdamW, dict(master_weights="split8", state_dtype=torch.int8),
                 False, id="bf16-adamw-split8-int8"),
    pytest.param(torch.bfloat16, Adam, dict(master_weights="kahan", state_dtype=torch.bfloat16,
                                            weight_decay=0.1), True, id="bf16-adam-kahan"),
    pytest.param(torch.bfloat16, AdamW, dict(master_weights="stochastic", rounding_seed=3),
                 False, id="bf16-adamw-stochastic"),
    pytest.param(torch.float16, SGD, dict(momentum=0.9, state_dtype=torch.int8), True,
                 id="fp16-sgd-int8"),
    pytest.param(torch.float32, SGD, dict(momentum=0.9, nesterov=True), False, id="fp32-sgd"),
    pytest.param(torch.bfloat16, Lion, dict(master_weights="split", weight_decay=0.1), True,
                 id="bf16-lion-split"),
]


def make(dtype, opt_cls, opt_kw, scaled, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 4)).to(dtype)
    opt = opt_cls(model.parameters(), lr=1e-2, **opt_kw)
    scaler = fusedamp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2) if scaled \
        else None
    return model, opt, scaler


def loss_of(model, i):
    gen = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
    dtype = next(model.parameters()).dtype
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def normal_iteration(model, opt, scaler, i, drop=None):
    opt.zero_grad()
    loss = loss_of(model, i)
    (scaler.scale(loss) if scaler else loss).backward()
    if drop is not None:
        drop.grad = None  # the parameter a release-mode overflow skips
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


def release_iteration(model, scaler, i):
    loss = loss_of(model, i)
    (scaler.scale(loss) if scaler else loss).backward()
    if scaler:
        scaler.update()


class Branches(nn.Module):
    """Four parallel MLPs whose outputs are summed in a fixed order, computed in the order
    `self.order`: autograd runs the later-created branch first, so the order of the gradients'
    arrival follows it while every value stays the same."""

    def __init__(self):
        super().__init__()
        self.branch = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
                                    for _ in range(4))
        self.order = list(range(4))

    def forward(self, x):
        out = [None] * 4
        for k in self.order:
            out[k] = self.branch[k](x)
        return out[0] + out[1] + out[2] + out[3]


def snapshot(model, opt):
    params = list(model.parameters())
    return ([p.detach().clone() for p in params],
            [{k: v.clone() for k, v in opt.state[p].items()} for p in params])


def assert_same_bits(a, b):
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    for sx, sy in zip(a[1], b[1]):
        assert sx.keys() == sy.keys()
        for k in sx:
            assert torch.equal(sx[k], sy[k]), k


def make_branches(dtype, opt_cls, opt_kw, scaled):
    torch.manual_seed(0)
    model = Branches().to(dtype)
    opt = opt_cls(model.parameters(), lr=1e-2, **opt_kw)
    scaler = fusedamp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2) if scaled \
        else None
    return model, opt, scaler


@pytest.mark.parametrize("dtype,opt_cls,opt_kw,scaled", CONFIGS)
def test_release_matches_the_normal_step_bit_for_bit_in_any_hook_order(dtype, opt_cls, opt_kw,
                                                                         scaled):
    ref = make_branches(dtype, opt_cls, opt_kw, scaled)
    results, arrivals = [], []
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]):
        rel = make_branches(dtype, opt_cls, opt_kw, scaled)
        rel[0].order = order
        names = {id(p): n for n, p in rel[0].named_parameters()}
        seen = []
        watch = [p.register_post_accumulate_grad_hook(lambda p: seen.append(names[id(p)]))
                 for p in rel[0].parameters()]  # before the release hooks: sees each gradient
        with fusedamp.release_gradients(rel[0], rel[1], rel[2]):
            for i in range(4):
                release_iteration(rel[0], rel[2], i)
                assert all(p.grad is None for p in rel[0].parameters())
        for h in watch:
            h.remove()
        arrivals.append(seen[:len(names)])
        results.append((snapshot(*rel[:2]), rel[2].get_scale() if scaled else None))
    assert len({tuple(a) for a in arrivals}) == 3  # three orders of arrival
    for i in range(4):
        normal_iteration(*ref, i)
    for got, scale in results:
        assert_same_bits(snapshot(*ref[:2]), got)
        if scaled:
            assert scale == ref[2].get_scale() > 2.0 ** 10  # it grew: the iterations were clean


def inject_inf(param):
    """A tensor hook on the leaf: its gradient holds inf before it is accumulated."""
    return param.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))


@pytest.mark.parametrize("dtype,opt_cls,opt_kw,scaled", [c for c in CONFIGS if c.values[3]])
def test_an_overflowing_parameter_alone_is_skipped_and_the_scale_backs_off(dtype, opt_cls,
                                                                           opt_kw, scaled):
    ref = make(dtype, opt_cls, opt_kw, scaled)
    rel = make(dtype, opt_cls, opt_kw, scaled)
    bad = 2  # the second Linear's weight
    with fusedamp.release_gradients(rel[0], rel[1], rel[2]) as handle:
        normal_iteration(*ref, 0)
        release_iteration(rel[0], rel[2], 0)
        assert handle.skipped_parameters.item() == 0
        before = snapshot(*rel[:2])
        hook = inject_inf(list(rel[0].parameters())[bad])
        release_iteration(rel[0], rel[2], 1)
        hook.remove()
        assert handle.skipped_parameters.item() == 1
    # The reference steps every parameter but the overflowing one, on the same scale.
    normal_iteration(*ref, 1, drop=list(ref[0].parameters())[bad])
    after, expected = snapshot(*rel[:2]), snapshot(*ref[:2])
    for k in range(len(after[0])):
        if k == bad:
            assert torch.equal(after[0][k], before[0][k])
            for key in before[1][k]:
                assert torch.equal(after[1][k][key], before[1][k][key]), key
        else:
            assert torch.equal(after[0][k], expected[0][k])
            assert not torch.equal(after[0][k], before[0][k])
            assert after[1][k]["step"].item() == 2
    assert rel[2].get_scale() == 2.0 ** 9  # backed off from 2^10
    log = rel[2].telemetry(rel[0])
    assert log["skipped"] == [False, True]
    assert log["first_nonfinite"] == [None, "2.weight"]


def test_hysteresis_and_telemetry_see_the_release_iterations():
    model, opt, _ = make(torch.float16, AdamW, {}, False)
    scaler = fusedamp.GradScaler("cpu", init_scale=2.0 ** 10, hysteresis=2)
    ref = make(torch.float16, AdamW, {}, False)[:2] + (
        fusedamp.GradScaler("cpu", init_scale=2.0 ** 10, hysteresis=2),)
    params = list(model.parameters())
    with fusedamp.release_gradients(model, opt, scaler) as handle:
        for i in range(4):
            hooks = [inject_inf(params[0]), inject_inf(params[4])] if i in (1, 2) else []
            release_iteration(model, scaler, i)
            for h in hooks:
                h.remove()
            assert handle.skipped_parameters.item() == len(hooks)
            if i == 1:
                assert scaler.get_scale() == 2.0 ** 10  # one overflow tolerated
            if i == 0:
                normal_iteration(*ref, i)
    assert scaler.get_scale() == 2.0 ** 9
    log = scaler.telemetry()
    assert log["skipped"] == [False, True, True, False]
    # A clean iteration's norm is the global norm of every parameter's gradient.
    ref_log = ref[2].telemetry()
    assert log["grad_norm"][0] == pytest.approx(ref_log["grad_norm"][0], rel=1e-6)
    assert log["amax"][0] == ref_log["amax"][0]


def test_the_amax_policy_moves_the_scale_as_in_the_normal_mode():
    runs = []
    for release in (False, True):
        model, opt, _ = make(torch.float16, AdamW, {}, False)
        scaler = fusedamp.GradScaler("cpu", init_scale=2.0 ** 4, policy="amax")
        handle = fusedamp.release_gradients(model, opt, scaler) if release else None
        for i in range(3):
            release_iteration(model, scaler, i) if handle else normal_iteration(model, opt,
                                                                                scaler, i)
        runs.append((scaler.get_scale(), scaler.telemetry()["amax"]))
    assert runs[0] == runs[1]
    assert runs[0][0] > 2.0 ** 4  # the policy moved it, from the amax every pass measured


@pytest.mark.parametrize("first", ["normal", "release"])
def test_checkpoints_round_trip_between_the_modes(first):
    cfg = (torch.bfloat16, AdamW, dict(master_weights="split8", state_dtype=torch.int8), True)
    model, opt, scaler = make(*cfg)
    handle = fusedamp.release_gradients(model, opt, scaler) if first == "release" else None
    for i in range(2):
        (release_iteration(model, scaler, i) if handle else normal_iteration(model, opt, scaler, i))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "scaler": scaler.state_dict()}, buf)
    runs = []
    for mode in ("normal", "release"):
        buf.seek(0)
        ck = torch.load(buf, weights_only=False)
        m, o, s = make(*cfg, seed=1)  # other weights: the checkpoint must replace them
        m.load_state_dict(ck["model"])
        o.load_state_dict(ck["opt"])
        s.load_state_dict(ck["scaler"])
        h = fusedamp.release_gradients(m, o, s) if mode == "release" else None
        for i in range(2, 4):
            release_iteration(m, s, i) if h else normal_iteration(m, o, s, i)
        runs.append(snapshot(m, o) + (s.get_scale(),))
    assert_same_bits(runs[0][:2], runs[1][:2])
    assert runs[0][2] == runs[1][2]


def test_per_parameter_clipping_clips_each_gradient_by_its_own_norm():
    model, opt, scaler = make(torch.float16, AdamW, dict(max_grad_norm=0.01), True)
    ref_model, _, ref_scaler = make(torch.float16, AdamW, {}, True)
    # The reference: one optimizer per parameter, each clipping by its own global norm.
    ref_opts = [AdamW([p], lr=1e-2, max_grad_norm=0.01) for p in ref_model.parameters()]
    with fusedamp.release_gradients(model, opt, scaler, clipping="per_parameter"):
        for i in range(3):
            release_iteration(model, scaler, i)
            loss = loss_of(ref_model, i)
            ref_scaler.scale(loss).backward()
            for o in ref_opts:
                ref_scaler.step(o)
            ref_scaler.update()
            for o in ref_opts:
                o.zero_grad()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def bad_combinations():
    model, opt, scaler = make(torch.float16, AdamW, {}, True)
    return model, opt, scaler


def assert_nothing_attached(model, opt, scaler):
    """Normal mode: backward leaves the gradients, the step takes them."""
    before = [p.detach().clone() for p in model.parameters()]
    loss = loss_of(model, 0)
    scaler.scale(loss).backward()
    assert all(p.grad is not None for p in model.parameters())
    scaler.step(opt)
    scaler.update()
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert "_fusedamp_release" not in opt.__dict__


def test_global_clipping_is_refused_and_nothing_attached():
    model, _, scaler = bad_combinations()
    opt = AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="global gradient norm.*clipping='per_parameter'"):
        fusedamp.release_gradients(model, opt, scaler)
    assert_nothing_attached(model, opt, scaler)


def test_other_optimizers_scalers_and_modules_are_refused():
    model, opt, scaler = bad_combinations()
    with pytest.raises(TypeError, match="fusedamp.optim.AdamW, Adam, SGD or Lion.*torch.optim"):
        fusedamp.release_gradients(model, torch.optim.AdamW(model.parameters()), scaler)
    with pytest.raises(TypeError, match="fusedamp.GradScaler or None"):
        fusedamp.release_gradients(model, opt, torch.amp.GradScaler("cpu"))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        fusedamp.release_gradients(list(model.parameters()), opt, scaler)
    with pytest.raises(ValueError, match="clipping must be one of"):
        fusedamp.release_gradients(model, opt, scaler, clipping="global")
    with pytest.raises(ValueError, match="not a parameter of the model"):
        fusedamp.release_gradients(nn.Linear(2, 2).half(), opt, scaler)
    assert_nothing_attached(model, opt, scaler)
    # A gradient left from that normal step would be taken as the first hook's own.
    with pytest.raises(RuntimeError, match="holds a gradient.*zero_grad"):
        fusedamp.release_gradients(model, opt, scaler)
    opt.zero_grad()
    assert_nothing_attached(model, opt, scaler)


def test_attaching_twice_is_refused_and_the_first_handle_keeps_working():
    model, opt, scaler = bad_combinations()
    handle = fusedamp.release_gradients(model, opt, scaler)
    with pytest.raises(RuntimeError, match="already releases"):
        fusedamp.release_gradients(model, opt, scaler)
    release_iteration(model, scaler, 0)
    assert all(s["step"].item() == 1 for s in opt.state.values())
    handle.remove()


def test_accumulation_is_refused_before_the_second_backward_steps_anything():
    model, opt, scaler = bad_combinations()
    with fusedamp.release_gradients(model, opt, scaler):
        scaler.scale(loss_of(model, 0)).backward()
        before = snapshot(model, opt)
        with pytest.raises(RuntimeError, match="second time before scaler.update.*accumulation"):
            scaler.scale(loss_of(model, 1)).backward()
        after = snapshot(model, opt)
        assert_same_bits(before, after)
        for p in model.parameters():
            p.grad = None
        scaler.update()
        release_iteration(model, scaler, 2)  # the next iteration runs
    assert all(s["step"].item() == 2 for s in opt.state.values())


def test_a_gradient_no_hook_frees_is_refused_before_anything_is_stepped():
    model, opt, scaler = bad_combinations()
    with fusedamp.release_gradients(model, opt, scaler):
        release_iteration(model, scaler, 0)
        first = list(model.parameters())[0]  # its gradient arrives last in backward
        first.grad = torch.ones_like(first)
        before = snapshot(model, opt)
        with pytest.raises(RuntimeError, match="holds a gradient besides.*zero_grad"):
            scaler.scale(loss_of(model, 1)).backward()
        assert_same_bits(before, snapshot(model, opt))


def test_unscale_is_refused_and_step_warns_once_and_does_nothing():
    model, opt, scaler = bad_combinations()
    with fusedamp.release_gradients(model, opt, scaler):
        scaler.scale(loss_of(model, 0)).backward()
        with pytest.raises(RuntimeError, match="clipping='per_parameter'"):
            scaler.unscale_(opt)
        before = snapshot(model, opt)
        with pytest.warns(UserWarning, match="does nothing"):
            scaler.step(opt)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.step()
        assert_same_bits(before, snapshot(model, opt))
        scaler.update()


def test_remove_restores_the_normal_mode():
    cfg = (torch.float16, SGD, dict(momentum=0.9), True)
    ref, rel = make(*cfg), make(*cfg)
    handle = fusedamp.release_gradients(*rel[:3])
    normal_iteration(*ref, 0)
    release_iteration(rel[0], rel[2], 0)
    handle.remove()
    handle.remove()
    assert all(not p._post_accumulate_grad_hooks for p in rel[0].parameters())
    for i in (1, 2):
        normal_iteration(*ref, i)
        normal_iteration(*rel, i)
    assert_same_bits(snapshot(*ref[:2]), snapshot(*rel[:2]))
    assert all(p.grad is not None for p in rel[0].parameters())
