"""The optimizer half of a step -- ``scaler.step(opt); scaler.update(); opt.zero_grad()`` --
under ``torch.compile(fullgraph=True)``: one graph (a graph break fails the compile), no
recompilation over 60 steps with a changing tensor lr, skipped steps, scale growth and backoff,
nor with a float lr a torch schedule changes every step, and every parameter, optimizer state
and scaler state equal to eager's bit for bit.

The gradients a backward would leave are made outside the compiled function from one seeded
generator, so the eager and compiled runs see the same ones.
"""
import copy
import pickle

import pytest
import torch
from torch._dynamo.utils import counters

import fusedamp
from fusedamp import compiled_step

pytestmark = pytest.mark.skipif(not compiled_step.available,
                                reason="torch's opaque objects (torch >= 2.10) are needed")

STEPS = 60  # with GROWTH_INTERVAL 5, the scale grows between the skips
INF_AT = {3, 4, 27, 41}  # two overflowing steps in a row, then single ones
GROWTH_INTERVAL = 5


def _model(device, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))
    return model.to(device=device, dtype=dtype)


def _build(kind, device, **options):
    """(parameters, optimizer, scaler) of one configuration, the lr a device tensor."""
    dtype = torch.float32 if kind == "torch_fused_adamw" else torch.bfloat16
    params = list(_model(device, dtype).parameters())
    lr = torch.tensor(1e-2, device=device)
    if kind == "torch_fused_adamw":
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.1, fused=True)
    elif kind == "sgd":
        opt = fusedamp.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True, weight_decay=1e-4,
                                 **options)
    else:
        cls = fusedamp.optim.AdamW if kind == "adamw" else fusedamp.optim.Adam
        opt = cls(params, lr=lr, weight_decay=0.1, **options)
    scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=GROWTH_INTERVAL)
    if kind == "torch_fused_adamw":
        scaler.prepare_compiled_step(opt)
    return params, opt, scaler


def _optimizer_half(scaler, opt, set_to_none, unscale_first=False):
    if unscale_first:
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    if isinstance(opt, fusedamp.optim.FusedOptimizer):
        opt.zero_grad(set_to_none=set_to_none)
    else:  # torch's zero_grad is kept out of tracing (torch._disable_dynamo): its effect
        for p in opt.param_groups[0]["params"]:
            p.grad = None


def _train(kind, device, compiled, set_to_none=True, steps=STEPS, unscale_first=False,
           mode=None, **options):
    params, opt, scaler = _build(kind, device, **options)
    half = _optimizer_half
    if compiled:
        half = torch.compile(_optimizer_half, fullgraph=True, mode=mode)
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        scaler.scale(torch.ones((), device=device))  # the iteration starts with scale()
        scale = scaler.get_scale()
        for p in params:
            g = torch.randn(p.shape, generator=gen) * 1e-2 * scale
            if p.grad is None:
                p.grad = g.to(device=device, dtype=p.dtype)
            else:
                p.grad.copy_(g)
        if i in INF_AT:
            params[i % len(params)].grad.view(-1)[0] = float("inf")
        opt.param_groups[0]["lr"].fill_(1e-2 / (1 + 0.05 * i))  # a schedule, on the device
        half(scaler, opt, set_to_none, unscale_first)
    return params, opt, scaler


def _state_tensors(opt):
    out = []
    for state in opt.state_dict()["state"].values():
        out += [v for _, v in sorted(state.items()) if torch.is_tensor(v)]
    return out


CONFIGS = [("adamw", dict(master_weights=m)) for m in
           (True, False, "split", "split8", "kahan", "stochastic")]
CONFIGS += [("adamw", dict(master_weights="split", state_dtype=torch.int8)),
            ("adamw", dict(master_weights=True, max_grad_norm=0.5)),
            # Adam is AdamW's operator (decoupled_weight_decay=False): AdamW's rows cover the
            # modes; Adam's add what only it has.
            ("adam", dict(master_weights=True, amsgrad=True)),
            ("adam", dict(master_weights="split", state_dtype=torch.bfloat16)),
            ("sgd", dict(master_weights=True)),
            ("sgd", dict(master_weights=False)),
            ("sgd", dict(master_weights="split")),
            ("sgd", dict(master_weights="split8")),
            ("sgd", dict(master_weights="kahan")),
            ("sgd", dict(master_weights="stochastic")),
            ("torch_fused_adamw", {})]


