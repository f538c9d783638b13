"""The host-overhead benchmark's sides: what each side of a row times (an op of fusedamp or
torch on N one-element tensors, or a whole AMP step of either), built for one N, with the reset
that runs untimed before each call."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import harness

# The op tests' input builder: the benchmark times the inputs the tests check.
harness.use_paths("tests")
from op_inputs import HYPER_DEFAULTS, op_inputs  # noqa: E402

LOSS_SCALE = 1024.0     # randn gradients / 1024 stay normal in FP16
MAX_GRAD_NORM = 1.0
ADAM = HYPER_DEFAULTS["adam_step_"]  # the hyper-parameters of every Adam row, both sides
LEAN_OPTIONS = dict(adopt_param_edits=False, write_back_grads=False)


class Skip(Exception):
    """A side of a row that this device or this installed package cannot run; the message
    says why and stands in the table instead of a number."""


@dataclass
class Timed:
    """What one side of a row times: `call` is timed, `reset` runs before it, untimed."""
    call: Callable[[], object]
    reset: Callable[[], object]


@dataclass
class Side:
    key: str                      # measured once per N, however many rows show it
    label: str
    dtype: str
    build: Callable[[str, int, int], Timed]   # (device, tensors, numel) -> Timed



# ----------------------------------------------------------------------------- inputs
def sizes_of(n, numel):
    return [(numel,)] * n


def refill(grads, found_inf=None):
    """Puts the gradients back as they were now (and found_inf at zero): the reset between
    timed calls of anything that unscales or clips them in place."""
    pristine = [g.clone() for g in grads]

    def reset():
        torch._foreach_copy_(grads, pristine)
        if found_inf is not None:
            found_inf.zero_()
    return reset


def fusedamp_op(op, via_torch_ops=False, **problem):
    """A bare fusedamp op on op_inputs' problem, with the op's own defaults, called through
    fusedamp.ops (the direct entry) or, with via_torch_ops, torch.ops.fusedamp (torch's boxed
    path for custom operators). The arguments come from the installed op's schema
    (OpInputs.args), so an older build without newer optional arguments runs too."""
    def build(device, n, numel):
        import fusedamp
        entry = torch.ops.fusedamp if via_torch_ops else getattr(fusedamp, "ops", None)
        if not hasattr(entry, op):
            raise Skip("the installed fusedamp has no fusedamp.ops entry")
        inp = op_inputs(device, sizes_of(n, numel), loss_scale=LOSS_SCALE, **problem)
        return Timed(inp.bind(op, entry=entry), refill(inp.grads, inp.found_inf))
    return build


def torch_problem(device, n, numel, grad_dtype):
    # The same builder as fusedamp's rows: FP32 params and state, no masters.
    return op_inputs(device, sizes_of(n, numel), grad_dtype=grad_dtype, loss_scale=LOSS_SCALE,
                     scalars=dict(found_inf=0.0, inv_scale=1.0 / LOSS_SCALE))


def torch_unscale(device, n, numel):
    inp = torch_problem(device, n, numel, torch.float16)
    return Timed(lambda: torch._amp_foreach_non_finite_check_and_unscale_(
        inp.grads, inp.found_inf, inp.inv_scale), refill(inp.grads, inp.found_inf))


def torch_fused_adamw(device, n, numel):
    inp = torch_problem(device, n, numel, torch.float32)
    hyper = dict(lr=ADAM["lr"], beta1=ADAM["beta1"], beta2=ADAM["beta2"], eps=ADAM["eps"],
                 weight_decay=ADAM["weight_decay"])
    return Timed(lambda: torch._fused_adamw_(
        inp.params, inp.grads, inp.exp_avgs, inp.exp_avg_sqs, [], inp.steps, amsgrad=False,
        maximize=False, grad_scale=inp.scale, found_inf=inp.found_inf, **hyper),
        refill(inp.grads, inp.found_inf))


def torch_norm_and_check(device, n, numel):
    inp = torch_problem(device, n, numel, torch.float16)
    check_only = torch.ones(1, device=device)

    def call():
        torch._foreach_norm(inp.grads)
        torch._amp_foreach_non_finite_check_and_unscale_(inp.grads, inp.found_inf, check_only)
    return Timed(call, refill(inp.grads, inp.found_inf))


def renew(params):
    """Gives every parameter a new gradient tensor with the values it has now, as a training loop
    with zero_grad(set_to_none=True) (torch's default) and a backward does: the reset between
    timed calls of a row whose step must not find last call's gradient tensors again. The
    previous gradients are dropped here, outside the timed call, unless the step holds them."""
    pristine = [p.grad.clone() for p in params]

    def reset():
        for p, g in zip(params, pristine):
            p.grad = None
            p.grad = g.clone()
    return reset


# ----------------------------------------------------------------------------- whole steps
def model_params(device, n, numel, dtype):
    """Leaf parameters with gradients in their own dtype, from op_inputs' values."""
    inp = op_inputs(device, sizes_of(n, numel), param_dtype=dtype, moments=False)
    params = [torch.nn.Parameter(p) for p in inp.params]
    for p, g in zip(params, inp.grads):
        p.grad = g
    return params


def require_real_device(device):
    if device == "meta":
        raise Skip("the optimizer APIs need real tensors")


def start_iteration(scaler, device):
    # An iteration starts with scale(): the scaler creates its scale on the device there.
    scaler.scale(torch.ones((), device=device))


def fusedamp_whole_step(clip, lean=False, telemetry=True, new_grads=False):
    def build(device, n, numel):
        require_real_device(device)
        import fusedamp
        import fusedamp.optim
        params = model_params(device, n, numel, torch.float16)
        options = dict(LEAN_OPTIONS) if lean else {}
        if clip:
            options["max_grad_norm"] = MAX_GRAD_NORM
        try:
            opt = fusedamp.optim.AdamW(params, lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]),
                                       eps=ADAM["eps"], weight_decay=ADAM["weight_decay"],
                                       **options)
        except (TypeError, ValueError) as e:
            refused = sorted(LEAN_OPTIONS if lean else options)
            raise Skip(f"the installed fusedamp.optim.AdamW refuses {refused} ({e})") from e
        try:
            scaler = fusedamp.GradScaler(device, init_scale=LOSS_SCALE, telemetry=telemetry)
        except TypeError as e:
            raise Skip(f"the installed fusedamp.GradScaler has no telemetry switch ({e})") from e
        start_iteration(scaler, device)

        def call():
            scaler.step(opt)
            scaler.update()
        return Timed(call, renew(params) if new_grads else refill([p.grad for p in params]))
    return build


def torch_whole_step(clip, new_grads=False):
    def build(device, n, numel):
        require_real_device(device)
        params = model_params(device, n, numel, torch.float32)
        opt = torch.optim.AdamW(params, lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]),
                                eps=ADAM["eps"], weight_decay=ADAM["weight_decay"], fused=True)
        scaler = torch.amp.GradScaler(device, init_scale=LOSS_SCALE)
        start_iteration(scaler, device)

        def call():
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM, foreach=True)
            scaler.step(opt)
            scaler.update()
        return Timed(call, renew(params) if new_grads else refill([p.grad for p in params]))
    return build
