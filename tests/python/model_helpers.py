"""What the tests of fusedamp.initialize, convert_module and restore share: a small FP32 model
with a norm layer, the same model initialized to FP16 and trained a few scaled steps, and a
snapshot of everything a failed call must leave as it was (parameters, buffers, hooks,
optimizer groups and state), with its comparison."""
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