def _eager_then_compiled(kind, device, **options):
    """The same training eager and compiled; the compiled side in one graph, never recompiled."""
    torch._dynamo.reset()
    counters.clear()
    eager = _train(kind, device, compiled=False, **options)
    compiled = _train(kind, device, compiled=True, **options)
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0
    return eager, compiled


def _assert_same_params_and_scaler(eager, compiled):
    for a, b in zip(eager[0], compiled[0], strict=True):
        assert torch.equal(a, b)
    assert eager[2].state_dict() == compiled[2].state_dict()


@pytest.mark.parametrize("kind,options", CONFIGS,
                         ids=[f"{k}-{'-'.join(f'{a}={b}' for a, b in o.items()) or 'default'}"
                              for k, o in CONFIGS])
def test_fullgraph_optimizer_half_equals_eager_without_recompiling(device, kind, options):
    eager, compiled = _eager_then_compiled(kind, device, **options)
    assert sum(counters["graph_break"].values()) == 0
    _assert_same_params_and_scaler(eager, compiled)
    for a, b in zip(_state_tensors(eager[1]), _state_tensors(compiled[1]), strict=True):
        assert torch.equal(a, b)
    tel_e, tel_c = eager[2].telemetry(), compiled[2].telemetry()
    assert tel_e["scale"] == tel_c["scale"] and tel_e["found_inf"] == tel_c["found_inf"]
    # The run did what it is meant to exercise: skipped steps, backoff and growth.
    assert sum(tel_c["found_inf"]) == len(INF_AT)
    scales = tel_c["scale"]
    assert any(b < a for a, b in zip(scales, scales[1:]))
    assert any(b > a for a, b in zip(scales, scales[1:]))
    if isinstance(compiled[1], fusedamp.optim.FusedOptimizer):
        assert int(compiled[1].skipped_steps) == len(INF_AT)


@pytest.mark.parametrize("kind", ["adamw", "torch_fused_adamw"])
def test_unscale_before_the_step_equals_eager(device, kind):
    eager, compiled = _eager_then_compiled(kind, device, steps=30, unscale_first=True)
    _assert_same_params_and_scaler(eager, compiled)


def test_reduce_overhead_mode_equals_eager(device):
    """mode="reduce-overhead" (CUDA graphs where inductor takes them; on the CPU the default
    mode): the same graph count and results."""
    torch._dynamo.reset()
    counters.clear()
    eager = _train("adamw", device, compiled=False, steps=40, master_weights="split")
    compiled = _train("adamw", device, compiled=True, steps=40, mode="reduce-overhead",
                      master_weights="split")
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0
    _assert_same_params_and_scaler(eager, compiled)


def test_zero_grad_keeping_the_tensors_equals_eager(device):
    eager, compiled = _eager_then_compiled("adamw", device, set_to_none=False, steps=20)
    for a, b in zip(eager[0], compiled[0], strict=True):
        assert torch.equal(a, b) and torch.equal(b.grad, torch.zeros_like(b))


def test_float_lr_set_by_a_torch_schedule_every_step_compiles_once(device):
    """The quick start's float lr under torch's CosineAnnealingLR (a new value every step,
    stepped outside the compiled half): one compile over the run, the eager run's bits."""
    def train(compiled, steps=6):
        params, opt, scaler = _build("adamw", device)
        opt.param_groups[0]["lr"] = 1e-2  # a float, as torch's schedules leave it
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
        half = torch.compile(_optimizer_half, fullgraph=True) if compiled else _optimizer_half
        gen, lrs = torch.Generator().manual_seed(1), []
        for _ in range(steps):
            scaler.scale(torch.ones((), device=device))
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(device=device, dtype=p.dtype)
            lrs.append(opt.param_groups[0]["lr"])
            half(scaler, opt, True)
            sched.step()
        return params, opt, lrs

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = train(False), train(True)
    assert counters["stats"]["unique_graphs"] == 1
    assert all(type(lr) is float for lr in compiled[2]) and len(set(compiled[2])) == 6
    assert eager[2] == compiled[2]
    for a, b in zip(eager[0] + _state_tensors(eager[1]),
                    compiled[0] + _state_tensors(compiled[1]), strict=True):
        assert torch.equal(a, b)

