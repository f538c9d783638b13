"""Data-parallel training with fusedamp: DDP over a fusedamp.initialize'd model on 2 and 3
processes that this module launches itself (Gloo on the CPU; NCCL with one rank per GPU when at
least two GPUs are present). Every rank runs distributed_worker.py; the checks here compare the
ranks with each other and with a single-process run of the same global batch. ``_launch`` is
also the launcher of the ZeRO-1 and FSDP2 tests.

Numerics: the gradients are FP16 tensors computed from a different split of the batch and
summed in FP16 (as DDP does), so the runs agree to FP16 gradient rounding, amplified by Adam
where a gradient is near zero: the tolerance below is set from that, and every run prints the
largest difference it saw.
"""
import os
import subprocess
import sys
import time

import pytest
import torch

from distributed_worker import INF_STEP, STEPS, reference_run

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_worker.py")
PYTHON_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "python"))
LAUNCH_TIMEOUT_S = 150  # a hang fails the test instead of blocking CI

BACKENDS = [
    pytest.param(("gloo", "cpu"), id="gloo-cpu"),
    pytest.param(("nccl", "cuda"), id="nccl-cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2
        or not torch.distributed.is_nccl_available(),
        reason="NCCL tests need at least 2 CUDA GPUs (one rank per GPU)")),
]
WORLDS = (2, 3)

TOL_FP16 = 2e-3  # FP16 model vs single process (see the module doc): the model weights


def _launch(world, backend, out_dir, load_path="", worker=WORKER):
    """Starts `world` ranks of `worker`, waits for all of them (bounded) and returns their
    results."""
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
    init_file = os.path.join(out_dir, "rendezvous")
    procs, logs = [], []
    for rank in range(world):
        log = open(os.path.join(out_dir, f"log{rank}.txt"), "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, worker, str(rank), str(world), init_file, backend, out_dir]
            + ([load_path] if load_path else []), stdout=log, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        timed_out = [p for p in procs if p.poll() is None]
        for p in timed_out:
            p.kill()
            p.wait()
        for log in logs:
            log.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = []
        for r in failed:
            with open(os.path.join(out_dir, f"log{r}.txt")) as f:
                tails.append(f"--- rank {r} ---\n" + f.read()[-3000:])
        what = "timed out" if timed_out else "failed"
        pytest.fail(f"{world} ranks ({backend}) {what}:\n" + "\n".join(tails))
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


@pytest.fixture(scope="module", params=BACKENDS)
def runs(request, tmp_path_factory):
    """{world: [per-rank results]}, "device": the single process's device."""
    backend, device = request.param
    base = tmp_path_factory.mktemp(f"dist_{backend}")
    out = {world: _launch(world, backend, str(base / f"w{world}")) for world in WORLDS}
    out["device"] = "cuda:0" if device == "cuda" else "cpu"
    return out


_REFS = {}


def _reference(device):
    if device not in _REFS:
        _REFS[device] = reference_run(device)
    return _REFS[device]


def _max_diff(a, b):
    return max((x.float().cpu() - y.float().cpu()).abs().max().item() for x, y in zip(a, b))


def _assert_ranks_identical(results, get):
    first = get(results[0])
    for r, res in enumerate(results[1:], start=1):
        for step, (a, b) in enumerate(zip(first, get(res))):
            for i, (x, y) in enumerate(zip(a, b)):
                assert torch.equal(x, y), f"rank {r} differs from rank 0: step {step}, param {i}"


# ----------------------------------------------------------------------------------- DDP
@pytest.mark.parametrize("world", WORLDS)
def test_ddp_matches_single_process_and_skips_together(runs, world, record_diff):
    results = runs[world]
    ref = _reference(runs["device"])
    _assert_ranks_identical(results, lambda r: r["ddp"]["run"]["params"])
    for r in results:
        run = r["ddp"]["run"]
        assert run["scales"] == ref["scales"]  # same scale sequence on every rank
        assert run["applied"] == ref["applied"]
        assert run["applied"][INF_STEP] == 0.0 and sum(run["applied"]) == STEPS - 1
        # The skipped step changed nothing, bit for bit.
        for a, b in zip(run["params"][INF_STEP - 1], run["params"][INF_STEP]):
            assert torch.equal(a, b)
    d = _max_diff(results[0]["ddp"]["run"]["params"][-1], ref["params"][-1])
    record_diff(f"distributed: DDP FP16 {world} ranks vs 1 process (params)", d)
    assert d <= TOL_FP16, d
    assert ref["scales"][INF_STEP] < ref["scales"][INF_STEP - 1]  # the reference did back off


@pytest.mark.parametrize("world", WORLDS)
def test_ddp_checkpoint_loaded_on_every_rank(runs, world, record_diff):
    """Every rank loads rank 0's checkpoint into a fresh model and DDP wrapper: the ranks stay
    identical, and the run continues as the uninterrupted one. Bit-exact on 2 ranks; on 3, a
    fresh DDP's gradient buckets (before its first-iteration rebuild) split the FP16 all-reduce
    differently from the running one, so the sum is rounded in another order."""
    results = runs[world]
    _assert_ranks_identical(results, lambda r: r["ddp"]["resumed"]["params"])
    for r in results:
        assert r["ddp"]["cont"]["scales"] == r["ddp"]["resumed"]["scales"]
        d = _max_diff(r["ddp"]["cont"]["params"][-1], r["ddp"]["resumed"]["params"][-1])
        record_diff(f"distributed: DDP FP16 {world} ranks resumed vs uninterrupted", d)
        if world == 2:
            for a, b in zip(r["ddp"]["cont"]["params"], r["ddp"]["resumed"]["params"]):
                assert all(torch.equal(x, y) for x, y in zip(a, b))
        else:
            assert d <= TOL_FP16, d
