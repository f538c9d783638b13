"""Diagnostics that stay on the device until asked for: why a run went wrong.

- ``History``: a ring buffer of per-step scalars (loss scale, global gradient norm) written on
  the device; ``values()`` reads it with one synchronisation.
- ``nonfinite_grads(model)``: which named parameters hold inf/NaN gradients (call it after a
  skipped step, before ``zero_grad``): one fused read-only pass, one synchronisation.
"""
from __future__ import annotations

from collections import defaultdict

import torch

__all__ = ["History", "nonfinite_grads"]


class History:
    """The last ``capacity`` values of a per-step device scalar."""

    def __init__(self, capacity: int = 100_000):
        if capacity < 1:
            raise ValueError("History capacity must be >= 1")
        self.capacity = capacity
        self._buf = None
        self._n = 0

    def record(self, value: torch.Tensor):
        if self._buf is None or self._buf.device != value.device:
            self._buf = torch.full((self.capacity,), float("nan"), dtype=torch.float32,
                                   device=value.device)
            self._n = 0
        self._buf[self._n % self.capacity].copy_(value.detach().reshape(()), non_blocking=True)
        self._n += 1

    def __len__(self):
        return min(self._n, self.capacity)

    def values(self):
        """The recorded values, oldest first, as Python floats (one synchronisation)."""
        if self._buf is None or self._n == 0:
            return []
        if self._n <= self.capacity:
            return self._buf[: self._n].tolist()
        k = self._n % self.capacity
        return torch.cat([self._buf[k:], self._buf[:k]]).tolist()

    def clear(self):
        self._n = 0


def nonfinite_grads(model_or_named_parameters):
    """Names of the parameters whose gradient holds inf or NaN."""
    named = (model_or_named_parameters.named_parameters()
             if isinstance(model_or_named_parameters, torch.nn.Module)
             else model_or_named_parameters)
    by_device = defaultdict(list)
    for name, p in named:
        if p.grad is not None:
            by_device[p.grad.device].append((name, p.grad))
    bad = []
    for device, items in by_device.items():
        names, grads = zip(*items)
        found = torch.zeros(1, device=device)
        sum_sq = torch.zeros(1, device=device)
        flags = torch.zeros(len(grads), device=device)
        torch.ops.fusedamp.grad_stats_(list(grads), found, sum_sq, flags)
        bad += [n for n, f in zip(names, flags.tolist()) if f]
    return bad