def test_compiled_step_holds_no_copy_of_parameters_or_state(device):
    """inductor's code calls the step op on the parameters and gradients themselves: no
    clone or copy of them (the ops' mutations were reinplaced), nothing else but the ops."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    params, opt, scaler = _build("adamw", device, master_weights="split")
    scaler.scale(torch.ones((), device=device))
    for p in params:
        p.grad = torch.randn_like(p)
    _, codes = run_and_get_code(torch.compile(_optimizer_half, fullgraph=True), scaler, opt, True)
    (code,) = codes
    body = code[code.index("def call(self, args):"):]
    body = body[:body.index("return ")]  # what the compiled graph runs
    calls = [line.strip() for line in body.splitlines()[1:]
             if line.strip() and not line.strip().startswith(("#", "del ", "assert_size_stride"))]
    assert calls[0].endswith("= args") and calls[1] == "args.clear()"
    assert [c.split("(")[0] for c in calls[2:]] == ["torch.ops.fusedamp.scaler_step_.default",
                                                  "torch.ops.fusedamp.scaler_update_.default"]
    assert all(p.grad is None for p in params)


def test_compiled_optimizer_step_alone_is_one_graph(device):
    """torch's recommended ``opt.step = torch.compile(opt.step)``: one graph, the eager step's
    result, also when an eager scaler steps the optimizer (through the compiled step)."""
    torch._dynamo.reset()
    counters.clear()
    params = list(_model(device, torch.bfloat16).parameters())
    opt = fusedamp.optim.AdamW(params, lr=1e-2, master_weights="split")
    ref = copy.deepcopy(opt)
    ref_params = [p for g in ref.param_groups for p in g["params"]]
    opt.step = torch.compile(opt.step, fullgraph=True)
    scaler, ref_scaler = fusedamp.GradScaler(device), fusedamp.GradScaler(device)
    for i in range(4):
        for p, q in zip(params, ref_params, strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        if i < 2:
            opt.step()
            ref.step()
        else:
            for s in (scaler, ref_scaler):
                s.scale(torch.ones((), device=device))
            scaler.step(opt)
            ref_scaler.step(ref)
            scaler.update()
            ref_scaler.update()
    assert counters["stats"]["unique_graphs"] == 1
    for p, q in zip(params, ref_params, strict=True):
        assert torch.equal(p, q)


def test_closure_under_compile_is_refused(device):
    torch._dynamo.reset()
    params = list(_model(device, torch.bfloat16).parameters())
    opt = fusedamp.optim.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in params]

    def with_closure():
        opt.step(lambda: None)

    with pytest.raises(Exception, match="takes no arguments"):
        torch.compile(with_closure, fullgraph=True)()
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))


def test_torch_optimizer_not_prepared_is_refused_with_the_remedy(device):
    torch._dynamo.reset()
    params = list(_model(device, torch.float32).parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    scaler = fusedamp.GradScaler(device)
    scaler.scale(torch.ones((), device=device))
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in params]
    with pytest.raises(Exception, match="prepare_compiled_step"):
        torch.compile(lambda: scaler.step(opt), fullgraph=True)()
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        scaler.prepare_compiled_step(params)


def test_a_prepared_optimizer_is_forgotten_with_it(device):
    scaler = fusedamp.GradScaler(device)
    opt = torch.optim.AdamW(list(_model(device, torch.float32).parameters()), fused=True)
    scaler.prepare_compiled_step(opt)
    assert len(scaler._torch_step_targets) == 1
    del opt
    import gc

    gc.collect()
    assert scaler._torch_step_targets == {}


def test_scaler_and_optimizer_still_pickle_after_a_compiled_step(device):
    torch._dynamo.reset()
    params, opt, scaler = _train("adamw", device, compiled=True, steps=3)
    scaler2 = pickle.loads(pickle.dumps(scaler))
    opt2 = copy.deepcopy(opt)
    assert scaler2.state_dict() == scaler.state_dict()
    assert scaler2._step_target is not scaler._step_target
    assert opt2._step_target is not opt._step_target
    for a, b in zip(_state_tensors(opt), _state_tensors(opt2), strict=True):
        assert torch.equal(a, b)


def test_schedule_in_the_compiled_half_counts_applied_steps_as_eager(device):
    """A fusedamp.lr_scheduler schedule stepped inside the fullgraph half: one graph, no
    recompile, its lr and the weights bit-equal to eager's, skipped steps holding the lr."""
    def train(compiled):
        params, opt, scaler = _build("adamw", device, master_weights="split")
        sched = fusedamp.lr_scheduler.WarmupCosine(opt, warmup_steps=10, total_steps=80,
                                                   min_lr_ratio=0.1)

        def half():
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad()

        if compiled:
            half = torch.compile(half, fullgraph=True)
        gen = torch.Generator().manual_seed(1)
        lrs = []
        for i in range(60):
            scaler.scale(torch.ones((), device=device))
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2 * scaler.get_scale()).to(
                    device=device, dtype=p.dtype)
            if i in INF_AT:
                params[0].grad.view(-1)[0] = float("nan")
            half()
            lrs.append(opt.param_groups[0]["lr"].item())
        return params, sched, lrs

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = train(False), train(True)
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0
    assert eager[2] == compiled[2]
    assert compiled[2][3] == compiled[2][2] == compiled[2][4]  # steps 3 and 4 were skipped
    assert float(compiled[1].applied_steps) == 60 - len(INF_AT)
    for a, b in zip(eager[0], compiled[0], strict=True):
        assert torch.equal(a, b)
    clone = copy.deepcopy(compiled[1])
    assert clone._step_target is not compiled[1]._step_target


