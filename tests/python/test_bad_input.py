"""Bad input to the ops, the optimizers and the scaler: every case raises a clear error (a
RuntimeError from an op) and leaves every tensor unchanged."""
import re

import pytest
import torch

import fusedamp
from op_helpers import _model_params, assert_bitwise_equal, ops, randn_list, scalar, snapshot
from op_inputs import op_inputs


def _fp16_master_inputs(device, **kw):
    """Three FP16 params with FP32 master weights and FP16 grads (seeded)."""
    return op_inputs(device, [(10,), (4, 5), (7,)], param_dtype=torch.float16,
                     master_weights=True, seed=20, **kw)


def _adam_cases(device):
    """(name, mutator of (args, kwargs), expected message fragment)."""
    def replace(i, j, fn):
        def mutate(args, kw):
            args[i][j] = fn(args[i][j])
        return mutate

    def kw(**changes):
        def mutate(args, kwargs):
            kwargs.update(changes)
        return mutate

    return [
        ("grads list too short", lambda a, k: a[2].pop(), "grads has 2 tensors"),
        ("master list wrong length", lambda a, k: a[1].pop(), "master_params has 2"),
        ("float64 params", replace(0, 0, lambda t: t.double()), "params have dtype"),
        ("mixed params dtypes", replace(0, 1, lambda t: t.float()), "one call takes one params dtype"),
        ("bfloat16 grads for fp16 params", lambda a, k: a.__setitem__(2, [g.bfloat16() for g in a[2]]),
         "grads must have the params' dtype or float32"),
        ("fp16 first master (a Kahan list), FP32 rest", replace(1, 0, lambda t: t.half()),
         "master_params[1] has dtype Float but master_params[0] has Half"),
        ("non-dense grad", replace(2, 1, lambda t: torch.randn(4, 10, device=t.device).half()[:, ::2]),
         "non-overlapping and dense"),
        ("shape mismatch", replace(3, 2, lambda t: torch.zeros(8, device=t.device)), "has shape"),
        ("sparse grad", replace(2, 0, lambda t: t.float().to_sparse().half()), "sparse"),
        ("grad on another device", replace(2, 0, lambda t: t.to("meta")), "share one device"),
        ("master aliases params", lambda a, k: a[1].__setitem__(0, a[3][0]), "share memory"),
        ("int step", replace(5, 0, lambda t: t.int()), "must be Float"),
        ("negative lr", kw(lr=-1.0), "invalid lr"),
        ("beta1 = 1", kw(beta1=1.0), "invalid beta1"),
        ("beta2 < 0", kw(beta2=-0.1), "invalid beta2"),
        ("negative eps", kw(eps=-1e-8), "invalid eps"),
        ("nan weight decay", kw(weight_decay=float("nan")), "invalid weight_decay"),
        ("max_grad_norm without sum", kw(max_grad_norm=1.0), "needs grad_sum_sq"),
        ("zero max_grad_norm", kw(max_grad_norm=0.0, grad_sum_sq=scalar(1.0, device)),
         "max_grad_norm must be finite and > 0"),
        ("found_inf of two elements", kw(found_inf=torch.zeros(2, device=device)),
         "exactly one element"),
        ("int inv_scale", kw(inv_scale=torch.ones(1, dtype=torch.int32, device=device)),
         "inv_scale must be Float"),
    ]


@pytest.mark.parametrize("case", range(21))
def test_adam_step_bad_input(device, case):
    name, mutate, message = _adam_cases(device)[case]
    inp = _fp16_master_inputs(device)
    args, kwargs = inp.args("adam_step_", weight_decay=0.0)
    args = list(args)  # its lists are fresh copies: a case edits them, never inp's
    mutate(args, kwargs)
    before = snapshot(*inp.tensors("adam_step_"))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.adam_step_(*args, **kwargs)
    assert_bitwise_equal(before, snapshot(*inp.tensors("adam_step_")))


@pytest.mark.parametrize("kwargs,message", [
    (dict(lr=-0.1), "invalid lr"),
    (dict(momentum=-0.5), "invalid momentum"),
    (dict(nesterov=True, momentum=0.9, dampening=0.1), "Nesterov momentum requires"),
    (dict(nesterov=True, momentum=0.0), "Nesterov momentum requires"),
    (dict(momentum=0.0, bufs=True), "momentum_buffers must be empty"),
    (dict(momentum=0.9, bufs=False), "momentum_buffers has 0 tensors"),
])
def test_sgd_step_bad_input(device, kwargs, message):
    inp = _fp16_master_inputs(device, moments=False, momentum=True)
    kw = dict(lr=0.1, momentum=0.9)
    kw.update(kwargs)
    if not kw.pop("bufs", True):
        kw["momentum_buffers"] = []
    before = snapshot(*inp.tensors("sgd_step_"))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        inp.call("sgd_step_", **kw)
    assert_bitwise_equal(before, snapshot(*inp.tensors("sgd_step_")))


