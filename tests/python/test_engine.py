"""The Python package: GradScaler, fusedamp.optim, step accounting, checkpoints."""
import pytest
import torch

import fusedamp
from op_helpers import _grads, _model_params, max_abs_diff


@pytest.mark.parametrize("cls", ["AdamW", "Adam", "SGD"])
def test_optimizer_parity_with_torch_groups_and_scheduler(device, cls, record_diff):
    ours = _model_params(device, seed=3)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(momentum=0.9, nesterov=True, weight_decay=1e-3) if cls == "SGD" else dict(
        betas=(0.8, 0.95), weight_decay=0.02)
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.003, "weight_decay": 0.0}]
    opt = getattr(fusedamp.optim, cls)(groups(ours), lr=0.01, **kw)
    ref_opt = getattr(torch.optim, cls)(groups(ref), lr=0.01, foreach=False, **kw)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 0.005], total_steps=40)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=[0.02, 0.005], total_steps=40)
    for step in range(40):
        for p, r, g in zip(ours, ref, _grads(device, torch.float32, step)):
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
    diff = max_abs_diff([p.detach() for p in ours], [r.detach() for r in ref])
    record_diff(f"fusedamp.optim.{cls} fp32 (groups + OneCycleLR) vs torch.optim", diff)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6)


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
    # Not an error: scale() multiplies any tensor of outputs, with torch.amp's type promotion.
    ours, theirs = fusedamp.GradScaler(device), torch.amp.GradScaler(device)
    for t in (torch.ones(3, device=device, dtype=torch.float16), torch.ones((), device=device,
                                                                          dtype=torch.float16)):
        if theirs.is_enabled():
            a, b = ours.scale(t), theirs.scale(t)
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_diagnostics_grad_norm_history_and_nonfinite_names(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = model.to(device)
    model, opt, scaler = fusedamp.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.float16, max_grad_norm=1.0)
    if not scaler.is_enabled():  # CUDA scaler asked for on a CPU-only machine: use the CPU one
        scaler = fusedamp.GradScaler(device)
    expected_norms, scales = [], []
    for step in range(6):
        x = torch.randn(32, 8, device=device)
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        s = scaler.get_scale()
        grads = [p.grad.float() / s for p in model.parameters()]
        expected_norms.append(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads])).item())
        if step == 4:
            model[2].weight.grad[1, 3] = float("nan")
            assert fusedamp.nonfinite_grads(model) == ["2.weight"]
        else:
            assert fusedamp.nonfinite_grads(model) == []
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    history = opt.grad_norm_history()
    assert len(history) == 6
    for i, (got, want) in enumerate(zip(history, expected_norms)):
        if i != 4:
            assert abs(got - want) <= 1e-3 * want, (i, got, want)
    assert history[4] != history[4]  # the NaN step's norm is NaN: visible in the history
    assert scaler.scale_history() == scales
    assert opt.skipped_steps.item() == 1


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
