"""fusedamp.ops, the operators' direct Python entry, against torch.ops.fusedamp.

The entry must be torch.ops.fusedamp.<op> in everything but its host cost: the same effects bit
for bit (values and version counters), the same defaults, the same errors for every bad call,
with nothing changed by a refused call, and __torch_function__ subclasses and modes served as
torch.ops serves them. It borrows the tensors of the lists it is given: no reference may be
left behind (a leak) or taken away (a crash).
"""
import gc
import math
import sys
import weakref

import pytest
import torch

import fusedamp
from op_helpers import _bits, assert_bitwise_equal, snapshot
from op_inputs import op_inputs

LOSS_SCALE = 1024.0
SIZES = [(3, 5), (17,), (1,), (64, 3), (2, 2, 2)]


def telemetry_seed(device):
    return torch.tensor([0.0, 0.0, 0.0, math.inf], dtype=torch.float64, device=device)


# (op, op_inputs options, per-side extra arguments: name -> fn(device, inputs) giving a fresh
# value for each side)
CASES = {
    "unscale": ("unscale_and_check_",
                dict(param_dtype=torch.float16,
                     scalars=dict(found_inf=0.0, inv_scale=1 / LOSS_SCALE)), {}),
    "unscale_stats": ("unscale_and_check_",
                      dict(param_dtype=torch.bfloat16,
                           scalars=dict(found_inf=0.0, inv_scale=1 / LOSS_SCALE,
                                        grad_sum_sq=0.0)),
                      dict(sum_sq=lambda d, i: i.grad_sum_sq,
                           telemetry=lambda d, i: telemetry_seed(d))),
    "grad_stats": ("grad_stats_",
                   dict(param_dtype=torch.float16,
                        scalars=dict(found_inf=0.0, grad_sum_sq=0.0, tensor_flags=0.0)),
                   dict(telemetry=lambda d, i: telemetry_seed(d))),
    "update_scale": ("update_scale_", dict(scalars=dict(found_inf=0.0), loss_scale=LOSS_SCALE),
                     dict(growth_interval=lambda d, i: 1)),
    "update_scale_bounds": ("update_scale_",
                            dict(scalars=dict(found_inf=1.0), loss_scale=LOSS_SCALE,
                                 hysteresis=2),
                            dict(hysteresis=lambda d, i: 2, min_scale=lambda d, i: 1.0,
                                 max_scale=lambda d, i: 2.0 ** 20, growth_factor=lambda d, i: 3,
                                 backoff_factor=lambda d, i: 0.25)),
    "account_step": ("account_step_",
                     dict(scalars=dict(step_applied=1.0, skipped_steps=0, found_inf=1.0,
                                       found_inf_out=0.0, grad_sum_sq=9.0, inv_scale=0.5,
                                       grad_norm=0.0)), {}),
    "adam_fp32": ("adam_step_", dict(scalars=dict(found_inf=0.0, inv_scale=1 / LOSS_SCALE)),
                  {}),
    "adam_masters_clip": ("adam_step_",
                          dict(param_dtype=torch.float16, master_weights=True,
                               scalars=dict(found_inf=0.0, inv_scale=1 / LOSS_SCALE,
                                            grad_sum_sq=4.0e6, lr_tensor=3e-3)),
                          dict(max_grad_norm=lambda d, i: 1.0,
                               write_back_grads=lambda d, i: True)),
    "adam_amsgrad": ("adam_step_", dict(param_dtype=torch.bfloat16, master_weights=True),
                     dict(max_exp_avg_sqs=lambda d, i: [torch.zeros_like(m)
                                                       for m in i.master_params],
                          decoupled_weight_decay=lambda d, i: False)),
    "adam_kahan": ("adam_step_", dict(param_dtype=torch.bfloat16),
                   dict(master_params=lambda d, i: [torch.zeros_like(p) for p in i.params])),
    "adam_stochastic": ("adam_step_", dict(param_dtype=torch.bfloat16),
                        dict(rounding_seeds=lambda d, i: (7, 8, 9, 10, 11))),
    "sgd_nesterov": ("sgd_step_",
                     dict(param_dtype=torch.float16, master_weights=True, moments=False,
                          momentum=True, scalars=dict(found_inf=0.0, inv_scale=1 / LOSS_SCALE)),
                     dict(momentum=lambda d, i: 0.9, nesterov=lambda d, i: True,
                          weight_decay=lambda d, i: 1e-2, maximize=lambda d, i: True)),
    "lion_split": ("lion_step_",
                   dict(param_dtype=torch.bfloat16, scalars=dict(found_inf=0.0, lr_tensor=1e-3)),
                   dict(master_params=lambda d, i: [torch.zeros_like(p, dtype=torch.int16)
                                                    for p in i.params],
                        weight_decay=lambda d, i: 0.1)),
}


