"""Host-side bookkeeping of one watched iteration, and how its device rows are read back.

The device holds, per iteration row, one FP64[4] telemetry record (grad_stats_'s slots: amax,
subnormal count, zero count, first non-finite position) per module and kind below. What the
host keeps is only what it knows without looking at data: in which order modules finished
(forward) or produced gradients (backward), how many elements each record covered, and which
records are the same tensor measured once for several modules (aliases).
"""
from __future__ import annotations

import math

import torch

# Record kinds, per module: the forward inputs, the forward output, the gradient the module
# received (w.r.t. its outputs) and the gradient it produced (w.r.t. its inputs and its own
# parameters).
IN, OUT, RECV, PROD = range(4)
KINDS = 4
# grad_stats_'s telemetry slots (csrc/include/fusedamp/math/telemetry_math.h).
AMAX, SUBNORMAL, ZERO, FIRST = range(4)
SLOTS = 4


class Iteration:
    """What the host knows of one iteration; records are named by slot = module * KINDS + kind."""

    __slots__ = ("index", "forward_order", "backward_order", "received_order", "aliases",
                 "numel", "dtype", "_finished", "_produced", "_received")

    def __init__(self, index):
        self.index = index
        self.forward_order = []   # modules in the order their forward finished (first call)
        self.backward_order = []  # modules in the order they first produced a gradient
        self.received_order = []  # modules in the order they first received a gradient
        self.aliases = {}         # slot -> slots measured once for it and for others
        self.numel = {}           # slot -> elements measured directly into it
        self.dtype = {}           # slot -> dtype of the first tensor measured for it
        self._finished = set()
        self._produced = set()
        self._received = set()

    def measured(self, slot, tensors):
        n = tensors[0].numel() if len(tensors) == 1 else sum(t.numel() for t in tensors)
        if slot in self.numel:
            self.numel[slot] += n
        else:
            self.numel[slot] = n
            self.dtype[slot] = tensors[0].dtype

    def alias(self, slot, source):
        if slot != source:
            self.aliases.setdefault(slot, []).append(source)

    def finished_forward(self, module):
        if module not in self._finished:
            self._finished.add(module)
            self.forward_order.append(module)

    def produced_gradient(self, module):
        if module not in self._produced:
            self._produced.add(module)
            self.backward_order.append(module)

    def received_gradient(self, module):
        if module not in self._received:
            self._received.add(module)
            self.received_order.append(module)

    def closure(self, slot):
        """The slots whose records make up `slot`: itself and its aliases, transitively."""
        seen, todo = [], [slot]
        while todo:
            s = todo.pop()
            if s not in seen:
                seen.append(s)
                todo.extend(self.aliases.get(s, ()))
        return seen

    def same_layout(self, other):
        """Whether other's records are laid out as this one's (orders and aliases)."""
        return (self.forward_order == other.forward_order
                and self.backward_order == other.backward_order
                and self.received_order == other.received_order
                and self.aliases == other.aliases)


class Stats:
    """One record read back and combined with its aliases: amax, elements below the smallest
    normal (zeros included), elements, non-finite, dtype; measured False where nothing was."""

    __slots__ = ("amax", "small", "numel", "nonfinite", "dtype", "measured")

    def __init__(self, row, it, slot, num_kinds=KINDS):
        self.amax, self.small, self.numel, self.nonfinite = 0.0, 0.0, 0, False
        self.dtype, self.measured = None, False
        for s in it.closure(slot):
            module, kind = divmod(s, num_kinds)
            values = row[module][kind]
            if s in it.numel or values[FIRST] != math.inf:
                self.measured = True
            self.amax = max(self.amax, values[AMAX])
            self.small += values[SUBNORMAL] + values[ZERO]
            self.numel += it.numel.get(s, 0)
            self.nonfinite = self.nonfinite or values[FIRST] != math.inf
            self.dtype = self.dtype or it.dtype.get(s)

    @property
    def underflow_fraction(self):
        return self.small / self.numel if self.numel else None


def headroom_bits(amax, dtype):
    """log2(largest finite value of dtype / amax): how many doublings are left before overflow."""
    if amax is None or amax <= 0 or dtype is None:
        return None
    return math.log2(torch.finfo(dtype).max / amax)


def _ancestors(names, module):
    """Indices of module's enclosing modules, innermost first (by their dotted names)."""
    name = names[module]
    index = {n: i for i, n in enumerate(names)}
    out = []
    while name:
        name = name.rpartition(".")[0]
        if name in index:
            out.append(index[name])
    return out


def producer(row, it, phase, names):
    """The module that made the phase's first non-finite value, as (module, True), or, where it
    came from outside every module (the data, the loss), the first module that got it, as
    (module, False); None where the phase saw none.

    Made: the first module (forward: in finishing order; backward: in producing order) whose
    output (gradient produced) is non-finite while its inputs (gradient received) were finite.
    Where none is, a module got non-finite values that no module's output carried: they were
    made by a parent's own code between its children (``y * mul``, a custom autograd function
    applied in its forward); the innermost parent whose inputs (received gradient) were still
    finite is named."""
    forward = phase == "forward"
    order, made, given = ((it.forward_order, OUT, IN) if forward
                          else (it.backward_order, PROD, RECV))
    for m in order:
        produced = Stats(row, it, m * KINDS + made)
        received = Stats(row, it, m * KINDS + given)
        if produced.nonfinite and not received.nonfinite:
            return m, True
    got = it.forward_order if forward else it.received_order
    entered = next((m for m in got if Stats(row, it, m * KINDS + given).nonfinite), None)
    if entered is None:
        return None
    for parent in _ancestors(names, entered):
        if not Stats(row, it, parent * KINDS + given).nonfinite:
            return parent, True
    return entered, False
