"""Shared test setup: the devices every test body runs on, and a numerics report.

Every op/engine test is parametrised over DEVICES: the CPU always, CUDA when a GPU is
present. The largest differences from each torch reference are recorded with
``record_diff`` and printed in the terminal summary, so every run states them.
"""
import os
import sys

# inductor checks each instruction set the CPU reports by compiling a probe and loading it in
# a new Python process (~2 s each, in every process that compiles). With this set, the CPU's
# own report decides for the base sets (the same one chosen: g++ builds every set it reports);
# its extension probes (AVX512-BF16, VNNI, AMX) still run. The first compile in a process:
# 21 s -> 14 s on the 2-core Xeon. Set before torch reads it; the tests' subprocesses inherit it.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import fusedamp  # noqa: E402,F401  (registers torch.ops.fusedamp)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

_DIFFS = {}


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def one_rank_process_group(tmp_path):
    """A one-rank Gloo process group in this process (the tests that need no other ranks)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def record_diff():
    def record(name, value):
        value = float(value)
        _DIFFS[name] = max(_DIFFS.get(name, 0.0), value)

    return record


def pytest_sessionfinish(session):
    # Under pytest-xdist each worker holds its own records: hand them to the controller.
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["fusedamp_diffs"] = dict(_DIFFS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for name, value in getattr(node, "workeroutput", {}).get("fusedamp_diffs", {}).items():
        _DIFFS[name] = max(_DIFFS.get(name, 0.0), value)


def pytest_terminal_summary(terminalreporter):
    if not _DIFFS:
        return
    terminalreporter.section("fusedamp numerics: largest difference from each reference")
    for name in sorted(_DIFFS):
        terminalreporter.write_line(f"{name:<60s} {_DIFFS[name]:.3e}")
