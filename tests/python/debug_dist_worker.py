"""One rank of the fusedamp.debug.watch tests under data parallelism (launched by
test_debug_distributed.py). Not a test module itself.

    python debug_dist_worker.py RANK WORLD INIT_FILE BACKEND OUT_DIR

Each rank trains the same small model wrapped three ways -- DDP, FSDP2 (fully_shard on each
residual block, then the root), FSDP1 (FullyShardedDataParallel, residual blocks auto-wrapped)
-- with a watch attached to the wrapped model. Rank r makes the output of module
FAULTS[r] infinite at iteration AT + r, so the ranks' first non-finite values differ in module
and iteration (the optimizer does not step: an inf gradient, all-reduced, would reach every
rank's weights). Each rank saves what its watch reports to OUT_DIR/rank{RANK}.pt.
"""
from __future__ import annotations

import os
import sys

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)
import fusedamp  # noqa: E402
import rank_process  # noqa: E402
from debug_models import Fault, Residual  # noqa: E402

AT = 2
ITERATIONS = 5
FAULTS = ("3", "5")   # rank r's faulty module
WRAPPINGS = ("ddp", "fsdp2", "fsdp1")


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), Residual(16), Fault(16),
                         Residual(16), Fault(16), nn.Linear(16, 4))


def wrap(model, how, mesh):
    if how == "ddp":
        # Buffers stay per rank: DDP would broadcast rank 0's fault switches to every rank.
        return nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in (model[2], model[4]):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Residual}),
                                    device_id=torch.device("cpu"))


def run(how, mesh, rank):
    model = make_model()
    faulty = model.get_submodule(FAULTS[rank])
    wrapped = wrap(model, how, mesh)
    g = torch.Generator().manual_seed(100 + rank)
    with fusedamp.debug.watch(wrapped) as w:
        for i in range(ITERATIONS):
            faulty.inject(**(dict(forward=float("inf")) if i == AT + rank else {}))
            wrapped(torch.randn(4, 8, generator=g)).square().mean().backward()
            wrapped.zero_grad()
        return {"names": list(w.names), "first": w.first_nonfinite(source=True),
                "iterations": w.iterations,
                "nonfinite": {r["module"]: r["nonfinite_iterations"] for r in w.report()}}


def main():
    from fsdp_worker import join

    rank, _, out_dir, mesh = join(sys.argv[1:])
    rank_process.finish({how: run(how, mesh, rank) for how in WRAPPINGS}, out_dir, rank)


if __name__ == "__main__":
    main()
