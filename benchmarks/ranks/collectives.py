"""What the ranks hand to torch.distributed's collectives: every collective function wrapped so
that, while a key is set, each call adds the size of the full tensor it works on (the payload)
and the bytes a bandwidth-optimal algorithm would send for it (the wire model)."""
from __future__ import annotations

import inspect
import sys
import threading

# What a collective carries, from its arguments: the argument holding the full-size tensor(s)
# and, per rank, the fraction of that size a bandwidth-optimal algorithm must send (averaged over
# the ranks; an all-reduce is a reduce-scatter plus an all-gather, hence 2(N-1)/N). The first
# number is measured; the second is a model of the wire that does not depend on which
# algorithm Gloo picks.
_ALL_REDUCE = lambda n: 2 * (n - 1) / n  # noqa: E731
_ONE_PASS = lambda n: (n - 1) / n  # noqa: E731
_ALL_REDUCE_ARGS = {"all_reduce": "tensor", "all_reduce_coalesced": "tensors"}
_ONE_PASS_ARGS = {
    "broadcast": "tensor", "reduce": "tensor", "gather": "tensor", "scatter": "tensor",
    "all_gather": "tensor_list", "all_to_all": "input_tensor_list",
    "all_gather_into_tensor": "output_tensor", "_all_gather_base": "output_tensor",
    "all_gather_coalesced": "output_tensor_lists", "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input", "_reduce_scatter_base": "input",
    "all_to_all_single": "input"}
# gather's and scatter's tensor is one rank's part of the whole: × the world size.
_PER_RANK = ("gather", "scatter")
_COLLECTIVES = {name: (arg, "world" if name in _PER_RANK else 1,
                       _ALL_REDUCE if name in _ALL_REDUCE_ARGS else _ONE_PASS)
                for name, arg in {**_ALL_REDUCE_ARGS, **_ONE_PASS_ARGS}.items()}


def _nbytes(x):
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return x.numel() * x.element_size() if hasattr(x, "element_size") else 0


class CollectiveCounter:
    """Counts what the torch.distributed collectives are given while ``key`` is set.

    The functions are replaced on torch.distributed, on distributed_c10d and on every loaded
    torch.distributed / fusedamp module that imported one by name, so a call is seen however
    the engine spells it. Only the outermost call counts: the deprecated spellings
    (_all_gather_base, all_gather_object, ...) call the current ones."""

    def __init__(self, world):
        self.world = world
        self.key = None
        self.totals = {}  # key -> {"payload": bytes, "wire": bytes, "calls": {name: n}}
        self._depth = threading.local()
        self._originals = {}

    def install(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name in _COLLECTIVES:
            fn = getattr(c10d, name, None)
            if fn is not None:
                self._originals[name] = fn
        wrapped = {name: self._wrap(name, fn) for name, fn in self._originals.items()}
        by_id = {id(fn): wrapped[name] for name, fn in self._originals.items()}
        modules = [dist, c10d] + [m for n, m in list(sys.modules.items()) if m is not None and (
            n.startswith("torch.distributed") or n.startswith("fusedamp"))]
        for module in modules:
            for attr, value in list(vars(module).items()):
                if id(value) in by_id:
                    setattr(module, attr, by_id[id(value)])

    def _wrap(self, name, fn):
        arg, scale, wire = _COLLECTIVES[name]
        sig = inspect.signature(fn)

        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if self.key is not None and depth == 0:
                bound = sig.bind_partial(*args, **kwargs).arguments
                size = _nbytes(bound.get(arg, args[0] if args else None))
                if scale == "world":
                    size *= self.world
                t = self.totals.setdefault(self.key, {"payload": 0, "wire": 0.0, "calls": {}})
                t["payload"] += size
                t["wire"] += size * wire(self.world)
                t["calls"][name] = t["calls"].get(name, 0) + 1
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        counted.__wrapped__ = fn
        return counted
