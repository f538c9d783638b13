"""Master weights that never lie: initialize keeps the user's algorithm, norm layers are found
by what they are and convert_module gives each layer the dtype it computes in, nothing changes
when a call fails, and there is a way back to a plain FP32 model. Every test runs on every
device present."""
import copy
import math

import pytest
import torch
from torch import nn

import fusedamp


def _mlp(device, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3)).to(device)


def _snapshot(model, optimizer=None):
    """Every parameter, buffer and hyper-parameter a failed call must leave as it was."""
    out = {"params": {n: (p.dtype, p.detach().clone()) for n, p in model.named_parameters()},
           "buffers": {n: b.clone() for n, b in model.named_buffers()},
           "hooks": (len(model._forward_pre_hooks), len(model._forward_hooks)),
           "converted": getattr(model, "_fusedamp_dtype", None)}
    if optimizer is not None:
        out["groups"] = [{k: v for k, v in g.items() if k != "params"}
                         for g in optimizer.param_groups]
        out["state"] = {id(p): {k: v.clone() for k, v in s.items()}
                        for p, s in optimizer.state.items()}
    return out


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if key in ("params",):
            for name in a[key]:
                assert a[key][name][0] == b[key][name][0], name
                assert torch.equal(a[key][name][1], b[key][name][1]), name
        elif key in ("buffers",):
            for name in a[key]:
                assert torch.equal(a[key][name], b[key][name]), name
        elif key == "state":
            assert a[key].keys() == b[key].keys()
            for pid in a[key]:
                for name, t in a[key][pid].items():
                    assert torch.equal(t, b[key][pid][name]), name
        else:
            assert a[key] == b[key], key


# ---- initialize keeps the user's algorithm ---------------------------------------------------
@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.Adam(ps, lr=2e-3, betas=(0.8, 0.95), weight_decay=0.1,
                                decoupled_weight_decay=True),
    lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05, maximize=True),
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-3, dtype=torch.float64)),
], ids=["Adam-decoupled", "AdamW-maximize", "SGD-nesterov", "Adam-tensor-lr"])
def test_initialize_trains_the_users_algorithm(device, make_opt):
    _assert_initialize_trains(device, make_opt)


def _assert_initialize_trains(device, make_opt):
    """The FP32 masters follow torch's FP32 run of the same optimizer on the same gradients
    (FP16 values, which FP32 holds exactly, fed to both as .grad) within FP32 rounding."""
    model = _mlp(device)
    reference = copy.deepcopy(model).float()
    ref_opt = make_opt(list(reference.parameters()))
    model, opt, _ = fusedamp.initialize(model, make_opt(list(model.parameters())),
                                        torch.float16, skip_nonfinite=False)
    assert type(opt).__name__ == type(ref_opt).__name__
    with torch.no_grad():  # both start from the FP16 weights (the masters' starting point)
        for p, r in zip(model.parameters(), reference.parameters()):
            r.copy_(p.float())
    torch.manual_seed(1)
    for _ in range(20):
        for p, r in zip(model.parameters(), reference.parameters()):
            g = torch.randn(p.shape, device=device).to(p.dtype)
            p.grad, r.grad = g, g.float()
        opt.step()
        ref_opt.step()
    weights = fusedamp.master_weights(model, opt)
    for (name, r) in reference.named_parameters():
        torch.testing.assert_close(weights[name], r.detach(), rtol=2e-6, atol=2e-6)


def _optim_db_cases():
    from test_torch_optim_parity import _KINDS, _configs, _ident
    return [pytest.param(kind, cfg.kwargs, id=f"{kind}-{_ident(cfg.desc)}")
            for kind in _KINDS for cfg in _configs(kind)
            if not cfg.kwargs.get("differentiable", False)]  # refused on purpose (README)


@pytest.mark.filterwarnings("ignore:fusedamp.*has no effect")
@pytest.mark.parametrize("kind,kwargs", _optim_db_cases())
def test_initialize_keeps_every_optim_db_configuration(device, kind, kwargs):
    """Every configuration torch's optim_db lists for Adam, AdamW and SGD (differentiable aside),
    given to initialize as a torch optimizer: the FP32 masters follow torch's FP32 run on the
    same gradients within FP32 rounding over 20 steps."""
    torch_cls = getattr(torch.optim, kind)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("foreach", "fused", "capturable")}
    _assert_initialize_trains(device, lambda ps: torch_cls(ps, **kwargs))


