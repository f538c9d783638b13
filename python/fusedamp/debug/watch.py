"""``fusedamp.debug.watch(model)``: which module produced the first inf/NaN, forward or backward.

Per module and iteration (an iteration begins at each forward of the root module) the watch
records on the device, with no host synchronisation, grad_stats_'s one-pass telemetry of
- the forward inputs and output (amax, non-finite),
- the gradient the module received (w.r.t. its outputs) and the one it produced (w.r.t. its
  inputs; with parameters=True, its own parameters' too): amax, non-finite, elements zero or
  subnormal.
Rows live in a device ring of `capacity` iterations; the first iteration with any non-finite
value is also latched on the device, so it is found after the ring has moved on.

Gradients are seen through hooks on the autograd nodes that made the module's input and output
tensors (not register_full_backward_hook): in-place modules (ReLU(inplace=True)),
``out += identity`` in a parent, and outputs that are tuples, dicts or ModelOutputs all work,
and the hooks never change a value. Wrappers (DDP, DataParallel, FSDP1, torch.compile,
activation checkpointing) are seen through: modules keep the names the user gave them. A tensor
passed from one module to the next (or from a container to its first child) is measured once
and the record shared. A module called several times in one iteration
(shared weights) accumulates all calls into its one record (max of amax, sums of counts, any
non-finite). Hooks run eagerly under torch.compile (graph breaks at each module boundary).
"""
from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Mapping

import torch

from .._library import _C
from ._record import FIRST, IN, KINDS, OUT, PROD, RECV, SLOTS, Iteration
from ._wrappers import user_modules

__all__ = ["watch", "Watch"]

_MEASURED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_watched = weakref.WeakSet()   # root modules with a live watch: a second one is an error
_HISTORY = 256                 # distinct iteration layouts kept for the latched iteration
# fusedamp.ops.grad_stats_'s direct entry: the hooks that call it run eagerly (see _eager),
# where ops.grad_stats_ would check for a compilation on every call.
_grad_stats = _C.ops.grad_stats_


def watch(model, capacity=64, *, parameters=False):
    """Attach a numerics watch to every submodule of `model`; see :class:`Watch`."""
    return Watch(model, capacity=capacity, parameters=parameters)


def _eager(fn):
    # The hooks keep Python state (weak references, dicts): under torch.compile they run
    # eagerly between compiled pieces (a graph break) instead of being traced. The check is
    # done here, not by calling the disabled function always: its wrapper costs ~30 us a call
    # in eager mode, a quarter of the watch's time on a small GPT-2.
    disabled = torch.compiler.disable(fn, recursive=True)
    is_compiling = torch.compiler.is_compiling

    @functools.wraps(fn)
    def hook(*args, **kwargs):
        if is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return hook


def _unhook_leaf(ref, handle, hookless):
    """Remove a leaf tensor's hook; where it had none before, leave None, not an empty dict."""
    if handle is not None:
        handle.remove()
    t = ref()
    if hookless and t is not None and t._backward_hooks is not None and not t._backward_hooks:
        t._backward_hooks = None


