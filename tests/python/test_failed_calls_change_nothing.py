"""Nothing changes when a call fails: fusedamp.initialize with an argument it refuses, an
optimizer's or a scaler's load_state_dict of a corrupt checkpoint leave every parameter,
buffer, hook, optimizer group and state as it was (and a retry with good arguments works).
Every test runs on every device present."""
import math

import pytest
import torch
from torch import nn

import fusedamp
from model_helpers import _assert_same, _mlp, _snapshot, _trained


# ---- nothing changes when a call fails ------------------------------------------------------
@pytest.mark.parametrize("case", ["complex", "init_scale", "growth_interval", "max_grad_norm",
                                  "max_grad_norm_nan", "dtype"])
def test_initialize_is_atomic(device, case):
    model = _mlp(device)
    kwargs, dtype = {}, torch.float16
    if case == "complex":
        model.register_parameter("c", nn.Parameter(torch.zeros(2, dtype=torch.complex64,
                                                               device=device)))
    elif case == "init_scale":
        kwargs = dict(init_scale=0.0)
    elif case == "growth_interval":
        kwargs = dict(growth_interval=0)
    elif case == "max_grad_norm":
        kwargs = dict(max_grad_norm=-1.0)
    elif case == "max_grad_norm_nan":
        kwargs = dict(max_grad_norm=math.nan)
    else:
        dtype = torch.float64
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = _snapshot(model, opt)
    with pytest.raises((ValueError, RuntimeError)):
        fusedamp.initialize(model, opt, dtype, loss_scaling=True, **kwargs)
    _assert_same(before, _snapshot(model, opt))
    if case != "complex":  # a retry with good arguments works: nothing was half done
        fusedamp.initialize(model, opt, torch.float16)


@pytest.mark.parametrize("corrupt", ["late_bad_shape", "lr_string", "betas_out_of_range",
                                     "negative_eps"])
def test_optimizer_load_state_dict_is_atomic(device, corrupt):
    model, opt, _ = _trained(device)
    sd = opt.state_dict()
    if corrupt == "late_bad_shape":
        last = max(sd["state"])
        sd["state"][last]["exp_avg"] = torch.zeros(7, device=device)
    elif corrupt == "lr_string":
        sd["param_groups"][0]["lr"] = "abc"
    elif corrupt == "betas_out_of_range":
        sd["param_groups"][0]["betas"] = (0.9, 1.5)
    else:
        sd["param_groups"][0]["eps"] = -1.0
    # The state of the earlier parameters is changed in the checkpoint too: it must not land.
    first = min(sd["state"])
    sd["state"][first] = {k: v + 1 for k, v in sd["state"][first].items()}
    before = _snapshot(model, opt)
    with pytest.raises((ValueError, RuntimeError, TypeError)):
        opt.load_state_dict(sd)
    _assert_same(before, _snapshot(model, opt))


def test_scaler_load_state_dict_is_atomic(device):
    _, _, scaler = _trained(device)
    sd = scaler.state_dict()
    before = scaler.state_dict()
    for bad in (dict(sd, scale=math.nan, growth_factor=3.0, backoff_factor=0.25),
                dict(sd, growth_interval=0, growth_factor=4.0),
                dict(sd, _growth_tracker=-1, backoff_factor=0.1)):
        with pytest.raises(RuntimeError):
            scaler.load_state_dict(bad)
        assert scaler.state_dict() == before