def test_initialize_keeps_defaults_for_added_groups_and_refuses_an_early_scheduler(device):
    model = _mlp(device)
    extra = nn.Parameter(torch.randn(4, device=device))
    model.register_parameter("extra", extra)
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if n != "extra"],
                            lr=5e-4, weight_decay=0.2, betas=(0.85, 0.98))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    before = _snapshot(model)
    with pytest.raises(ValueError, match="LR scheduler"):
        fusedamp.initialize(model, opt, torch.float16)
    _assert_same(before, _snapshot(model))
    del sched
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if n != "extra"],
                            lr=5e-4, weight_decay=0.2, betas=(0.85, 0.98))
    model, fused, _ = fusedamp.initialize(model, opt, torch.float16, max_grad_norm=2.0)
    fused.add_param_group({"params": [extra]})
    added = fused.param_groups[-1]
    assert (added["lr"], added["weight_decay"], added["betas"], added["max_grad_norm"]) == (
        5e-4, 0.2, (0.85, 0.98), 2.0)


def test_initialize_refuses_what_it_cannot_honour(device):
    """differentiable=True asks for a step autograd can differentiate; the fused step cannot
    be: a clear error naming it, and the model untouched."""
    model = _mlp(device)
    opt = torch.optim.Adam(model.parameters(), differentiable=True)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match="differentiable"):
        fusedamp.initialize(model, opt, torch.float16)
    _assert_same(before, _snapshot(model, opt))


# ---- norm layers by what they are -----------------------------------------------------------
class PreNorm(nn.Module):
    """ViT-style wrapper: a norm and a block. Not a norm layer itself."""

    def __init__(self, dim, fn):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.norm(x))


class ThirdPartyRMSNorm(nn.Module):
    """An RMSNorm that does not derive from torch's (as transformers' LlamaRMSNorm)."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (self.weight * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_norm_layers_by_type_not_by_container_name(device):
    model = nn.Sequential(PreNorm(16, nn.Sequential(nn.Linear(16, 64), nn.GELU(),
                                                    nn.Linear(64, 16))),
                          ThirdPartyRMSNorm(16), nn.Linear(16, 4)).to(device)
    fusedamp.convert_module(model, torch.bfloat16)
    fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert fp32 == {"0.norm.weight", "0.norm.bias", "1.weight"}
    assert model(torch.randn(2, 16, device=device)).dtype == torch.float32
    transformers = pytest.importorskip("transformers")
    llama_norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(8)
    assert fusedamp.is_norm_layer(llama_norm)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layer_norm_weight_gradients_keep_fp32_precision(device, dtype):
    """A LayerNorm of a converted model computes in FP32 from its 16-bit input, so the FP32
    weight's gradient is as accurate as in an FP32 model. (torch 2.11's CPU LayerNorm also takes
    16-bit input with FP32 weights directly, as autocast uses it, but its weight gradient is
    then off by about one 16-bit rounding: measured 2.7e-4 relative for FP16 and 4e-3 for BF16
    against the FP64 reference, where this path stays near 1e-7.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)).to(device)
    nn.init.normal_(model[1].weight)
    fusedamp.convert_module(model, dtype)
    x = torch.randn(8, 64, device=device)
    upstream = torch.randn(8, 64, device=device)
    model(x).mul(upstream).sum().backward()
    # FP64 reference from the same 16-bit activation that reached the norm layer.
    hidden = model[0](x.to(dtype)).detach().double().requires_grad_()
    reference = nn.LayerNorm(64).to(device).double()
    reference.load_state_dict({k: v.double() for k, v in model[1].state_dict().items()})
    reference(hidden).mul(upstream.to(dtype).double()).sum().backward()
    got, want = model[1].weight.grad.double(), reference.weight.grad
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_convert_module_dtypes_at_each_layer(device, dtype):
    """Norm parameters stay FP32; batch norm runs on the low-precision activations natively,
    the other norms get FP32 input; the model takes FP32 input and returns FP32."""
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                            torch.nn.Linear(4 * 4 * 4, 8), torch.nn.LayerNorm(8),
                            torch.nn.Linear(8, 2)).to(device)
    fusedamp.convert_module(m, dtype)
    seen = {}
    for name, mod in m.named_children():
        mod.register_forward_hook(
            lambda mod, inp, out, name=name: seen.__setitem__(name, (inp[0].dtype, out.dtype)))
    out = m(torch.randn(2, 3, 6, 6, device=device))
    assert out.dtype == torch.float32
    assert m[1].weight.dtype == m[1].running_mean.dtype == m[4].weight.dtype == torch.float32
    assert m[0].weight.dtype == m[3].weight.dtype == m[5].weight.dtype == dtype
    assert seen["1"] == (dtype, dtype)            # batch norm: native mixed precision
    assert seen["4"][0] == torch.float32          # layer norm computes in FP32 ...
    assert seen["5"][0] == dtype                  # ... and hands the model's dtype on
    out.sum().backward()
    assert m[0].weight.grad.dtype == dtype and m[1].weight.grad.dtype == torch.float32


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


