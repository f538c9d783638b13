"""fusedamp on torch.distributed.

``ZeroRedundancyOptimizer`` (zero.py) is torch's ZeRO stage 1 over a fusedamp optimizer, with
clipping by the norm of all gradients and skips on every rank alike. FSDP2 (``fully_shard``)
needs no class of its own: fusedamp's optimizers and scaler take its DTensor parameters
(fsdp.py). ``optimizer_state_bytes`` measures what an optimizer keeps on this rank.
"""
from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer as _TorchZeRO

from .zero import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer", "optimizer_state_bytes"]


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state held by this process: the local optimizer's for a
    ZeroRedundancyOptimizer (torch's or fusedamp's); every tensor in ``optimizer.state``
    otherwise."""
    if isinstance(optimizer, _TorchZeRO):
        optimizer = optimizer.optim
    return sum(v.numel() * v.element_size() for s in optimizer.state.values()
               for v in s.values() if isinstance(v, torch.Tensor))
