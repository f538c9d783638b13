"""The ZeRO-1 layout of fusedamp.distributed.ShardedOptimizer: flat buffers, shards, segments.

The parameters of one (param group, dtype) are packed into one flat buffer, padded to a
multiple of the world size N; every parameter's ``.data`` becomes a view of it, so an
all-gather into the buffer writes the model weights directly. Rank r owns the slice
``[r*S, (r+1)*S)`` (S = padded numel / N). Inside the shard, a parameter's piece is a
*segment*: the engine steps each segment as a parameter of its own, whose gradient is a view of
the reduced gradient shard and whose state (step count, weight store, moments) are views of
flat buffers of the shard's size — flat, so that gathering the full state is one all-gather
per state buffer. The weight store is what the group's master_weights mode keeps (the FP32
master, the int16 remainder of "split", the 16-bit Kahan compensation, or nothing); the
moments are of the group's state_dtype (FP32 or BF16). A FlatShard runs the collectives of its
own buffers (the gradients' reduce-scatter, the state's all-gather); ShardedOptimizer decides
when.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._library import _C

__all__ = ["FlatShard", "flat_shards", "converted_state"]


def converted_state(weight, full, master_weights, state_dtype, index):
    """(weight, state) of parameter ``index`` as a group of ``master_weights`` and
    ``state_dtype`` keeps it, from a full state's entry (the engine checks its names, shapes and
    dtypes); for a parameter never stepped (no entry), the engine's fresh state: its master is
    the weight, a remainder or compensation is zero."""
    return _C.convert_param_state(weight, full or {"step": torch.zeros(())}, master_weights,
                                  state_dtype, index)


def weight_store(master_weights, dtype, state_dtype, index=0):
    """(state name, dtype) of what the engine keeps beside weights of ``dtype`` under
    ``master_weights``, or None (FP32 weights, False, "stochastic"). ValueError (naming
    parameter ``index``) for a mode that does not fit the dtype ("split" and "stochastic" keep
    BF16 weights)."""
    _, fresh = converted_state(torch.empty(0, dtype=dtype), None, master_weights, state_dtype,
                               index)
    stores = [(name, t.dtype) for name, t in fresh.items() if name != "step"]
    return stores[0] if stores else None


def slot_names(kind, group):
    """The moments a param group of optimizer ``kind`` keeps."""
    if kind == "sgd":
        return ("momentum_buffer",) if group["momentum"] != 0 else ()
    return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())


def flat_shards(param_groups, kind, index, rank, world):
    """One FlatShard per (param group, dtype). Every bucket's weight store is checked first: a
    mode that does not fit raises before any parameter is repacked into a flat buffer."""
    layout = []
    for gi, g in enumerate(param_groups):
        by_dtype = {}
        for p in g["params"]:
            by_dtype.setdefault(p.dtype, []).append(p)
        layout += [(gi, ps, weight_store(g["master_weights"], ps[0].dtype, g["state_dtype"],
                                         index[id(ps[0])]), g["state_dtype"], slot_names(kind, g))
                   for ps in by_dtype.values()]
    return [FlatShard(gi, ps, rank, world, store, state_dtype, names)
            for gi, ps, store, state_dtype, names in layout]


def _on_the_wire(t):
    """`t` as a collective carries it: Gloo and NCCL have no int16, so the split remainders
    travel as their bits in float16 (a gather copies, it computes nothing)."""
    return t.view(torch.float16) if t.dtype == torch.int16 else t


class FlatShard:
    """The flat buffer of one (param group, dtype), this rank's shard of it, and the shard's
    state as flat buffers whose segment views the engine steps. ``store``: weight_store()'s
    answer for the group; ``state_dtype``, ``slot_names``: the moments the group keeps."""

    def __init__(self, group, params, rank, world, store, state_dtype, slot_names):
        self.group, self.params = group, params
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets.pop()
        self.shard = -(-self.numel // world)  # ceil
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard
        dtype, device = params[0].dtype, params[0].device
        self.flat = torch.zeros(self.shard * world, dtype=dtype, device=device)
        self.flat_grad = torch.zeros_like(self.flat)
        self.grad_shard = torch.zeros(self.shard, dtype=dtype, device=device)
        for p, off in zip(params, self.offsets):
            self.flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[off:off + p.numel()].view(p.shape)
        self.grad_views = [self.flat_grad[o:o + p.numel()].view(p.shape)
                           for p, o in zip(params, self.offsets)]
        # Segments: (parameter index, start, end) in flat coordinates, inside [lo, hi).
        self.segments = [(i, max(o, self.lo), min(o + p.numel(), self.hi))
                         for i, (p, o) in enumerate(zip(params, self.offsets))
                         if max(o, self.lo) < min(o + p.numel(), self.hi)]
        # The weight store starts as what a fresh state holds: the weight itself (an FP32 master
        # equal to it, a zero remainder or compensation); the moments start at zero.
        self.store_name, store_dtype = store or (None, None)
        self.store = None
        if self.store_name is not None:
            self.store = torch.empty(self.shard, dtype=store_dtype, device=device)
            self.reset_store()
        self.slots = {name: torch.zeros(self.shard, dtype=state_dtype, device=device)
                      for name in slot_names}
        self.steps = torch.zeros(len(self.segments), dtype=torch.float32, device=device)
        # The engine's parameters: one detached view of the model's flat buffer per segment,
        # whose .grad (pack_grads) is the matching view of the reduced grad shard.
        shard = self.flat[self.lo:self.hi]
        self.seg_params = [self.seg(shard, k).detach() for k in range(len(self.segments))]
        self.seg_grads = [self.seg(self.grad_shard, k) for k in range(len(self.segments))]

    def seg(self, t, k):
        """Segment k of a shard-sized flat tensor."""
        _, a, b = self.segments[k]
        return t[a - self.lo:b - self.lo]

    def segment_states(self):
        """Each segment's state for the engine: views of the flat state buffers (kept, not
        copied, so the engine steps them in place)."""
        for k, seg in enumerate(self.seg_params):
            state = {"step": self.steps[k]}
            if self.store is not None:
                state[self.store_name] = self.seg(self.store, k)
            state.update({n: self.seg(t, k) for n, t in self.slots.items()})
            yield seg, state

    def pack_grads(self):
        """Copies the parameters' gradients into the flat gradient buffer (zeros where a
        parameter has none, whose segments then get no .grad: the engine leaves them alone)."""
        present = [p.grad is not None for p in self.params]
        if any(p.grad is not None and p.grad.is_sparse for p in self.params):
            raise RuntimeError("fusedamp: sparse gradients are not supported")
        for view, here in zip(self.grad_views, present):
            if not here:
                view.zero_()
        if any(present):
            torch._foreach_copy_([v for v, h in zip(self.grad_views, present) if h],
                                 [p.grad for p in self.params if p.grad is not None])
        for (i, _, _), seg, grad in zip(self.segments, self.seg_params, self.seg_grads):
            seg.grad = grad if present[i] else None

    def reduce_scatter_grad(self, group, world, averaged):
        """Packs the gradients and reduces them to this rank's shard. Pre-divided by N, as DDP
        does, so that an FP16 sum cannot overflow where the mean would not. Returns the
        collective's work; None where there is no collective (one rank, or ``averaged``: the
        gradients are already the same on every rank)."""
        self.pack_grads()
        if world == 1 or averaged:
            self.grad_shard.copy_(self.flat_grad[self.lo:self.hi])
            return None
        self.flat_grad.mul_(1.0 / world)
        return dist.reduce_scatter_tensor(self.grad_shard, self.flat_grad, group=group,
                                          async_op=True)

    def segment_entries(self, index):
        """(param group, parameter index in ``index``, start, end within the parameter, the
        parameter, state views) of every segment."""
        for (i, a, e), (_, state) in zip(self.segments, self.segment_states()):
            p, off = self.params[i], self.offsets[i]
            yield self.group, index[id(p)], a - off, e - off, p, state

    def gathered_state(self, group):
        """Every rank's shard of the flat state buffers, whole, and each parameter's step count.
        Collectives: every rank of ``group`` calls it."""
        full = {}
        for name, t in self.state_buffers().items():
            full[name] = torch.empty(self.flat.numel(), dtype=t.dtype, device=t.device)
            dist.all_gather_into_tensor(_on_the_wire(full[name]), _on_the_wire(t), group=group)
        steps = self.first_element_steps()
        dist.all_reduce(steps, group=group)
        return full, steps

    def reset_store(self):
        """The weight store of a weights-only start (after the weights were broadcast)."""
        if self.store_name == "master_param":
            self.store.copy_(self.flat[self.lo:self.hi])
        elif self.store is not None:
            self.store.zero_()

    def state_buffers(self):
        """The shard's flat state buffers by state name (the step counts aside)."""
        return dict(({self.store_name: self.store} if self.store is not None else {}),
                    **self.slots)

    def first_element_steps(self):
        """Per parameter, its step count where this rank holds its first element, else 0:
        summed over the ranks, every parameter's step count."""
        steps = torch.zeros(len(self.params), dtype=torch.float32, device=self.steps.device)
        for k, (i, a, _) in enumerate(self.segments):
            if a == self.offsets[i]:
                steps[i] = self.steps[k]
        return steps

    def state_bytes(self):
        return sum(t.numel() * t.element_size()
                   for t in [*self.state_buffers().values(), self.steps])

    def buffer_bytes(self):
        return (self.flat_grad.numel() + self.grad_shard.numel()) * self.flat.element_size()
