"""fusedamp.initialize: wrap an existing model and optimizer for master-weight training."""
from __future__ import annotations

import inspect

import torch

from ._library import _C
from .convert import check_convertible, convert_module
from .grad_scaler import GradScaler
from .optim import SGD, Adam, AdamW, FusedOptimizer
from .optim_options import check_group

_FUSED = {torch.optim.AdamW: AdamW, torch.optim.Adam: Adam, torch.optim.SGD: SGD}
# torch.optim's AdamW records decoupled_weight_decay=True in its defaults; fusedamp's AdamW
# has it by construction (it takes no such argument).
_IMPLIED = {AdamW: {"decoupled_weight_decay": True}}


def _fused_class(optimizer):
    # AdamW is a subclass of Adam in recent torch: match the exact class.
    fused = _FUSED.get(type(optimizer))
    if fused is None:
        raise TypeError(f"fusedamp.initialize: unsupported optimizer {type(optimizer).__name__} "
                        "(supported: torch.optim.AdamW, Adam, SGD)")
    return fused


def _fused_arguments(optimizer, fused_cls, engine_args):
    """The fused optimizer's constructor arguments: every default of `optimizer` (so groups
    added later inherit the user's), or an error naming one fusedamp's class would not honour."""
    accepted = inspect.signature(fused_cls.__init__).parameters
    kwargs = {}
    for name, value in optimizer.defaults.items():
        if name in accepted:
            kwargs[name] = value
        elif _IMPLIED.get(fused_cls, {}).get(name, object()) != value:
            raise ValueError(f"fusedamp.initialize: {type(optimizer).__name__}({name}={value!r}) "
                             f"has no equivalent in {fused_cls.__module__}.{fused_cls.__name__}")
    kwargs.update(engine_args)
    return kwargs


def _check_no_sparse_tables(model, optimizer, fused_cls):
    """Only fusedamp.optim.SGD steps tables with sparse gradients beside dense parameters; the
    others refuse them at their first step. Said here, before anything is touched, with the
    way to give the tables their own optimizer."""
    if fused_cls is SGD:
        return
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, module in model.named_modules():
        if (isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse
                and id(module.weight) in held):
            raise ValueError(
                f"fusedamp.initialize: {type(optimizer).__name__} takes no sparse gradients, "
                f"and the optimizer holds the weight of {name or 'the model'} "
                f"({type(module).__name__} with sparse=True). Pass initialize an optimizer "
                "over the other parameters, then step the tables with fusedamp.optim."
                "SparseAdam, Adagrad or RowWiseAdagrad (created after initialize, master_weights"
                "=True for FP16/BF16 tables) under the same scaler: scaler.step(optimizer); "
                "scaler.step(table_optimizer); scaler.update(); or use torch.optim.SGD")


def _has_lr_scheduler(optimizer):
    # torch's LR schedulers wrap optimizer.step when they are created (to warn on a wrong
    # call order); a scheduler made before initialize would keep driving the old optimizer.
    return getattr(getattr(optimizer, "step", None), "_wrapped_by_lr_sched", False)


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               dtype: torch.dtype = torch.float16, *, loss_scaling=None, max_grad_norm=None,
               init_scale=2.0 ** 16, growth_interval=2000, hysteresis=1, min_scale=None,
               max_scale=None, skip_nonfinite=True, master_weights=True,
               state_dtype=torch.float32, rounding_seed=0, policy="torch", amax_target=None,
               keep_fp32=()):
    """Prepares ``model`` and ``optimizer`` for mixed-precision training with FP32 master
    weights. Returns ``(model, optimizer, scaler)``:

    - the model, cast in place to ``dtype`` except normalisation layers and the modules named
      by ``keep_fp32`` or transformers' ``_keep_in_fp32_modules`` (FP32), its forward run
      under ``torch.autocast`` (what autocast keeps in FP32, e.g. a loss inside the model,
      runs in FP32), floating inputs cast at its entry and FP32 outputs
      (``fusedamp.restore(model)`` undoes it; see fusedamp.convert_module);
    - a fusedamp optimizer of the same kind (AdamW/Adam/SGD) over the same param groups with
      every hyper-parameter of the given one (or a ValueError naming one it cannot honour);
      LR schedulers must be created on it (one created before is an error);
    - a fusedamp.GradScaler on the model's device, enabled for FP16 and, unless
      ``loss_scaling=True``, disabled for BF16 (whose range needs no scaling), moving its scale
      by ``policy`` ("torch" or "amax", see fusedamp.GradScaler). Non-finite gradients skip
      the step either way (``skip_nonfinite``).
    ``master_weights`` (True, False, "split", "split8", "kahan", "stochastic"), ``state_dtype``
    and ``rounding_seed`` are fusedamp.optim's (see fusedamp.optim); "split", "split8" and
    "stochastic"
    keep BF16 weights and need ``dtype=torch.bfloat16``.
    Everything is checked before the model or the optimizer is touched.
    """
    fused_cls = _fused_class(optimizer)
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError("fusedamp.initialize: call it before the first optimizer step "
                         "(the optimizer already holds state)")
    if _has_lr_scheduler(optimizer):
        raise ValueError("fusedamp.initialize: an LR scheduler was created on this optimizer; "
                         "create it on the optimizer initialize returns")
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not params <= {id(p) for p in model.parameters()}:
        raise ValueError("fusedamp.initialize: the optimizer holds tensors that are not "
                         "parameters of the model")
    _check_no_sparse_tables(model, optimizer, fused_cls)
    check_convertible(model, dtype, keep_fp32)
    if not _C.master_weights_fit(master_weights, dtype):
        raise ValueError(f"fusedamp.initialize: master_weights={master_weights!r} keeps "
                         f"bfloat16 weights; dtype is {dtype} (use master_weights=True or "
                         "'kahan')")
    engine_args = dict(max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite,
                       master_weights=master_weights, state_dtype=state_dtype,
                       rounding_seed=rounding_seed)
    kwargs = _fused_arguments(optimizer, fused_cls, engine_args)
    groups = [dict(g, **engine_args) for g in optimizer.param_groups]
    for group in groups:
        check_group(group)
    fused_cls._engine_cls.validate(groups)
    device = next(model.parameters()).device
    enabled = (dtype == torch.float16) if loss_scaling is None else bool(loss_scaling)
    scaler = GradScaler(device=device, init_scale=init_scale, growth_interval=growth_interval,
                        enabled=enabled, hysteresis=hysteresis, min_scale=min_scale,
                        max_scale=max_scale, policy=policy, amax_target=amax_target)
    # Everything is checked: commit.
    convert_module(model, dtype, keep_fp32=keep_fp32)
    fused = fused_cls([{k: v for k, v in g.items()} for g in groups], **kwargs)
    return model, fused, scaler


__all__ = ["initialize", "FusedOptimizer"]