@pytest.mark.parametrize("kwargs,message", [
    (dict(growth_factor=1.0), "growth_factor must be > 1"),
    (dict(backoff_factor=1.0), "backoff_factor must be in"),
    (dict(backoff_factor=0.0), "backoff_factor must be in"),
    (dict(growth_interval=0), "growth_interval must be a positive"),
    (dict(hysteresis=0), "hysteresis must be a positive"),
    (dict(min_scale=-1.0), "min_scale must be finite and > 0"),
    (dict(min_scale=8.0, max_scale=4.0), "must not exceed max_scale"),
    (dict(tracker_dtype=torch.int64), "growth_tracker must be Int"),
    (dict(scale_shape=(2,)), "scale must have exactly one element"),
])
def test_update_scale_bad_input(device, kwargs, message):
    inp = op_inputs(device, [], loss_scale=1024.0, scalars=dict(found_inf=1.0))
    kw = dict(growth_interval=10, hysteresis=1)
    kw.update(kwargs)
    if "scale_shape" in kw:
        inp.scale = torch.full(kw.pop("scale_shape"), 1024.0, device=device)
    if "tracker_dtype" in kw:
        inp.growth_tracker = inp.growth_tracker.to(kw.pop("tracker_dtype"))
    before = snapshot(*inp.tensors("update_scale_"))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        inp.call("update_scale_", **kw)
    assert_bitwise_equal(before, snapshot(*inp.tensors("update_scale_")))


@pytest.mark.parametrize("case,message", [
    ("integer grad", "supported are float32, float16 and bfloat16"),
    ("flags too short", "tensor_flags has 1 elements"),
    ("int found_inf", "found_inf must be Float"),
    ("sparse grad", "sparse"),
])
def test_grad_stats_and_unscale_bad_input(device, case, message):
    inp = op_inputs(device, grads=randn_list(device, sizes=[(10,), (3,)], seed=21),
                    scalars=dict(found_inf=0.0, grad_sum_sq=0.0, tensor_flags=0.0, inv_scale=0.5))
    if case == "integer grad":
        inp.grads[1] = inp.grads[1].to(torch.int32)
    elif case == "flags too short":
        inp.tensor_flags = torch.zeros(1, device=device)
    elif case == "int found_inf":
        inp.found_inf = torch.zeros(1, dtype=torch.int32, device=device)
    elif case == "sparse grad":
        inp.grads[0] = inp.grads[0].to_sparse()
    before = snapshot(*inp.tensors("grad_stats_"))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        inp.call("grad_stats_")
    if case != "flags too short":
        with pytest.raises(RuntimeError, match=re.escape(message)):
            inp.call("unscale_and_check_")
    assert_bitwise_equal(before, snapshot(*inp.tensors("grad_stats_")))


@pytest.mark.parametrize("name", ["skip_nonfinite", "amsgrad", "adopt_param_edits"])
@pytest.mark.parametrize("value", ["kahan", 2, 0.5])
def test_flag_options_refuse_anything_but_true_or_false(name, value):
    """A flag given another value ("kahan", 2 or 0.5) is refused, never taken as True; the
    optimizer is not built."""
    import fusedamp.optim

    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    with pytest.raises((ValueError, TypeError),
                       match="True .* or False|True or False|must be a number"):
        fusedamp.optim.Adam([p], **{name: value})


@pytest.mark.parametrize("value", ["Kahan", "fp16", 2, 0.5, 1, None])
def test_master_weights_refuses_what_is_not_a_mode(value):
    """master_weights takes True, False or a mode's name; a number (even 1) or a misspelt name
    is refused with the list of modes, never read as one."""
    import fusedamp.optim

    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(ValueError, match='True, False, "split", "kahan"|True \\(an FP32'):
        fusedamp.optim.Adam([p], master_weights=value)


def test_bad_arguments_raise_clear_errors(device):
    ps = _model_params(device)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        fusedamp.optim.AdamW(ps, lr=-1.0)
    with pytest.raises(ValueError, match="beta"):
        fusedamp.optim.Adam(ps, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="Nesterov"):
        fusedamp.optim.SGD(ps, nesterov=True)
    with pytest.raises(RuntimeError, match="growth_factor"):
        fusedamp.GradScaler(device, growth_factor=1.0)
    # Not an error: scale() multiplies any tensor of outputs, with torch.amp's type promotion;
    # an FP16 one first holds the scale at 2^15 (the README's differences), so torch's product
    # at that scale is the reference.
    ours = fusedamp.GradScaler(device)
    theirs = torch.amp.GradScaler(device, init_scale=2.0 ** 15)
    for t in (torch.ones(3, device=device, dtype=torch.float16), torch.ones((), device=device,
                                                                          dtype=torch.float16)):
        if theirs.is_enabled():
            a, b = ours.scale(t), theirs.scale(t)
            assert a.dtype == b.dtype and torch.equal(a, b)