def problem_of(device, case):
    op, options, extra = CASES[case]
    options = dict(options)
    inputs = op_inputs(device, SIZES, **options)
    return op, inputs, {name: make(device, inputs) for name, make in extra.items()}


def tensors_of(inputs, extra):
    out = [t for _, t in inputs.named_tensors()]
    for value in extra.values():
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, list):
            out.extend(value)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_effect_as_torch_ops(device, case):
    """Three calls through each entry on twin problems: every tensor equal bit for bit after
    each call, and every version counter too (the same in-place bumps)."""
    op, via_torch, extra_torch = problem_of(device, case)
    _, direct, extra_direct = problem_of(device, case)
    for call in range(3):
        via_torch.call(op, **extra_torch)
        direct.bind(op, entry=fusedamp.ops, **extra_direct)()
        for a, b in zip(tensors_of(via_torch, extra_torch), tensors_of(direct, extra_direct),
                        strict=True):
            assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), (case, call)
            assert a._version == b._version, (case, call)


def test_keywords_positions_and_tuples(device):
    """Any argument before the schema's `*` may come by position or by name, lists as tuples:
    the same step."""
    op, ref, _ = problem_of(device, "adam_fp32")
    _, other, _ = problem_of(device, "adam_fp32")
    args, kwargs = ref.args(op)
    torch.ops.fusedamp.adam_step_(*args, **kwargs)
    names = ["params", "master_params", "grads", "exp_avgs", "exp_avg_sqs", "steps"]
    other_args, other_kwargs = other.args(op)
    by_name = {name: tuple(value) for name, value in zip(names[2:], other_args[2:])}
    fusedamp.ops.adam_step_(*other_args[:2], **by_name, **other_kwargs)
    for a, b in zip(ref.params + ref.exp_avg_sqs, other.params + other.exp_avg_sqs, strict=True):
        assert torch.equal(a, b)


def odd_calls():
    """(what is odd, fn(inputs) -> (args, kwargs)) for adam_step_ calls off the common path."""
    def adam(**change):
        def build(inputs):
            args, kwargs = inputs.args("adam_step_")
            args = list(args)
            for name, value in change.items():
                if name.startswith("arg"):  # arg<k>: the k-th positional argument
                    args[int(name[3:])] = value(inputs)
                else:
                    kwargs[name] = value(inputs) if callable(value) else value
            return tuple(args), kwargs
        return build

    def missing_lr(inputs):
        args, kwargs = inputs.args("adam_step_")
        kwargs.pop("lr")
        return args, kwargs

    def twice(inputs):
        args, kwargs = inputs.args("adam_step_")
        return args, dict(kwargs, params=args[0])

    def too_many(inputs):
        args, kwargs = inputs.args("adam_step_")
        return (*args, 1e-3), kwargs

    return [
        ("a params dtype that differs in one tensor (the op's own check)",
         adam(arg0=lambda i: i.params[:1] + [i.params[1].double()] + i.params[2:])),
        ("a list element that is not a tensor", adam(arg2=lambda i: i.grads[:2] + [3] + i.grads[3:])),
        ("a list given as a generator", adam(arg2=lambda i: (g for g in i.grads))),
        ("an unknown keyword", adam(lrr=1e-3)),
        ("a missing required argument", missing_lr),
        ("an argument given twice", twice),
        ("too many positional arguments", too_many),
        ("a string for a float", adam(lr="0.1")),
        ("an int for a bool", adam(maximize=1)),
        ("rounding_seeds present but empty (not None) for FP32 params", adam(rounding_seeds=[])),
        ("a non-tensor for an optional tensor", adam(inv_scale=0.5)),
        ("a negative learning rate", adam(lr=-1.0)),
    ]


ODD_CALLS = odd_calls()


@pytest.mark.parametrize("what, build", ODD_CALLS, ids=[what for what, _ in ODD_CALLS])
def test_odd_calls_match_torch_ops(device, what, build):
    """Each odd call has the same outcome through both entries, on twin problems: the same
    exception type and message with nothing changed, or (where torch.ops takes it, e.g. a
    generator for a list) the same effect bit for bit."""
    outcomes, states = [], []
    for entry in (torch.ops.fusedamp, fusedamp.ops):
        _, inputs, _ = problem_of(device, "adam_fp32")
        before = snapshot(*inputs.tensors("adam_step_"))
        args, kwargs = build(inputs)
        try:
            entry.adam_step_(*args, **kwargs)
            outcomes.append("ran")
        except Exception as e:  # noqa: BLE001 -- the outcome itself is compared
            outcomes.append((type(e), str(e).split("\n")[0]))
            assert_bitwise_equal(before, inputs.tensors("adam_step_"))
        states.append(snapshot(*inputs.tensors("adam_step_")))
    assert outcomes[0] == outcomes[1], what
    assert_bitwise_equal(states[0], states[1])


