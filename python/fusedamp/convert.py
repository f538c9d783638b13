"""Converting an existing ``nn.Module`` to FP16/BF16 for master-weight training.

Every parameter is cast to the low-precision dtype except those of normalisation layers and of
the modules named by ``keep_fp32`` (and transformers' ``_keep_in_fp32_modules`` lists), which
keep FP32: running statistics in FP16 drift, reductions need the range, and a model's authors
know which of its layers overflow. Buffers keep their dtype (rotary frequencies, position
tables, running statistics): the model's own code casts them where it means to, as it does
when transformers loads the model in FP16.

The converted model's forward runs under ``torch.autocast`` with its dtype, so every operation
that autocast keeps in FP32 on the device (losses, and on CUDA softmax, log_softmax, norms,
exp/log/pow, sums, ...) runs in FP32 wherever the model calls it, with autocast's numbers: a
loss computed inside ``forward`` is an FP32 loss of the low-precision logits. The list is
torch's own, per device (``aten/src/ATen/autocast_mode.cpp``), not a copy. Modules kept FP32
run with autocast off, on FP32 inputs. Batch norm runs natively on low-precision input with its
FP32 weights; the other norm layers receive FP32 inputs and hand the low-precision dtype on.
The model's floating inputs are cast at its entry and its floating outputs are returned as
FP32. The casts follow the dtypes the parameters have at each forward: a converted model cast
again (``model.float()``, ``.to(torch.bfloat16)``) runs as a plain model of that dtype.
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext

import torch
from torch import nn

#: Module types that stay FP32: torch's normalisation layers (and their subclasses, e.g. timm's
#: LayerNorm2d). Third-party norm layers that do not derive from them are recognised by what they
#: are (see is_norm_layer), never by a name on a container.
NORM_TYPES = tuple(
    t for t in (
        nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
        nn.modules.instancenorm._InstanceNorm, getattr(nn, "RMSNorm", None), nn.LocalResponseNorm,
    ) if t is not None
)


def is_norm_layer(module: nn.Module) -> bool:
    """True for torch's norm layers and for modules that are built as one: a leaf module (no
    submodules) whose parameters are an affine weight (and bias) of one 1-D shape, of a class
    named as a norm (transformers' LlamaRMSNorm and T5LayerNorm, apex's FusedLayerNorm, ...).
    A wrapper such as ViT's ``PreNorm(dim, fn)`` holds submodules and is not one."""
    if isinstance(module, NORM_TYPES):
        return True
    if "Norm" not in type(module).__name__ or next(module.children(), None) is not None:
        return False
    params = dict(module.named_parameters(recurse=False))
    return (bool(params) and set(params) <= {"weight", "bias"}
            and len({tuple(p.shape) for p in params.values()}) == 1
            and params["weight" if "weight" in params else "bias"].dim() == 1)


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


class _ModelDtypes:
    """The dtypes the casts follow, read from the model's parameters at each forward (not fixed
    when the model was converted), so that an initialized model cast again — ``model.float()``
    or ``.to(torch.bfloat16)`` for evaluation or export — still runs: while the model's
    low-precision parameters keep the dtype they were converted to and its norm layers'
    are FP32, the model runs as trained (its dtype in, FP32 out, norm layers in FP32); once
    cast to one dtype, it runs as a plain model of that dtype (only its inputs are cast).
    A model without norm layers in its converted dtype cannot be told from the trained one:
    it runs as trained."""

    def __init__(self, model, kept, dtype):
        # Read after the cast: a parameter shared by a converted and a kept module (a tied
        # lm_head kept FP32) has the kept one's FP32 and is no reference for either.
        self.converted = dtype
        self.reference = self._first(model, lambda m, p: m not in kept and p.dtype == dtype)
        self.norm_reference = self._first(model, lambda m, p: m in kept
                                          and p.dtype == torch.float32)

    @staticmethod
    def _first(model, fits):
        return next((p for m in model.modules() for p in m.parameters(recurse=False)
                     if p.is_floating_point() and fits(m, p)), None)

    def compute(self):
        return self.reference.dtype if self.reference is not None else self.converted

    def device_type(self):
        ref = self.reference if self.reference is not None else self.norm_reference
        return ref.device.type if ref is not None else "cpu"

    def as_trained(self):
        """The low-precision parameters have the converted dtype and the norm layers' are FP32."""
        return self.compute() == self.converted and (
            self.norm_reference is None or self.norm_reference.dtype == torch.float32)


