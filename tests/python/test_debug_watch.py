"""fusedamp.debug.watch: names the module, phase and iteration that made the first inf/NaN (or
that pushed a gradient below FP16's range), in eager and compiled models, without a host sync,
and leaves the model and its training untouched."""
import os
import sys

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(__file__))
import fusedamp  # noqa: E402
from debug_models import MODELS, Fault, fault_of, tiny_gpt2  # noqa: E402

INF = float("inf")
AT = 3   # the iteration a fault is injected at


def train(model, make_input, iterations, inject=None, step=True, compiled=None):
    """A few SGD steps; inject(i) sets the fault for iteration i."""
    run = model if compiled is None else compiled
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for i in range(iterations):
        if inject is not None:
            inject(i)
        loss = run(make_input()).float().square().mean()
        loss.backward()
        if step:
            opt.step()
        opt.zero_grad()


def _compile(model):
    # aot_eager: dynamo's graph breaks and AOTAutograd's compiled backward, as with inductor,
    # without a C++ compile per graph piece (minutes on a small shared CPU).
    return torch.compile(model, backend="aot_eager")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("fault", ["forward_inf", "backward_inf", "backward_tiny"])
def test_producer_is_named(kind, fault, compiled):
    torch.manual_seed(0)
    name, build, make_input = MODELS[kind]
    model = build()
    run = _compile(model) if compiled else None
    values = {"forward_inf": dict(forward=INF), "backward_inf": dict(backward=INF),
              "backward_tiny": dict(backward=1e-30)}[fault]

    def inject(i):
        fault_of(model, kind).inject(**(values if i == AT else {}))

    with fusedamp.debug.watch(model if run is None else run) as w:
        train(model, make_input, 6, inject, step=fault == "backward_tiny", compiled=run)
        if fault == "backward_tiny":
            assert w.first_nonfinite() is None
            assert w.first_underflow(dtype=torch.float16) == {
                "iteration": AT, "phase": "backward", "module": name}
            assert w.first_underflow() is None   # FP32 gradients: nothing subnormal in FP32
        else:
            phase = fault.split("_")[0]
            assert w.first_nonfinite() == {"iteration": AT, "phase": phase, "module": name}
            report = {r["module"]: r for r in w.report()}
            assert AT in report[name]["nonfinite_iterations"]


def _gpt2_batch():
    ids = torch.randint(0, 64, (2, 12))
    return {"input_ids": ids, "labels": ids, "use_cache": False}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("fault", ["forward_inf", "backward_inf", "backward_tiny"])
def test_gpt2_producer(fault, compiled):
    from debug_models import _ScaleGradient
    torch.manual_seed(0)
    model = tiny_gpt2()
    phase = fault.split("_")[0]
    target = "transformer.h.1.mlp.c_fc" if phase == "forward" else "transformer.h.0.attn.c_proj"
    mul = torch.ones(1)

    def fault_hook(module, args, output):   # a user's hook, attached before the watch
        return output * mul if phase == "forward" else _ScaleGradient.apply(output, mul)

    model.get_submodule(target).register_forward_hook(fault_hook)
    run = _compile(model) if compiled else model
    with fusedamp.debug.watch(run) as w:
        for i in range(5):
            mul.fill_((1e-30 if fault == "backward_tiny" else INF) if i == AT else 1.0)
            out = run(**_gpt2_batch())
            out.loss.backward()
        if fault == "backward_tiny":
            assert w.first_nonfinite() is None
            assert w.first_underflow(dtype=torch.float16) == {
                "iteration": AT, "phase": "backward", "module": target}
        else:
            assert w.first_nonfinite(source=True) == {
                "iteration": AT, "phase": phase, "module": target, "source": "module"}
        names = [r["module"] for r in w.report()]
        assert names == [n for n, _ in model.named_modules()]


class _NoSync(TorchDispatchMode):
    """Fails on every aten op that makes the host wait for a value (or copies to the host)."""
    SYNCING = ("_local_scalar_dense", "nonzero", "is_nonzero", "equal", "allclose")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        assert name not in self.SYNCING, f"{name} synchronises the host"
        if name == "_to_copy" and "device" in (kwargs or {}):
            assert kwargs["device"] == args[0].device, "copy to another device"
        return func(*args, **(kwargs or {}))


def test_no_host_synchronisation_while_training(monkeypatch):
    torch.manual_seed(0)
    name, build, make_input = MODELS["cnn"]
    model = build()
    inputs = [make_input() for _ in range(4)]
    w = fusedamp.debug.watch(model)

    def refuse(*a, **k):
        raise AssertionError("host synchronisation")

    with monkeypatch.context() as m:
        for method in ("item", "tolist", "__bool__", "cpu", "numpy", "__float__", "__int__"):
            m.setattr(torch.Tensor, method, refuse)
        with _NoSync():
            train(model, iter(inputs).__next__, 4, lambda i: model.middle.inject(
                **(dict(backward=INF) if i == 2 else {})))
    assert w.first_nonfinite()["module"] == "middle.fault"
    w.remove()