class Recorded(torch.Tensor):
    """A tensor subclass that records the functions called on it through __torch_function__."""
    calls = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_torch_function_subclass_goes_through_torch_ops(device):
    op, inputs, _ = problem_of(device, "unscale")
    _, twin, _ = problem_of(device, "unscale")
    Recorded.calls.clear()
    inputs.grads[2] = inputs.grads[2].as_subclass(Recorded)
    fusedamp.ops.unscale_and_check_(inputs.grads, inputs.found_inf, inputs.inv_scale)
    assert any("fusedamp.unscale_and_check_" in str(f) for f in Recorded.calls), Recorded.calls
    twin.call(op)
    for a, b in zip(inputs.grads, twin.grads, strict=True):
        assert torch.equal(a.as_subclass(torch.Tensor), b)


def test_torch_function_mode_sees_the_call(device):
    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    op, inputs, _ = problem_of(device, "adam_fp32")
    args, kwargs = inputs.args(op)
    with Mode():
        fusedamp.ops.adam_step_(*args, **kwargs)
    assert any("fusedamp.adam_step_" in str(f) for f in seen), seen
    assert all(float(s) == 1.0 for s in inputs.steps)


def test_parameters_take_the_direct_path(device):
    """nn.Parameter is a plain tensor to the entry (as to torch): the call runs, with the
    same result as torch.ops."""
    op, inputs, _ = problem_of(device, "adam_fp32")
    _, twin, _ = problem_of(device, "adam_fp32")
    inputs.params = [torch.nn.Parameter(p, requires_grad=False) for p in inputs.params]
    inputs.call(op)
    twin.bind(op, entry=fusedamp.ops)()
    for a, b in zip(inputs.params, twin.params, strict=True):
        assert torch.equal(a, b)


def test_borrowed_tensors_are_neither_kept_nor_released(device):
    """The entry borrows every tensor of a list: after calls with temporary lists, each tensor
    has the Python references it had (none released: using them still works) and dies when the
    caller drops it (none kept)."""
    _, inputs, _ = problem_of(device, "unscale")
    grads = inputs.grads
    refcounts = [sys.getrefcount(g) for g in grads]
    for _ in range(50):
        fusedamp.ops.unscale_and_check_(list(grads), inputs.found_inf, inputs.inv_scale)
        fusedamp.ops.unscale_and_check_(tuple(grads), inputs.found_inf, inputs.inv_scale)
    assert [sys.getrefcount(g) for g in grads] == refcounts
    assert all(torch.isfinite(g.float()).all() for g in grads)
    watchers = [weakref.ref(g) for g in grads]
    del grads, inputs
    gc.collect()
    assert all(w() is None for w in watchers)


def test_under_torch_compile_the_registered_operator_is_traced():
    """fusedamp.ops inside a fullgraph torch.compile: traced as torch.ops.fusedamp (no graph
    break), same result as eager."""
    grads = [torch.randn(5) * LOSS_SCALE, torch.randn(3) * LOSS_SCALE]
    eager = [g.clone() for g in grads]
    inv = torch.full((1,), 1 / LOSS_SCALE)

    def unscale(gs, found_inf):
        fusedamp.ops.unscale_and_check_(gs, found_inf, inv)
        return gs[0] * 2

    found_compiled, found_eager = torch.zeros(1), torch.zeros(1)
    out = torch.compile(unscale, fullgraph=True)(grads, found_compiled)
    ref = unscale(eager, found_eager)
    assert torch.equal(out, ref) and torch.equal(found_compiled, found_eager)
    for a, b in zip(grads, eager, strict=True):
        assert torch.equal(a, b)


def test_list_emptied_by_another_thread_during_the_call():
    """The op runs with the GIL released; another thread that empties the caller's list and
    collects garbage meanwhile must not free a tensor the op is working on (4 MiB tensors: their
    memory goes back to the system when freed, so a use after free would crash here)."""
    import threading

    def fours():
        return [torch.full((1 << 20,), 4.0) for _ in range(16)]

    grads = fours()
    watchers = [weakref.ref(g) for g in grads]
    found, inv = torch.zeros(1), torch.full((1,), 0.5)
    started = threading.Event()

    def empty_the_list():
        started.wait()
        grads.clear()
        gc.collect()

    other = threading.Thread(target=empty_the_list)
    other.start()
    started.set()
    fusedamp.ops.unscale_and_check_(grads, found, inv)
    other.join()
    assert grads == [] and found.item() == 0.0
    gc.collect()
    assert all(w() is None for w in watchers)  # and none of them was kept alive by the call
