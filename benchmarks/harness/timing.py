"""Calls timed in turns. The machines these benchmarks run on are shared and their speed drifts
over a run by more than the sides of a comparison differ: every side is called once per round,
so a slow spell falls on all of them alike, and a result is a median (or a ratio of medians)."""
from __future__ import annotations

import gc
import math
import random
import statistics
import time
from typing import Callable, Hashable, Iterable

import torch


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def turns(keys: Iterable[Hashable], rounds: int, order=None):
    """Each key once per round, `rounds` times: in the given order (order None), rotated by one
    place each round (order "rotate": no key always runs first, after the same one), or shuffled
    anew each round by random.Random(order) (an int: a call also inherits its predecessor's
    cache state, and a fixed cycle would give each side always the same predecessor)."""
    keys = list(keys)
    rng = random.Random(order) if isinstance(order, int) else None
    for r in range(rounds):
        if rng is not None:
            yield from rng.sample(keys, len(keys))
        elif order == "rotate":
            k = r % len(keys)
            yield from keys[k:] + keys[:k]
        else:
            yield from keys


def time_in_turns(calls: dict[Hashable, Callable[[], object]], rounds: int, warmup: int = 0,
                  order=None, reset: dict | None = None, device="cpu", until_done=False,
                  gc_off=False):
    """{key: (wall ns of each call, CUDA-event ns of each call or None)} for the calls, taken
    in turns (see turns). reset[key], where given, runs before each call, untimed. The wall time
    is that of issuing the call, the stream drained before it; until_done adds the wait for the
    device to finish (one clock for every device). warmup rounds run first, untimed, in the
    given order. gc_off: the garbage collector off while timing, as in timeit (a collection is
    noise, not a cost of the call)."""
    reset = reset or {}
    cuda = device == "cuda"
    keys = list(calls)
    wall = {k: [] for k in keys}
    events = {k: [] for k in keys}
    for key in turns(keys, warmup):
        if key in reset:
            reset[key]()
        calls[key]()
    sync(device)
    if gc_off:
        gc.collect()
        gc.disable()
    try:
        for key in turns(keys, rounds, order):
            if key in reset:
                reset[key]()
            sync(device)
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter_ns()
            calls[key]()
            if until_done:
                sync(device)
            wall[key].append(time.perf_counter_ns() - t0)
            if cuda:
                end.record()
                events[key].append((start, end))
        sync(device)
    finally:
        if gc_off:
            gc.enable()
    return {k: (wall[k], [a.elapsed_time(b) * 1e6 for a, b in events[k]] if cuda else None)
            for k in keys}


def percentile(xs, q):
    """The q-quantile of xs, linearly interpolated between the two nearest ranks."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def quartiles(xs):
    """(25th, 75th percentile) as statistics.quantiles gives them; a lone value for both."""
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def paired_ratio(times, base):
    """The median over rounds of each round's time over the base's of the same round: the
    machine's load, which drifts over a run, cancels out."""
    return statistics.median(a / b for a, b in zip(times, base))


def fmt_ms(seconds):
    """A time in ms with the digits that mean something at its size."""
    ms = seconds * 1e3
    return f"{ms:.3f}" if seconds < 0.01 else f"{ms:.1f}" if seconds < 10 else f"{ms:.0f}"