def _hook_state(model):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
             len(m._backward_pre_hooks)) for m in model.modules()] + \
           [p._backward_hooks for p in model.parameters()]


def test_training_unchanged_and_removed_cleanly():
    name, build, make_input = MODELS["mlp"]
    torch.manual_seed(0)
    inputs = [make_input() for _ in range(4)]
    torch.manual_seed(1)
    plain = build()
    torch.manual_seed(1)
    watched = build()
    before = _hook_state(watched)
    train(plain, iter(inputs).__next__, 4)
    with fusedamp.debug.watch(watched) as w:
        train(watched, iter(inputs).__next__, 4)
        assert w.iterations == 4
    for a, b in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(a, b)
    assert _hook_state(watched) == before
    w.remove()   # idempotent


def test_bad_input():
    with pytest.raises(ValueError, match="no submodules"):
        fusedamp.debug.watch(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="nn.Module"):
        fusedamp.debug.watch(lambda x: x)
    with pytest.raises(ValueError, match="capacity"):
        fusedamp.debug.watch(nn.Sequential(nn.Linear(2, 2)), capacity=0)
    model = nn.Sequential(nn.Linear(2, 2))
    w = fusedamp.debug.watch(model)
    with pytest.raises(RuntimeError, match="already has a watch"):
        fusedamp.debug.watch(model)
    w.remove()
    fusedamp.debug.watch(model).remove()   # after remove(), a new watch attaches


class _Odd(nn.Module):
    """Returns a tuple holding None, an integer tensor and a dict."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return (y, None, {"count": torch.arange(3), "y2": y * 2}, 7)


class _Shared(nn.Module):
    """One Linear called twice per iteration, and a module returning non-tensors."""

    def __init__(self):
        super().__init__()
        self.odd = _Odd()
        self.shared = nn.Linear(4, 4)
        self.register_buffer("mul", torch.ones(1))

    def forward(self, x):
        y, _, d, _ = self.odd(x)
        return self.shared(self.shared(y) * self.mul) + d["y2"]


def test_non_tensor_outputs_shared_module_and_no_backward():
    model = _Shared()
    with fusedamp.debug.watch(model) as w:
        with torch.no_grad():
            model(torch.randn(3, 4))            # an iteration with no backward
        for i in range(3):
            model.mul.fill_(INF if i == 1 else 1.0)
            model(torch.randn(3, 4)).sum().backward()
        assert w.iterations == 4
        # the first call's output is finite, the second call gets inf*... from the parent's
        # multiply: the shared module's record combines both calls (inputs non-finite), so the
        # producer is the parent, whose own code made the inf
        assert w.first_nonfinite(source=True) == {"iteration": 2, "phase": "forward", "module": "",
                                       "source": "module"}
        report = {r["module"]: r for r in w.report()}
        assert report["odd"]["forward_amax"] > 0
        assert report["shared"]["nonfinite_iterations"] == [2]


def test_first_nonfinite_survives_the_ring():
    name, build, make_input = MODELS["mlp"]
    torch.manual_seed(0)
    model = build()
    with fusedamp.debug.watch(model, capacity=2) as w:
        train(model, make_input, 7, lambda i: model[3].inject(
            **(dict(forward=INF) if i in (1, 5) else {})), step=False)
        assert w.first_nonfinite(source=True) == {
            "iteration": 1, "phase": "forward", "module": name,
            "source": "module"}
        assert [h for h in w.history()["iterations"]] == [1, 5, 6]


def test_nonfinite_from_outside_and_clean_run():
    name, build, make_input = MODELS["mlp"]
    model = build()
    with fusedamp.debug.watch(model) as w:
        train(model, make_input, 2, step=False)
        assert w.first_nonfinite() is None
        x = make_input()
        x[0, 0] = float("nan")
        model(x)
        assert w.first_nonfinite(source=True) == {
            "iteration": 2, "phase": "forward", "module": "0",
            "source": "outside"}


@pytest.mark.parametrize("parameters", [False, True])
def test_first_layer_and_parameter_gradients(parameters):
    """The input needs no gradient: the fault's own code (a custom autograd function applied in
    its forward) made the inf its child received; with parameters=True the child's weight
    gradients count as produced too."""
    torch.manual_seed(0)
    model = nn.Sequential(Fault(8), nn.ReLU(), nn.Linear(8, 2))
    with fusedamp.debug.watch(model, parameters=parameters) as w:
        train(model, lambda: torch.randn(4, 8), 5,
              lambda i: model[0].inject(**(dict(backward=INF) if i == AT else {})), step=False)
        assert w.first_nonfinite(source=True) == {
            "iteration": AT, "phase": "backward", "module": "0",
            "source": "module"}
        report = {r["module"]: r for r in w.report()}
        assert (report["0.lin"]["backward_amax"] is not None) == parameters
        assert report["2"]["underflow_fraction"] is not None   # its input is the ReLU's output


@pytest.mark.parametrize("scaler", ["fusedamp", "torch"])
def test_with_grad_scalers_and_autocast(scaler, tmp_path):
    name, build, make_input = MODELS["mlp"]
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    grad_scaler = (fusedamp.GradScaler(device="cpu", init_scale=2.0 ** 8) if scaler == "fusedamp"
                   else torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))
    with fusedamp.debug.watch(model) as w:
        for i in range(5):
            model[3].inject(**(dict(backward=INF) if i == AT else {}))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(make_input()).float().square().mean()
            grad_scaler.scale(loss).backward()
            grad_scaler.step(opt)
            grad_scaler.update()
            opt.zero_grad()
        assert w.first_nonfinite(source=True) == {
            "iteration": AT, "phase": "backward", "module": name,
            "source": "module"}
        report = {r["module"]: r for r in w.report()}
        # autocast's BF16 outputs: headroom against BF16's range (same exponent range as FP32)
        assert report["0"]["headroom_bits"] > 100
        assert report["0"]["headroom_bits"] == pytest.approx(
            w.report(dtype=torch.float16)[1]["headroom_bits"] + 112, abs=0.5)
        path = w.plot(tmp_path / "watch.png")
        assert os.path.getsize(path) > 1000


def test_with_initialize_fp16_master_weights():
    """fusedamp.initialize's FP16 model (FP32 masters, its scaler): the FP16 gradients'
    underflow is counted against FP16, and a backward inf is named."""
    name, build, make_input = MODELS["mlp"]
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt, scaler = fusedamp.initialize(model, opt, dtype=torch.float16)
    with fusedamp.debug.watch(model) as w:
        for i in range(5):
            fault_of(model, "mlp").inject(**(dict(backward=INF) if i == AT else {}))
            loss = model(make_input()).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert w.first_nonfinite() == {"iteration": AT, "phase": "backward", "module": name}
        report = {r["module"]: r for r in w.report()}
        assert report[name]["headroom_bits"] < 16   # against FP16's 65504


class _LearnedQueries(nn.Module):
    """A parameter handed to a submodule as its input (learned queries, latents): a leaf
    tensor that every iteration's forward uses again."""

    def __init__(self):
        super().__init__()
        self.query = nn.Parameter(torch.randn(3, 8))
        self.proj = Fault(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.proj(self.query) + x)


