"""What every rank of the multi-process tests (the *_worker.py scripts) does around its own
work: join the process group its launcher names, catch the refusals the tests assert on, and
hand its results back as OUT_DIR/rank{RANK}.pt once every rank is done. Not a test module
itself.
"""
from __future__ import annotations

import datetime
import os

import torch


def join(rank, world, init_file, backend, timeout_s=60, one_thread=True):
    """Joins the process group through INIT_FILE (the launcher's file:// rendezvous), by default
    with one torch thread per rank, so that ranks sharing a few cores compute as one process
    would; returns rank and world as ints."""
    import torch.distributed as dist

    rank, world = int(rank), int(world)
    if one_thread:
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world


def error_text(call, error_type):
    """The message of the error_type that call() raises, None where it raises none: the test
    process asserts on it (an exception would end the rank and hang the others)."""
    try:
        call()
    except error_type as e:
        return str(e)
    return None


def finish(out, out_dir, rank):
    """Saves this rank's results for the test process, then leaves the group once every rank
    has saved (a rank leaving early would fail the others' last collective)."""
    import torch.distributed as dist

    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
