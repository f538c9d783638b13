"""Converting an existing ``nn.Module`` to FP16/BF16 for master-weight training.

Every module is cast to the low-precision dtype except normalisation layers, which keep FP32
parameters and buffers (running statistics in FP16 drift; their reductions need the range).
Batch norm runs natively on low-precision input with its FP32 weights; the other norm layers
receive FP32 inputs and hand the low-precision dtype on, so the model runs end to end in
FP16/BF16 with FP32 islands where they matter. The model's floating inputs are cast
at its entry and its floating outputs are returned as FP32, so a loss computed from them is
an FP32 scalar, as a scaler expects.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

#: Module types that stay FP32. Any module whose class name ends in "Norm" (RMSNorm variants of
#: third-party models such as LlamaRMSNorm or T5LayerNorm) is treated the same way.
NORM_TYPES = tuple(
    t for t in (
        nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
        nn.modules.instancenorm._InstanceNorm, getattr(nn, "RMSNorm", None), nn.LocalResponseNorm,
    ) if t is not None
)


def is_norm_layer(module: nn.Module) -> bool:
    name = type(module).__name__
    return isinstance(module, NORM_TYPES) or name.endswith("Norm") or name.endswith("Norm2d")


def _cast_floating(obj, dtype):
    """Casts every floating-point tensor in a (nested) tuple/list/dict to dtype."""
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_cast_floating(o, dtype) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floating(o, dtype) for o in obj)
    if isinstance(obj, OrderedDict) or isinstance(obj, dict):
        # transformers' ModelOutput is an OrderedDict subclass whose fields are also
        # attributes: update in place to keep both views consistent.
        for k in list(obj.keys()):
            obj[k] = _cast_floating(obj[k], dtype)
        return obj
    return obj


class _CastHooks:
    """Forward hooks that cast a module's floating inputs and outputs: a norm layer's (FP32 in,
    the model's dtype out) and the root module's (the model's dtype in, FP32 out)."""

    def __init__(self, inputs_to, outputs_to):
        self.inputs_to, self.outputs_to = inputs_to, outputs_to

    def pre(self, module, args, kwargs):
        return _cast_floating(args, self.inputs_to), _cast_floating(kwargs, self.inputs_to)

    def post(self, module, args, kwargs, output):
        return _cast_floating(output, self.outputs_to)


def convert_module(model: nn.Module, dtype: torch.dtype = torch.float16,
                   cast_inputs: bool = True, fp32_outputs: bool = True) -> nn.Module:
    """Casts ``model`` in place to ``dtype``, keeping normalisation layers FP32; returns it."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"fusedamp: dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if getattr(model, "_fusedamp_dtype", None) is not None:
        raise RuntimeError("fusedamp: this model was already converted by fusedamp")
    norm_layers = [m for m in model.modules() if is_norm_layer(m)]
    norms = {sub for m in norm_layers for sub in m.modules()}
    for module in model.modules():
        target = torch.float32 if module in norms else dtype
        for name, p in module.named_parameters(recurse=False):
            if p.is_floating_point() and p.dtype != target:
                p.data = p.data.to(target)
                if p.grad is not None:
                    p.grad = None
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point() and b.dtype != target:
                module._buffers[name] = b.to(target)
    for module in norm_layers:
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            # Native batch norm takes FP16/BF16 input with FP32 weights and statistics (CPU and
            # cuDNN) and returns the input's dtype: no cast, so no FP32 copy of the activation
            # is saved for backward.
            continue
        hooks = _CastHooks(torch.float32, dtype)
        module.register_forward_pre_hook(hooks.pre, with_kwargs=True)
        module.register_forward_hook(hooks.post, with_kwargs=True)
    boundary = _CastHooks(dtype, torch.float32)
    if cast_inputs:
        model.register_forward_pre_hook(boundary.pre, with_kwargs=True)
    if fp32_outputs:
        model.register_forward_hook(boundary.post, with_kwargs=True)
    model._fusedamp_dtype = dtype
    return model