def test_leaf_input_gradient_is_recorded_in_its_own_iteration():
    torch.manual_seed(0)
    model = _LearnedQueries()
    with fusedamp.debug.watch(model) as w:
        train(model, lambda: torch.randn(3, 8), 6,
              lambda i: model.proj.inject(**(dict(backward=INF) if i == AT else {})), step=False)
        assert w.first_nonfinite() == {"iteration": AT, "phase": "backward", "module": "proj"}
        assert w.report()[1]["nonfinite_iterations"] == [AT]
        assert model.query._backward_hooks   # the current iteration's hook, until remove()
    assert model.query._backward_hooks is None


def test_wrappers_are_seen_through():
    """Activation checkpointing's wrapper (whose module runs again in backward) and
    DataParallel's: the names are the user's, and the fault inside a wrapper is named."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    name, build, make_input = MODELS["mlp"]
    torch.manual_seed(0)
    model = build()
    names = [n for n, _ in model.named_modules()]
    model[2], model[3] = checkpoint_wrapper(model[2]), checkpoint_wrapper(model[3])
    wrapped = nn.DataParallel(model)
    with fusedamp.debug.watch(wrapped) as w:
        train(wrapped, make_input, 5, lambda i: model[3]._checkpoint_wrapped_module.inject(
            **(dict(backward=INF) if i == AT else {})), step=False)
        assert w.names == names
        assert w.first_nonfinite() == {"iteration": AT, "phase": "backward", "module": name}


def test_compiled_autograd():
    """A compiled step whose backward compiled autograd captures (one graph for every
    iteration): the watch's gradient hooks run between its pieces and still name the module
    of a backward underflow (iteration 2) and of a backward inf (iteration 4)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    name, build, make_input = MODELS["mlp"]
    torch.manual_seed(0)
    model = build()
    faults = {2: dict(backward=1e-30), 4: dict(backward=INF)}
    counters.clear()
    with torch._dynamo.config.patch(compiled_autograd=True):   # read when compiling

        @torch.compile(backend="aot_eager")
        def step(x):
            loss = model(x).float().square().mean()
            loss.backward()
            return loss

    with fusedamp.debug.watch(model) as w:
        for i in range(6):
            fault_of(model, "mlp").inject(**faults.get(i, {}))
            step(make_input())
            model.zero_grad()
        assert counters["compiled_autograd"]["captures"] == 1
        assert w.first_underflow(dtype=torch.float16) == {
            "iteration": 2, "phase": "backward", "module": name}
        assert w.first_nonfinite() == {"iteration": 4, "phase": "backward", "module": name}