class Watch:
    """Per-module, per-iteration numerics record of a model; see the module docstring.

    ``first_nonfinite()``, ``first_underflow()``, ``report()``, ``history()`` and ``plot()``
    read the device record (they synchronise: call them after training, or when a step was
    skipped). ``remove()`` (or leaving a ``with`` block) detaches every hook.

    capacity: iterations kept (the first with a non-finite value is kept besides).
    parameters: count the gradients of each module's own parameters as produced by it too
    (a parameter shared by several modules excepted). Off by default: for a CNN the weight
    gradients are most of the bytes a step's gradients hold (ResNet-18 at batch 8, 64 x 64:
    11.2 M of 11.7 M produced elements), and torch.optim / the loss scaler read them anyway;
    on, a first layer whose input needs no gradient (an embedding, the stem) can be named."""

    def __init__(self, model, capacity=64, *, parameters=False):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"fusedamp.debug.watch: expected an nn.Module, got "
                            f"{type(model).__name__}")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"fusedamp.debug.watch: capacity must be an int >= 1, "
                             f"got {capacity!r}")
        named = user_modules(model)
        root = named[0][1]
        if len(named) < 2:
            raise ValueError("fusedamp.debug.watch: the model has no submodules; a watch "
                             "reports per module, so wrap the computation in modules")
        if root in _watched:
            raise RuntimeError("fusedamp.debug.watch: this model already has a watch "
                               "attached; call its remove() (or leave its with block) first")
        self.names = [name for name, _ in named]
        self._root = root
        self._capacity = capacity
        device = next((t.device for t in root.parameters()), None)
        if device is None:
            device = next((t.device for t in root.buffers()), torch.device("cpu"))
        self.device = device
        seed = torch.zeros(len(named), KINDS, SLOTS, dtype=torch.float64, device=device)
        seed[..., FIRST] = float("inf")
        self._seed = seed
        self._ring = seed.expand(capacity, -1, -1, -1).clone()
        # The current iteration writes here, through views made once (making a row's views
        # each iteration, one unbind into modules x kinds, took ~0.5 ms a step for a 4-layer
        # GPT-2's 55 modules); _begin moves it into its ring row.
        self._live = seed.clone()
        self._live_views = self._live.view(-1, SLOTS).unbind(0)
        self._found = torch.zeros(1, device=device)    # grad_stats_'s outputs nobody reads:
        self._sum_sq = torch.zeros(1, device=device)   # non-finite is telemetry[FIRST] < inf
        self._latched = seed.clone()                   # first row with a non-finite value
        self._latched_iteration = torch.full((), -1.0, dtype=torch.float64, device=device)
        self._rows = [None] * capacity                 # Iteration of each ring row
        self._history = []                             # (iteration, Iteration) layouts
        self._iteration = -1
        self._current = None
        self._forward_seen = {}   # id(tensor) -> (weakref, version, slot) this iteration
        self._grad_seen = {}      # id(tensor) -> (weakref, version, slots)
        self._node_handles = []   # this iteration's hooks on autograd nodes
        self._leaf_hooks = {}     # id(leaf tensor) -> (weakref, its gradient hook's handle,
        #                           whether it had no hooks before: see _unhook_leaf)
        self._warned_device = False
        self._closed = False
        # A parameter's hook sees its gradient summed over every use: one shared by several
        # modules (tied embeddings) would blame each for the others' part, so it is left out.
        owners = {}
        for _, module in named:
            for p in module.parameters(recurse=False):
                owners[p] = owners.get(p, 0) + 1
        handles = [root.register_forward_pre_hook(self._begin, prepend=True)]
        self._hookless = []
        for index, (_, module) in enumerate(named):
            handles.append(module.register_forward_pre_hook(
                functools.partial(self._before, index), with_kwargs=True))
            handles.append(module.register_forward_hook(functools.partial(self._after, index)))
            for p in module.parameters(recurse=False):
                if parameters and p.requires_grad and owners[p] == 1:
                    if p._backward_hooks is None:
                        self._hookless.append(p)
                    handles.append(p.register_hook(functools.partial(self._param_grad, index)))
        self._handles = handles
        _watched.add(root)

    # ---- attaching -----------------------------------------------------------------------
    def remove(self):
        """Detach every hook; the model is left exactly as it was. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for handle in self._handles + self._node_handles:
            handle.remove()
        for leaf in self._leaf_hooks.values():
            _unhook_leaf(*leaf)
        self._handles, self._node_handles, self._leaf_hooks = [], [], {}
        for p in self._hookless:   # removing a hook leaves an empty dict where None was
            _unhook_leaf(weakref.ref(p), None, True)
        self._hookless = []
        self._forward_seen.clear()
        self._grad_seen.clear()
        _watched.discard(self._root)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    # ---- recording (no host synchronisation below) --------------------------------------
    @_eager
    def _begin(self, module, args):
        if self._closed:
            return
        if self._current is not None:
            self._ring[self._current.index % self._capacity].copy_(self._live)
            self._latch(self._current)
        self._iteration += 1
        self._live.copy_(self._seed)
        self._current = self._rows[self._iteration % self._capacity] = Iteration(self._iteration)
        self._forward_seen.clear()
        self._grad_seen.clear()
        self._node_handles = []   # the last iteration's nodes are freed with its graph
        self._leaf_hooks = {k: v for k, v in self._leaf_hooks.items() if v[0]() is not None}

    def _latch(self, it):
        # Keep the first row that holds any non-finite value, decided on the device.
        row = self._live
        first = (row[..., FIRST] != float("inf")).any() & (self._latched_iteration < 0)
        self._latched.copy_(torch.where(first, row, self._latched))
        self._latched_iteration.copy_(torch.where(first, float(it.index), self._latched_iteration))
        if not self._history or not self._history[-1][1].same_layout(it):
            self._history.append((it.index, it))
            del self._history[:-_HISTORY]

    def _view(self, it, slot):
        if it is self._current:
            return self._live_views[slot]
        # a late backward of an earlier iteration, into its ring row
        return self._ring[it.index % self._capacity, slot // KINDS, slot % KINDS]

    def _floats(self, obj, out, depth=0):
        """The floating tensors in obj (tensors, tuples, lists, dicts, ModelOutputs), once each."""
        if depth == 0 and type(obj) is torch.Tensor and obj.dtype in _MEASURED_DTYPES \
                and obj.device == self.device:
            return [obj]   # the common case, without the walk (hooks' Python is most of the cost)
        if isinstance(obj, torch.Tensor):
            if obj.dtype in _MEASURED_DTYPES and all(t is not obj for t in out):
                if obj.device == self.device:
                    out.append(obj)
                elif not self._warned_device:
                    self._warned_device = True
                    warnings.warn(f"fusedamp.debug.watch records tensors on {self.device} "
                                  f"only; those on {obj.device} are not measured")
        elif depth < 8 and isinstance(obj, (tuple, list)):
            for item in obj:
                self._floats(item, out, depth + 1)
        elif depth < 8 and isinstance(obj, Mapping):
            for item in obj.values():
                self._floats(item, out, depth + 1)
        return out

    def _measure(self, it, slot, tensors):
        _grad_stats(tensors, self._found, self._sum_sq, None, self._view(it, slot))
        it.measured(slot, tensors)

    def _record(self, it, tensors, value_slot, grad_slot):
        """Measure the tensors into value_slot now, and their gradients into grad_slot when
        backward reaches them. A tensor seen already this iteration (same object, same version)
        shares its records: its value's where it was measured alone, its gradient's always."""
        fresh = []
        for t in tensors:
            key, version = id(t), t._version
            seen = self._forward_seen.get(key)
            if seen is not None and seen[0]() is t and seen[1] == version:
                it.alias(value_slot, seen[2])
            else:
                fresh.append(t)
            if not t.requires_grad:
                continue
            seen = self._grad_seen.get(key)
            if seen is not None and seen[0]() is t and seen[1] == version:
                seen[2].append(grad_slot)   # measured once, in the first slot; shared here
            else:
                self._watch_gradient(it, t, [grad_slot])
        if fresh:
            self._measure(it, value_slot, fresh)
            if len(tensors) == 1:
                t = tensors[0]
                self._forward_seen[id(t)] = (weakref.ref(t), t._version, value_slot)

    def _watch_gradient(self, it, t, slots):
        """Measure t's gradient into slots[0] (the others alias it) when backward reaches it."""
        self._grad_seen[id(t)] = (weakref.ref(t), t._version, slots)
        node = t.grad_fn
        if node is not None:
            # On the node that made t, for its output t.output_nr: what a hook registered
            # on t would see (later in-place ops on t do not move it); registered and called
            # in ~4.5 us where a tensor hook takes ~5.8 us (2-core Xeon, one thread).
            self._node_handles.append(node.register_prehook(
                functools.partial(self._gradient, it, slots, t.output_nr)))
        else:
            # A leaf (a parameter, a user's input) outlives the iteration: its hook is
            # replaced when a later iteration uses it again, so that one backward never
            # lands in the rows of several iterations.
            old = self._leaf_hooks.pop(id(t), None)
            if old is not None:
                _unhook_leaf(*old)
            hookless = t._backward_hooks is None
            self._leaf_hooks[id(t)] = (weakref.ref(t), t.register_hook(
                functools.partial(self._gradient, it, slots, None)), hookless)

    @_eager
    def _before(self, index, module, args, kwargs):
        it = self._current
        if it is None or self._closed:
            return
        tensors = self._floats(args[0] if len(args) == 1 and not kwargs else (args, kwargs), [])
        if tensors:
            self._record(it, tensors, index * KINDS + IN, index * KINDS + PROD)

    @_eager
    def _after(self, index, module, args, output):
        it = self._current
        if it is None or self._closed:
            return
        tensors = self._floats(output, [])
        if tensors:
            self._record(it, tensors, index * KINDS + OUT, index * KINDS + RECV)
        it.finished_forward(index)

    @_eager
    def _gradient(self, it, slots, output, grad):
        if output is not None:   # a node's pre-hook: the gradients of all its outputs
            grad = grad[output]
        if self._closed or grad is None or grad.dtype not in _MEASURED_DTYPES:
            return
        if grad.device != self.device or it is not self._rows[it.index % self._capacity]:
            return   # another device, or a backward of an iteration the ring has dropped
        first = slots[0]
        self._measure(it, first, [grad])
        for slot in slots:
            if slot != first:
                it.alias(slot, first)
            module, kind = divmod(slot, KINDS)
            if kind == PROD:
                it.produced_gradient(module)
            elif kind == RECV:
                it.received_gradient(module)

    @_eager
    def _param_grad(self, index, grad):
        it = self._current
        if self._closed or it is None or grad.dtype not in _MEASURED_DTYPES:
            return
        if grad.is_sparse or grad.device != self.device:
            return
        self._measure(it, index * KINDS + PROD, [grad])
        it.produced_gradient(index)

    # ---- reading (synchronises) ----------------------------------------------------------
    def _read(self):
        """[(Iteration, row as nested lists)], oldest first, the latched row included."""
        ring = self._ring.clone()
        if self._current is not None:
            ring[self._current.index % self._capacity] = self._live
        ring = ring.cpu().tolist()
        rows = sorted((it.index, it, ring[it.index % self._capacity])
                      for it in self._rows if it is not None)
        latched = int(self._latched_iteration.item())
        if latched < 0:
            return [(it, row) for _, it, row in rows]
        if rows and latched >= rows[0][0]:
            return [(it, row) for _, it, row in rows]
        layout = None
        for start, it in self._history:
            if start <= latched:
                layout = it
        if layout is None:
            return [(it, row) for _, it, row in rows]
        it = Iteration(latched)
        it.forward_order, it.backward_order = layout.forward_order, layout.backward_order
        it.received_order = layout.received_order
        it.aliases, it.numel, it.dtype = layout.aliases, layout.numel, layout.dtype
        return [(it, self._latched.cpu().tolist())] + [(it, row) for _, it, row in rows]

    @property
    def iterations(self):
        """How many iterations (root forwards) the watch has seen."""
        return self._iteration + 1

    def first_nonfinite(self, source=False):
        from ._analysis import first_nonfinite
        return first_nonfinite(self, source)

    def first_underflow(self, threshold=0.9, dtype=None):
        from ._analysis import first_underflow
        return first_underflow(self, threshold, dtype)

    def report(self, dtype=None):
        from ._analysis import report
        return report(self, dtype)

    def history(self, dtype=None):
        from ._analysis import history
        return history(self, dtype)

    def plot(self, path, dtype=None):
        from ._analysis import plot
        return plot(self, path, dtype)

    def write_tensorboard(self, writer_or_logdir, dtype=None, tag="fusedamp.debug"):
        """report()'s values per iteration as TensorBoard scalars, the first non-finite as
        text, the heat map as a figure; see _analysis.write_tensorboard."""
        from ._analysis import write_tensorboard
        return write_tensorboard(self, writer_or_logdir, dtype, tag)
