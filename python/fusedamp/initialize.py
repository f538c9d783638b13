"""fusedamp.initialize: wrap an existing model and optimizer for master-weight training."""
from __future__ import annotations

import torch

from .convert import convert_module
from .grad_scaler import GradScaler
from .optim import SGD, Adam, AdamW, FusedOptimizer

_HYPER = {
    torch.optim.AdamW: (AdamW, ("lr", "betas", "eps", "weight_decay", "maximize")),
    torch.optim.Adam: (Adam, ("lr", "betas", "eps", "weight_decay", "maximize")),
    torch.optim.SGD: (SGD, ("lr", "momentum", "dampening", "weight_decay", "nesterov",
                            "maximize")),
}


def _fused_class(optimizer):
    # AdamW is a subclass of Adam in recent torch: match the most derived first.
    for cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
        if type(optimizer) is cls:
            return cls
    raise TypeError(f"fusedamp.initialize: unsupported optimizer {type(optimizer).__name__} "
                    "(supported: torch.optim.AdamW, Adam, SGD)")


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               dtype: torch.dtype = torch.float16, *, loss_scaling=None, max_grad_norm=None,
               init_scale=2.0 ** 16, growth_interval=2000, hysteresis=1, min_scale=None,
               max_scale=None, skip_nonfinite=True):
    """Prepares ``model`` and ``optimizer`` for mixed-precision training with FP32 master
    weights. Returns ``(model, optimizer, scaler)``:

    - the model, cast in place to ``dtype`` except normalisation layers (FP32), with floating
      inputs cast at its entry and FP32 outputs;
    - a fusedamp optimizer of the same kind (AdamW/Adam/SGD) over the same param groups with
      the same hyper-parameters (LR schedulers must be created on it, or re-pointed to it);
    - a fusedamp.GradScaler on the model's device, enabled for FP16 and, unless
      ``loss_scaling=True``, disabled for BF16 (whose range needs no scaling). Non-finite
      gradients skip the step either way (``skip_nonfinite``).
    """
    cls = _fused_class(optimizer)
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError("fusedamp.initialize: call it before the first optimizer step "
                         "(the optimizer already holds state)")
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    model_params = {id(p) for p in model.parameters()}
    if not params <= model_params:
        raise ValueError("fusedamp.initialize: the optimizer holds tensors that are not "
                         "parameters of the model")
    convert_module(model, dtype)
    fused_cls, names = _HYPER[cls]
    groups = []
    for g in optimizer.param_groups:
        group = {k: g[k] for k in names if k in g}
        group["params"] = list(g["params"])
        group["max_grad_norm"] = max_grad_norm
        groups.append(group)
    fused = fused_cls(groups, skip_nonfinite=skip_nonfinite)
    device = next(model.parameters()).device
    enabled = (dtype == torch.float16) if loss_scaling is None else bool(loss_scaling)
    scaler = GradScaler(device=device, init_scale=init_scale, growth_interval=growth_interval,
                        enabled=enabled, hysteresis=hysteresis, min_scale=min_scale,
                        max_scale=max_scale)
    return model, fused, scaler


__all__ = ["initialize", "FusedOptimizer"]
