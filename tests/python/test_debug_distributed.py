"""fusedamp.debug.watch on a model wrapped for data parallelism (DDP, FSDP2, FSDP1): 2 ranks on
Gloo on the CPU, launched as test_distributed.py launches its ranks (debug_dist_worker.py runs
on each). The watch names modules as the user wrote them, and each rank names the module and
iteration of its own injected forward overflow."""
import os

import pytest
import torch

pytest.importorskip("torch.distributed.fsdp")
if not hasattr(torch.distributed.fsdp, "fully_shard"):
    pytest.skip("FSDP2 (fully_shard) needs torch >= 2.6", allow_module_level=True)

from debug_dist_worker import AT, FAULTS, ITERATIONS, WRAPPINGS, make_model  # noqa: E402
from test_distributed import _launch  # noqa: E402  (the launcher pattern)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "debug_dist_worker.py")
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _launch(WORLD, "gloo", str(tmp_path_factory.mktemp("debug_dist")), worker=WORKER)


@pytest.mark.parametrize("how", WRAPPINGS)
def test_names_are_the_users(ranks, how):
    names = [name for name, _ in make_model().named_modules()]
    for rank in ranks:
        assert rank[how]["names"] == names
        assert sorted(rank[how]["nonfinite"]) == sorted(names)


@pytest.mark.parametrize("how", WRAPPINGS)
def test_each_rank_names_its_own_fault(ranks, how):
    for r, rank in enumerate(ranks):
        assert rank[how]["iterations"] == ITERATIONS
        assert rank[how]["first"] == {"iteration": AT + r, "phase": "forward",
                                      "module": FAULTS[r], "source": "module"}
        # the fault's own record is non-finite in its iteration only; the first layer, ahead
        # of it, never
        assert rank[how]["nonfinite"][FAULTS[r]] == [AT + r]
        assert rank[how]["nonfinite"]["0"] == []
