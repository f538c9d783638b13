"""``fusedamp.debug.precision_audit(model, inputs, dtype)``: which modules lose accuracy in a low
precision, and what each costs.

For every module that computes something of its own (a leaf, or one with code between its
children: every module whose type is not a plain container -- Sequential, ModuleList, ModuleDict):
- local_error: the module alone, converted to `dtype`, run on the input the FP32 run gave it
  (cast to `dtype`), against the FP32 run's output: the error the module itself adds;
- accumulated_error: its output in a full `dtype` run of the model against the FP32 run's: what
  it inherits from everything before it plus its own;
- time_fp32_ms / time_dtype_ms: the module on its recorded input, on the model's device.
Errors are relative L2 norms (||low - fp32|| / ||fp32|| over all floating outputs); inf where the
low-precision output holds inf/NaN that the FP32 one does not.

The model itself is not touched: the runs use deep copies in eval mode (dropout off, norm
statistics not updated), under torch.no_grad. A module called several times per forward is
audited on its first call.
"""
from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Mapping

import torch

__all__ = ["precision_audit", "Audit"]


class Audit(list):
    """precision_audit's result: a list of per-module dicts, worst local error first, with
    ``keep_fp32``: the innermost modules whose local error exceeds ``tolerance`` (or is not
    finite; a module containing one is not listed again), as
    ``fusedamp.initialize(model, optimizer, dtype, keep_fp32=audit.keep_fp32)`` takes them."""

    def __init__(self, rows, keep_fp32, tolerance):
        super().__init__(rows)
        self.keep_fp32 = keep_fp32
        self.tolerance = tolerance


def _map_floats(obj, fn, depth=0):
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.is_floating_point() else obj
    if depth > 8:
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_floats(v, fn, depth + 1) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_floats(v, fn, depth + 1) for v in obj)
    if isinstance(obj, Mapping):
        mapped = {k: _map_floats(v, fn, depth + 1) for k, v in obj.items()}
        try:
            return type(obj)(**mapped) if type(obj) is not dict else mapped
        except TypeError:
            return mapped
    return obj


def _floats(obj, out, depth=0):
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            out.append(obj)
    elif depth <= 8 and isinstance(obj, (tuple, list)):
        for v in obj:
            _floats(v, out, depth + 1)
    elif depth <= 8 and isinstance(obj, Mapping):
        for v in obj.values():
            _floats(v, out, depth + 1)
    return out


def relative_error(low, reference):
    """||low - reference|| / ||reference|| over the floating tensors of both (FP64); inf where
    `low` is non-finite where `reference` is finite (or the structures differ)."""
    lows, refs = _floats(low, []), _floats(reference, [])
    if len(lows) != len(refs):
        return math.inf
    diff = norm = 0.0
    for a, b in zip(lows, refs):
        if a.shape != b.shape:
            return math.inf
        a, b = a.detach().double(), b.detach().double()
        finite = torch.isfinite(b)
        if not bool(torch.isfinite(a[finite]).all()):
            return math.inf
        diff += float((a[finite] - b[finite]).square().sum())
        norm += float(b[finite].square().sum())
    if diff == 0.0:
        return 0.0
    return math.sqrt(diff / norm) if norm > 0 else math.inf


def _copy(t):
    return t.detach().clone()


def _split(inputs):
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _record(model, leaves, args, kwargs, keep_inputs):
    """Run model(*args, **kwargs), keeping each leaf's first output (and input)."""
    outputs, recorded, handles = {}, {}, []
    for name, module in leaves:
        # Copies: an in-place module (ReLU(inplace=True)) or a parent's `out += x` would
        # otherwise change what was recorded.
        def pre(mod, a, kw, name=name):
            if keep_inputs and name not in recorded:
                recorded[name] = _map_floats((a, kw), _copy)

        def post(mod, a, out, name=name):
            if name not in outputs:
                outputs[name] = _map_floats(out, _copy)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    try:
        model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return outputs, recorded


def _time_ms(fn, device, repeats):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()   # warm-up (allocations, kernel selection)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def precision_audit(model, inputs, dtype=torch.float16, *, tolerance=None, repeats=5):
    """Audit `model` (an FP32 nn.Module) on `inputs` (a tensor, a tuple of positional arguments
    or a dict of keyword arguments) for `dtype` (torch.float16 or torch.bfloat16); see the
    module docstring. tolerance: the local error above which a module is suggested for FP32
    (default 8 x the unit roundoff of `dtype`). Returns an :class:`Audit`."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"precision_audit: dtype must be torch.float16 or torch.bfloat16, "
                         f"got {dtype}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"precision_audit: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"precision_audit: repeats must be an int >= 1, got {repeats!r}")
    if tolerance is None:
        tolerance = 8 * torch.finfo(dtype).eps
    elif not tolerance > 0:
        raise ValueError(f"precision_audit: tolerance must be > 0, got {tolerance!r}")
    model = getattr(model, "_orig_mod", model)   # torch.compile's wrapper: the user's names
    reference = copy.deepcopy(model).float().eval()
    containers = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
    leaves = [(n, m) for n, m in reference.named_modules()
              if n and not isinstance(m, containers)]
    if not leaves:
        raise ValueError("precision_audit: the model has no modules to audit")
    device = next((p.device for p in reference.parameters()), torch.device("cpu"))
    args, kwargs = _split(inputs)
    args32, kwargs32 = _map_floats((args, kwargs), lambda t: t.float())

    def low(t):
        return t.to(dtype)

    with torch.no_grad():
        out32, seen = _record(reference, leaves, args32, kwargs32, keep_inputs=True)
        low_model = copy.deepcopy(reference).to(dtype)
        low_leaves = [(n, low_model.get_submodule(n)) for n, _ in leaves]
        out_low, _ = _record(low_model, low_leaves, *_map_floats((args, kwargs), low),
                             keep_inputs=False)
        rows = []
        for (name, module), (_, module_low) in zip(leaves, low_leaves):
            if name not in seen:
                continue   # not called by this forward
            a32, kw32 = seen[name]
            a_low, kw_low = _map_floats((a32, kw32), low)
            rows.append({
                "module": name,
                "type": type(module).__name__,
                "local_error": relative_error(module_low(*a_low, **kw_low), out32[name]),
                "accumulated_error": relative_error(out_low.get(name), out32[name]),
                "time_fp32_ms": _time_ms(lambda: module(*a32, **kw32), device, repeats),
                "time_dtype_ms": _time_ms(lambda: module_low(*a_low, **kw_low), device, repeats),
            })
    rows.sort(key=lambda r: (-_order(r["local_error"]), -_order(r["accumulated_error"])))
    bad = [r["module"] for r in rows
           if not math.isfinite(r["local_error"]) or r["local_error"] > tolerance]
    # A module holding a bad one is bad through it: keep only the innermost in FP32.
    keep = [n for n in bad if not any(m.startswith(n + ".") for m in bad)]
    return Audit(rows, keep, tolerance)


def _order(error):
    return math.inf if math.isnan(error) else error