class _BoundaryCasts:
    """The model's entry and exit: floating inputs to the model's dtype; floating outputs to
    FP32 while it runs as trained (a loss computed from them is an FP32 scalar)."""

    def __init__(self, dtypes):
        self.dtypes = dtypes

    def pre(self, module, args, kwargs):
        dtype = self.dtypes.compute()
        return _cast_floating(args, dtype), _cast_floating(kwargs, dtype)

    def post(self, module, args, kwargs, output):
        return _cast_floating(output, torch.float32) if self.dtypes.as_trained() else output


class _KeptCasts:
    """A module kept FP32 (a norm layer, or one named by keep_fp32): inputs to the dtype of its
    own parameters (FP32 as trained; a model cast to one dtype again runs in that dtype); a norm
    layer's outputs to the model's dtype."""

    def __init__(self, dtypes, norm):
        self.dtypes = dtypes
        self.own = next((t for t in list(norm.parameters(recurse=False))
                         + list(norm.buffers(recurse=False)) if t.is_floating_point()), None)

    def pre(self, module, args, kwargs):
        if self.own is not None:
            dtype = self.own.dtype
        else:  # no parameters of its own: FP32 as trained, else the model's dtype
            dtype = torch.float32 if self.dtypes.as_trained() else self.dtypes.compute()
        return _cast_floating(args, dtype), _cast_floating(kwargs, dtype)

    def post(self, module, args, kwargs, output):
        return _cast_floating(output, self.dtypes.compute())


class _ScopedForward:
    """A module's forward run inside a context that its conversion asks for (autocast at the
    root, autocast off in a module kept FP32). It holds the module and the function, not a
    bound method, so ``copy.deepcopy`` and pickling carry it to the copy; ``inspect.signature``
    sees the original's (transformers reads ``forward``'s parameters)."""

    def __init__(self, module, dtypes, kept):
        self.module = module
        self.dtypes = dtypes
        self.kept = kept
        self.own = module.__dict__.get("forward")  # a forward the instance already had

    @property
    def __wrapped__(self):
        return self.own if self.own is not None else type(self.module).forward.__get__(self.module)

    @property
    def __code__(self):  # torch.export names the traced forward by its code object
        return self.__wrapped__.__code__

    def context(self):
        if not self.dtypes.as_trained():
            return nullcontext()  # cast to one dtype again: a plain model
        if self.kept:
            return torch.autocast(self.dtypes.device_type(), enabled=False)
        # The weights already have the dtype: autocast has no FP32 weight to cast or cache.
        return torch.autocast(self.dtypes.device_type(), dtype=self.dtypes.converted,
                              cache_enabled=False)

    def __call__(self, *args, **kwargs):
        with self.context():
            return self.__wrapped__(*args, **kwargs)


def _matches(name: str, entry: str) -> bool:
    """A module name matches an entry of a keep-FP32 list when the entry is one or more whole
    components of its dotted path ("wo" matches "encoder.block.0.layer.1.DenseReluDense.wo")."""
    return f".{entry}." in f".{name}."


def keep_fp32_names(model: nn.Module, dtype: torch.dtype, keep_fp32=()) -> list[str]:
    """The names of the modules whose parameters stay FP32 beside the norm layers: those
    matching ``keep_fp32`` (names or dotted name parts) or, as transformers' ``from_pretrained``
    keeps them, its ``_keep_in_fp32_modules`` (FP16 only) and ``_keep_in_fp32_modules_strict``
    lists of the model or any submodule."""
    if isinstance(keep_fp32, str):
        keep_fp32 = [keep_fp32]
    entries = set(keep_fp32)
    for m in model.modules():
        if dtype == torch.float16:
            entries |= set(getattr(m, "_keep_in_fp32_modules", None) or ())
        entries |= set(getattr(m, "_keep_in_fp32_modules_strict", None) or ())
    if not entries:
        return []
    names = [n for n, _ in model.named_modules() if n]
    unknown = sorted(e for e in set(keep_fp32) if not any(_matches(n, e) for n in names))
    if unknown:
        raise ValueError(f"fusedamp: keep_fp32 names no module of the model: {unknown}")
    return [n for n in names if any(_matches(n, e) for e in entries)]