def _trained(device, steps=3):
    model = _mlp(device)
    model, opt, scaler = fusedamp.initialize(model, torch.optim.AdamW(model.parameters()),
                                             torch.float16, loss_scaling=True)
    scaler = fusedamp.GradScaler(device, init_scale=256.0)
    for _ in range(steps):
        scaler.scale(model(torch.randn(4, 6, device=device)).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return model, opt, scaler


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


# ---- a way back ------------------------------------------------------------------------------
def test_restore_gives_a_plain_module_and_the_fp32_masters(device):
    model, opt, _ = _trained(device)
    weights = fusedamp.master_weights(model, opt)
    sd = fusedamp.fp32_state_dict(model, opt)
    for name, p in model.named_parameters():
        assert weights[name].dtype == torch.float32
        assert torch.equal(sd[name], weights[name])
        master = opt.state[p].get("master_param")
        if master is not None:
            assert torch.equal(weights[name], master)  # the masters' bits, not the rounding
    fusedamp.restore(model, weights=weights)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), weights[name])
    x = torch.randn(2, 6, device=device)
    assert model(x).dtype == torch.float32
    model.to(torch.bfloat16)  # once crashed: the casting hooks stayed behind
    assert model(x.bfloat16()).dtype == torch.bfloat16
    fusedamp.convert_module(model, torch.float16)  # and can be converted again


def test_tensor_lr_of_any_float_dtype_follows_its_scheduler(device):
    """A float64 tensor lr updated in place by a scheduler drives the fused step."""
    model = _mlp(device)
    reference = copy.deepcopy(model)
    lr = torch.tensor(0.1, dtype=torch.float64)
    opt = fusedamp.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=torch.tensor(0.1, dtype=torch.float64))
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref_opt)]
    for _ in range(4):
        for p, r in zip(model.parameters(), reference.parameters()):
            p.grad = torch.ones_like(p)
            r.grad = torch.ones_like(r)
        opt.step()
        ref_opt.step()
        for s in scheds:
            s.step()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-6)
    assert opt.param_groups[0]["lr"] is lr or float(opt.param_groups[0]["lr"]) == 0.1 / 16


