"""torch.library.opcheck on every operator: schema/mutation annotations, FakeTensor (Meta
kernels), functionalization and AOT dispatch."""
import pytest
import torch

from op_helpers import ops
from op_inputs import op_inputs

# The step operators: one per algorithm of the C++ list (fusedamp/ops.h).
STEP_OPS = ["adam_step_", "sgd_step_", "lion_step_"]
NAMES = ["unscale_and_check_", "grad_stats_", "update_scale_", "account_step_"] + STEP_OPS

# Per op: how its sample inputs are built, and the hyper-parameters it is called with.
SAMPLES = {
    "unscale_and_check_": (dict(scalars=dict(found_inf=0.0, inv_scale=0.5)), {}),
    "grad_stats_": (dict(scalars=dict(found_inf=0.0, grad_sum_sq=0.0, tensor_flags=0.0)), {}),
    "update_scale_": (dict(loss_scale=8.0, scalars=dict(found_inf=1.0)),
                      dict(growth_interval=3, hysteresis=1, min_scale=1.0)),
    "account_step_": (dict(scalars=dict(step_applied=1.0, skipped_steps=2, found_inf=1.0,
                                        found_inf_out=0.0, grad_sum_sq=9.0, inv_scale=0.5,
                                        grad_norm=0.0)), {}),
    "adam_step_": (dict(scalars=dict(inv_scale=0.5, found_inf=0.0, grad_sum_sq=4.0,
                                     lr_tensor=1e-3)), dict(max_grad_norm=1.0)),
    "sgd_step_": (dict(moments=False, momentum=True),
                  dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True)),
    "lion_step_": (dict(scalars=dict(inv_scale=0.5, found_inf=0.0, lr_tensor=1e-3)),
                   dict(weight_decay=0.1)),
}


@pytest.mark.parametrize("name", NAMES)
def test_opcheck(device, name):
    build, hyper = SAMPLES[name]
    inp = op_inputs(device, [(5,), (3, 4)], param_dtype=torch.float16, master_weights=True,
                    seed=30, **build)
    args, kwargs = inp.args(name, **hyper)
    torch.library.opcheck(getattr(ops, name).default, args, kwargs)


@pytest.mark.parametrize("name", STEP_OPS)
def test_opcheck_with_write_back_and_amsgrad(device, name):
    """The mutable grads (write_back_grads) and AMSGrad's optional list under opcheck too."""
    build, hyper = SAMPLES[name]
    inp = op_inputs(device, [(5,), (3, 4)], param_dtype=torch.float16, master_weights=True,
                    seed=31, **build)
    extra = dict(write_back_grads=True)
    if name == "adam_step_":
        extra["max_exp_avg_sqs"] = [torch.zeros_like(m) for m in inp.master_params]
    args, kwargs = inp.args(name, **hyper, **extra)
    torch.library.opcheck(getattr(ops, name).default, args, kwargs)


def test_opcheck_telemetry_and_amax_policy(device):
    """grad_stats_'s and unscale_and_check_'s statistics outputs and update_scale_'s amax
    policy under opcheck."""
    inp = op_inputs(device, [(5,), (3, 4)], param_dtype=torch.float16, seed=32,
                    scalars=dict(found_inf=0.0, grad_sum_sq=0.0))
    telemetry = torch.tensor([0.0, 0.0, 0.0, float("inf")], dtype=torch.float64, device=device)
    args, kwargs = inp.args("grad_stats_", telemetry=telemetry)
    torch.library.opcheck(ops.grad_stats_.default, args, kwargs)
    inp = op_inputs(device, [(5,), (3, 4)], param_dtype=torch.float16, seed=33,
                    scalars=dict(found_inf=0.0, inv_scale=0.5, grad_sum_sq=0.0))
    args, kwargs = inp.args("unscale_and_check_", sum_sq=inp.grad_sum_sq,
                            telemetry=telemetry.clone())
    torch.library.opcheck(ops.unscale_and_check_.default, args, kwargs)
    inp = op_inputs(device, [(5,)], loss_scale=8.0, scalars=dict(found_inf=0.0))
    amax = torch.tensor([3.0], dtype=torch.float64, device=device)
    args, kwargs = inp.args("update_scale_", amax=amax, amax_target=64.0)
    torch.library.opcheck(ops.update_scale_.default, args, kwargs)


@pytest.mark.parametrize("name", STEP_OPS)
@pytest.mark.parametrize("store", ["split", "kahan", "stochastic"])
def test_opcheck_master_weight_modes(device, name, store):
    """The 16-bit weight stores (int16 remainders, Kahan compensations, stochastic rounding
    seeds) and BF16 optimizer state under opcheck."""
    build, hyper = SAMPLES[name]
    inp = op_inputs(device, [(5,), (3, 4)], param_dtype=torch.bfloat16, seed=34, **build)
    extra = {}
    if store == "split":
        extra["master_params"] = [torch.zeros_like(p, dtype=torch.int16) for p in inp.params]
    elif store == "kahan":
        extra["master_params"] = [torch.zeros_like(p) for p in inp.params]
    else:
        extra["rounding_seeds"] = [3, 4]
    takes = {a.name for a in getattr(ops, name).default._schema.arguments}
    for state in ("exp_avgs", "exp_avg_sqs", "momentum_buffers"):
        if getattr(inp, state) and state in takes:
            extra[state] = [t.to(torch.bfloat16) for t in getattr(inp, state)]
    args, kwargs = inp.args(name, **hyper, **extra)
    torch.library.opcheck(getattr(ops, name).default, args, kwargs)


@pytest.mark.parametrize("store", ["master", "split"])
@pytest.mark.parametrize("name", ["adam_step_", "sgd_step_"])
def test_opcheck_quantized_state(device, name, store):
    """8-bit state under opcheck: Adam's int8/uint8 codes and the moment_scales list, SGD's int8
    buffer codes and the momentum_scales list."""
    build, hyper = SAMPLES[name]
    inp = op_inputs(device, [(5,), (3, 40)], param_dtype=torch.bfloat16,
                    master_weights=store == "master", seed=35, **build)

    def codes(dtype, low, high):
        return [torch.randint(low, high, p.shape, dtype=dtype, device=device)
                for p in inp.params]

    def scales(columns):
        return [torch.rand((p.numel() + 31) // 32, columns, device=device) for p in inp.params]

    if name == "adam_step_":
        extra = dict(exp_avgs=codes(torch.int8, -127, 128),
                     exp_avg_sqs=codes(torch.uint8, 0, 256), moment_scales=scales(2))
    else:
        extra = dict(momentum_buffers=codes(torch.int8, -127, 128), momentum_scales=scales(1))
    if store == "split":
        extra["master_params"] = [torch.zeros_like(p, dtype=torch.int16) for p in inp.params]
    args, kwargs = inp.args(name, **hyper, **extra)
    torch.library.opcheck(getattr(ops, name).default, args, kwargs)