def test_scale_is_traced_and_equals_eager(device):
    """scaler.scale(loss) in a fullgraph compile: the same values (FP16 loss: an FP32 result,
    as torch's), the scale made on the loss's device by the first call, backward through it."""
    torch._dynamo.reset()
    counters.clear()
    eager_scaler, compiled_scaler = (fusedamp.GradScaler(device, init_scale=2.0 ** 12)
                                     for _ in range(2))
    x = torch.randn(7, device=device, dtype=torch.float16, requires_grad=True)

    def scaled(scaler, t):
        return scaler.scale(t.sum())

    compiled = torch.compile(scaled, fullgraph=True)
    got = compiled(compiled_scaler, x)
    ref = scaled(eager_scaler, x)
    assert got.dtype == ref.dtype and got.shape == ref.shape and torch.equal(got, ref)
    assert torch.equal(compiled_scaler.get_scale_tensor(), eager_scaler.get_scale_tensor())
    (gx,) = torch.autograd.grad(got, x)
    (rx,) = torch.autograd.grad(ref, x)
    assert torch.equal(gx, rx)
    with pytest.raises(Exception, match="floating point"):
        torch.compile(lambda: compiled_scaler.scale(torch.ones(2, dtype=torch.int64)),
                      fullgraph=True)()


def test_dtensor_parameters_under_compile_are_refused(one_rank_process_group):
    """FSDP2's DTensor parameters: a clear error at compile time, nothing stepped."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (1,))
    p = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
    opt = fusedamp.optim.AdamW([p], lr=1e-2)
    p.grad = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    before = p.detach().full_tensor().clone()
    with pytest.raises(Exception, match="DTensor \\(FSDP2\\) parameters is not taken"):
        torch.compile(lambda: opt.step(), fullgraph=True)()
    assert torch.equal(p.detach().full_tensor(), before)