# ---- the model's weights are the truth -------------------------------------------------------
def _fp16_model_and_grads(device, seed=0, steps=6):
    """An FP16 model with its grads for `steps` steps (fixed, so two runs see the same)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(device).half()
    grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(steps)]
    return model, grads


def _step_with(opt, model, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    opt.step()


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_loaded_snapshot_reaches_the_masters_bit_exactly(device, kind):
    """load_state_dict(snapshot) mid-training, then one step: the weights equal one step from
    the snapshot (the same optimizer state, masters set to the snapshot by hand)."""
    make = {"AdamW": lambda ps: fusedamp.optim.AdamW(ps, lr=0.05),
            "SGD": lambda ps: fusedamp.optim.SGD(ps, lr=0.05, momentum=0.9)}[kind]
    model, grads = _fp16_model_and_grads(device)
    opt = make(model.parameters())
    _step_with(opt, model, grads[0])
    snapshot = copy.deepcopy(model.state_dict())
    for g in grads[1:5]:
        _step_with(opt, model, g)
    reference_model = copy.deepcopy(model)
    reference_opt = make(reference_model.parameters())
    reference_opt.load_state_dict(opt.state_dict())
    for name, p in reference_model.named_parameters():  # a step from the snapshot starts here
        p.data.copy_(snapshot[name])
        reference_opt.state[p]["master_param"].copy_(snapshot[name].float())
    model.load_state_dict(snapshot)
    for name, p in model.named_parameters():  # the case the test is about: every weight edited
        rounded = opt.state[p]["master_param"].half()
        assert (rounded != p.detach()).float().mean() > 0.99, name
    _step_with(opt, model, grads[5])
    _step_with(reference_opt, reference_model, grads[5])
    for p, r in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(p.detach(), r.detach())
        assert torch.equal(opt.state[p]["master_param"], reference_opt.state[r]["master_param"])


def test_clamp_and_zero_edits_reach_the_masters(device):
    """WGAN-style clipping and a pruning mask applied to the FP16 weights between steps bound
    the masters (they once ran away from the clamp: |w| reached 1.53 with a 0.01 clamp)."""
    model, grads = _fp16_model_and_grads(device, steps=20)
    opt = fusedamp.optim.AdamW(model.parameters(), lr=0.05)
    first = next(model.parameters())
    pruned = torch.rand(first.shape, device=device) < 0.5
    lr, clip = 0.05, 0.01
    for g in grads:
        _step_with(opt, model, g)
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-clip, clip)
            first.masked_fill_(pruned, 0.0)
    for p in model.parameters():
        master = opt.state[p]["master_param"]
        # One AdamW step moves a weight by at most about lr (plus the decay).
        assert master.abs().max().item() <= clip + 1.01 * lr, master.abs().max().item()
    assert opt.state[first]["master_param"][pruned].abs().max().item() <= 1.01 * lr


def test_edit_adoption_off_keeps_the_masters(device):
    """adopt_param_edits=False: the step ignores the model's weights (the old behaviour, for
    those who write the weights only through the optimizer and want the 2 B/param back): zeroing
    the weights between steps changes nothing, bit for bit, against a run without the edit."""
    runs = []
    for edit in (True, False):
        model, grads = _fp16_model_and_grads(device, steps=3)
        opt = fusedamp.optim.AdamW(model.parameters(), lr=0.05, adopt_param_edits=False)
        _step_with(opt, model, grads[0])
        if edit:
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
        _step_with(opt, model, grads[1])
        runs.append([opt.state[p]["master_param"].clone() for p in model.parameters()] +
                    [p.detach().clone() for p in model.parameters()])
    for edited, untouched in zip(*runs):
        assert torch.equal(edited, untouched)


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("write_back", [True, False])
def test_scaled_step_leaves_unscaled_clipped_grads(device, clip, write_back):
    """After scaler.step(opt), .grad holds what the update used (grad / scale, clipped), as
    with torch's fused optimizers — or, with write_back_grads=False, the scaled grads."""
    model, grads = _fp16_model_and_grads(device, steps=1)
    opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=clip,
                               write_back_grads=write_back)
    scaler = fusedamp.GradScaler(device, init_scale=256.0)
    scaler.scale(torch.ones((), device=device))
    scaled = [g * 256 for g in grads[0]]
    for p, g in zip(model.parameters(), scaled):
        p.grad = g.clone()
    scaler.step(opt)
    unscaled = [g.float() / 256 for g in scaled]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in unscaled]))
    coef = min(1.0, clip / (norm.item() + 1e-6)) if clip else 1.0
    for p, g_scaled, g in zip(model.parameters(), scaled, unscaled):
        if write_back:
            torch.testing.assert_close(p.grad, (g * coef).half(), rtol=1e-3, atol=1e-6)
        else:
            assert torch.equal(p.grad, g_scaled)


def _norm_net(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
        torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.GroupNorm(4, 16),
        torch.nn.Linear(16, 3)).to(device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_initialized_model_cast_again_runs_as_that_dtype(device, dtype):
    """Evaluation and export after training: model.float(), .to(bf16) and .half() of an
    initialized model run (the casts follow the parameters' dtypes), equal to a plain model of
    the same weights, and the model runs as trained again once cast back."""
    model = _norm_net(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, scaler = fusedamp.initialize(model, opt, dtype)
    x = torch.randn(8, 6, device=device)
    scaler.scale(model(x).square().mean()).backward()
    scaler.step(opt)
    scaler.update()
    model.eval()
    for cast in (torch.float32, torch.bfloat16, torch.float16):
        model.to(cast)
        plain = _norm_net(device).to(cast).eval()
        plain.load_state_dict(model.state_dict())
        out = model(x)
        assert out.dtype == cast
        assert torch.equal(out, plain(x.to(cast)))
    exported = torch.export.export(model.float(), (x,))
    assert torch.equal(exported.module()(x), model(x))
    model.to(dtype)  # as trained: its dtype inside, FP32 out, norm layers FP32 again
    for m in model.modules():
        if isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.BatchNorm1d)):
            m.float()
    assert model(x).dtype == torch.float32