def check_convertible(model: nn.Module, dtype: torch.dtype, keep_fp32=()) -> list[str]:
    """Raises (changing nothing) unless convert_module(model, dtype, keep_fp32) can run; returns
    the names of the modules it keeps FP32 beside the norm layers."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"fusedamp: dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if getattr(model, "_fusedamp_dtype", None) is not None:
        raise RuntimeError("fusedamp: this model was already converted by fusedamp "
                           "(fusedamp.restore(model) undoes it)")
    for name, p in model.named_parameters():
        if p.is_complex():
            raise ValueError(f"fusedamp: parameter {name!r} is complex ({p.dtype}); mixed "
                             "precision with master weights supports real floating parameters")
    return keep_fp32_names(model, dtype, keep_fp32)


def _scope_forward(module, dtypes, kept):
    module.forward = _ScopedForward(module, dtypes, kept)


def _unscope_forward(module):
    scoped = module.__dict__.get("forward")
    if isinstance(scoped, _ScopedForward):
        if scoped.own is not None:
            module.forward = scoped.own
        else:
            del module.forward


def convert_module(model: nn.Module, dtype: torch.dtype = torch.float16,
                   cast_inputs: bool = True, fp32_outputs: bool = True,
                   keep_fp32=()) -> nn.Module:
    """Casts ``model``'s parameters in place to ``dtype``, keeping normalisation layers and the
    modules named by ``keep_fp32`` (module names or dotted name parts, e.g. ``"lm_head"``,
    ``["wo"]``) FP32, and runs its forward under ``torch.autocast``; returns it.
    ``fusedamp.restore(model)`` undoes it."""
    kept_names = set(check_convertible(model, dtype, keep_fp32))
    norm_layers = [m for m in model.modules() if is_norm_layer(m)]
    # The outermost of the named modules: what lies inside one runs in its scope already.
    kept = [m for n, m in model.named_modules() if n in kept_names and m not in norm_layers
            and not any(n.startswith(k + ".") for k in kept_names)]
    fp32 = set(norm_layers) | {p for m in kept for p in m.modules()}
    for module in model.modules():
        target = torch.float32 if module in fp32 else dtype
        for name, p in module.named_parameters(recurse=False):
            if p.is_floating_point() and p.dtype != target:
                p.data = p.data.to(target)
                if p.grad is not None:
                    p.grad = None
    handles = []
    dtypes = _ModelDtypes(model, fp32, dtype)
    for module in norm_layers:
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            # Native batch norm takes FP16/BF16 input with FP32 weights and statistics (CPU and
            # cuDNN) and returns the input's dtype: no cast, so no FP32 copy of the activation
            # is saved for backward.
            continue
        hooks = _KeptCasts(dtypes, module)
        handles.append(module.register_forward_pre_hook(hooks.pre, with_kwargs=True))
        handles.append(module.register_forward_hook(hooks.post, with_kwargs=True))
    for module in kept:
        # FP32 in, autocast off inside; its FP32 output goes on as the model's code has it.
        hooks = _KeptCasts(dtypes, module)
        handles.append(module.register_forward_pre_hook(hooks.pre, with_kwargs=True))
        _scope_forward(module, dtypes, kept=True)
    boundary = _BoundaryCasts(dtypes)
    if cast_inputs:
        handles.append(model.register_forward_pre_hook(boundary.pre, with_kwargs=True))
    if fp32_outputs:
        handles.append(model.register_forward_hook(boundary.post, with_kwargs=True))
    if model not in fp32:
        _scope_forward(model, dtypes, kept=False)
    model._fusedamp_dtype = dtype
    model._fusedamp_hooks = handles
    return model


def restore(model: nn.Module, dtype: torch.dtype = torch.float32,
            weights: dict | None = None) -> nn.Module:
    """Undoes convert_module: removes its casting hooks and casts every floating parameter and
    buffer to ``dtype`` (FP32 by default), in place; the model is a plain module again (it
    may be cast, saved or converted again as any other). ``weights``: FP32 values to give the
    parameters first, by parameter name (fusedamp.master_weights(model, optimizer) gives the
    training state with every bit the FP16/BF16 weights lack)."""
    named = dict(model.named_parameters())
    if weights is not None:
        unknown = set(weights) - set(named)
        if unknown:
            raise KeyError(f"fusedamp.restore: not parameters of the model: {sorted(unknown)}")
    for handle in getattr(model, "_fusedamp_hooks", ()):
        handle.remove()
    for module in model.modules():
        _unscope_forward(module)
    model.__dict__.pop("_fusedamp_hooks", None)
    model.__dict__.pop("_fusedamp_dtype", None)
    with torch.no_grad():
        for name, p in named.items():
            if weights is not None and name in weights:
                p.data = weights[name].detach().to(device=p.device, dtype=dtype).clone()
            elif p.is_floating_point():
                p.data = p.data.to(dtype)
    for module in model.modules():
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point():
                module._buffers[name] = b.to(dtype)
    return model
