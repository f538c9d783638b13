"""The per-step records that the scaler's telemetry replaced, kept for one release: the scaler's
scale_history() and history=, and the optimizers' grad_norm_history(), each warning and reading
the telemetry as their docstrings say; and scalers pickled by earlier versions, which carried a
scale history of their own, still load."""
import base64
import gc
import math
import pickle
import warnings

import pytest
import torch

import fusedamp
import fusedamp.diagnostics
import fusedamp.optim

SCALE_WARNING = r"scale_history\(\) is deprecated: read scaler.telemetry\(\)\['scale'\]"
NORM_WARNING = r"grad_norm_history\(\) is deprecated: read scaler.telemetry\(\)\['grad_norm'\]"


def _iterate(scaler, opt, param, overflow=False, new_scale=None):
    """One iteration: scale, a gradient of ones once unscaled (inf where `overflow`), step,
    update (or update(new_scale))."""
    scaler.scale(torch.ones((), device=param.device))
    param.grad = torch.full(param.shape, math.inf if overflow else scaler.get_scale(),
                            device=param.device).to(param.dtype)
    scaler.step(opt)
    if new_scale is None:
        scaler.update()
    else:
        scaler.update(new_scale)


def _scale_history(scaler):
    with pytest.warns(DeprecationWarning, match=SCALE_WARNING):
        return scaler.scale_history()


def _grad_norm_history(opt):
    with pytest.warns(DeprecationWarning, match=NORM_WARNING):
        return opt.grad_norm_history()


def _same_floats(a, b):
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b))


# ---- GradScaler.scale_history() -------------------------------------------------------------
def test_scale_history_is_the_scale_after_each_recorded_update(device):
    """The scale after each update(), derived from the telemetry: the next recorded
    iteration's scale, the current scale for the last. An update(new_scale) records no
    iteration: it adds no entry, and the entry before it reads new_scale."""
    param = torch.nn.Parameter(torch.zeros(4, device=device).half())
    opt = fusedamp.optim.AdamW([param], lr=1e-3)
    scaler = fusedamp.GradScaler(device, init_scale=2.0 ** 10, growth_interval=2)
    assert _scale_history(scaler) == []  # before the first update
    after = []
    for step in range(5):
        _iterate(scaler, opt, param, overflow=step == 2, new_scale=100.0 if step == 3 else None)
        after.append(scaler.get_scale())
    assert after == [1024.0, 2048.0, 1024.0, 100.0, 100.0]
    carried = scaler.telemetry()["scale"]
    assert carried == [1024.0, 1024.0, 2048.0, 100.0]  # iterations 0, 1, 2 and 4
    assert _scale_history(scaler) == [after[0], after[1], 100.0, after[4]]
    assert _scale_history(scaler) == carried[1:] + [scaler.get_scale()]


def test_scale_history_is_empty_without_telemetry_and_keeps_its_capacity(device):
    param = torch.nn.Parameter(torch.zeros(4, device=device))
    opt = fusedamp.optim.SGD([param], lr=0.0)
    quiet = fusedamp.GradScaler(device, telemetry=False)
    disabled = fusedamp.GradScaler(device, enabled=False)
    short = fusedamp.GradScaler(device, init_scale=8.0, growth_interval=1, telemetry_capacity=3)
    for _ in range(5):
        for scaler in (quiet, disabled, short):
            _iterate(scaler, opt, param)
    assert _scale_history(quiet) == [] and _scale_history(disabled) == []
    assert _scale_history(short) == [64.0, 128.0, 256.0]  # the last three of 16 ... 256


def test_scale_history_starts_again_after_a_pickle(device):
    """The telemetry is a diagnostic that does not travel with a pickle, and the history
    derived from it neither."""
    param = torch.nn.Parameter(torch.zeros(4, device=device))
    opt = fusedamp.optim.SGD([param], lr=0.0)
    scaler = fusedamp.GradScaler(device, init_scale=8.0, growth_interval=1)
    _iterate(scaler, opt, param)
    restored = pickle.loads(pickle.dumps(scaler))
    assert restored.get_scale() == 16.0 and _scale_history(restored) == []
    _iterate(restored, opt, param)
    assert _scale_history(restored) == [32.0]


def test_the_history_argument_warns_and_changes_nothing(device):
    param = torch.nn.Parameter(torch.zeros(4, device=device))
    opt = fusedamp.optim.SGD([param], lr=0.0)
    scalers = []
    for history in (False, True, None):
        with pytest.warns(DeprecationWarning, match=r"GradScaler\(history=...\) is deprecated "
                                                    r"and has no effect"):
            scalers.append(fusedamp.GradScaler(device, init_scale=8.0, history=history))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        scalers.append(fusedamp.GradScaler(device, init_scale=8.0))
    for scaler in scalers:
        _iterate(scaler, opt, param)
        assert scaler.telemetry()["scale"] == [8.0]  # recorded alike, history=False too
        assert _scale_history(scaler) == [8.0]


# ---- optimizer.grad_norm_history() ------------------------------------------------------------
def test_grad_norm_history_is_the_telemetry_of_the_scaler_that_last_stepped(device):
    param = torch.nn.Parameter(torch.zeros(4, device=device))
    opt = fusedamp.optim.SGD([param], lr=0.0, max_grad_norm=1e30)
    param.grad = torch.ones(4, device=device)
    opt.step()
    assert _grad_norm_history(opt) == []  # no scaler stepped it

    first = fusedamp.GradScaler(device, init_scale=4.0)
    for overflow in (False, True, False):
        _iterate(first, opt, param, overflow)
    norms = _grad_norm_history(opt)
    assert _same_floats(norms, first.telemetry()["grad_norm"])
    # Four unscaled gradient elements of 1 (the overflow's are inf): norms of 2.
    assert norms[0] == norms[2] == 2.0 and not math.isfinite(norms[1])

    second = fusedamp.GradScaler(device, init_scale=2.0)
    _iterate(second, opt, param)
    assert _grad_norm_history(opt) == second.telemetry()["grad_norm"] == [2.0]

    disabled = fusedamp.GradScaler(device, enabled=False)
    _iterate(disabled, opt, param)
    assert _grad_norm_history(opt) == []  # the last scaler records nothing

    _iterate(second, opt, param)
    del second, disabled
    gc.collect()
    assert _grad_norm_history(opt) == []  # the scaler that last stepped it is gone


def test_an_optimizer_stepped_by_a_scaler_still_pickles(device):
    param = torch.nn.Parameter(torch.zeros(4, device=device))
    opt = fusedamp.optim.SGD([param], lr=0.0)
    scaler = fusedamp.GradScaler(device, init_scale=4.0)
    _iterate(scaler, opt, param)
    assert _grad_norm_history(opt) == [2.0]
    restored = pickle.loads(pickle.dumps(opt))  # the reference to the scaler stays behind
    assert _grad_norm_history(restored) == []


# ---- pickles of earlier versions ----------------------------------------------------------------
# A fusedamp.GradScaler("cpu", init_scale=2**10, growth_interval=2) after three iterations
# (the second overflowed), pickled by the version whose scaler kept a scale-history ring: 14
# engine arguments (the last turned the ring on) and the ring's values, [1024, 512, 512].
RING_PICKLE = base64.b64decode(
    "gASVPwMAAAAAAACMFGZ1c2VkYW1wLmdyYWRfc2NhbGVylIwKR3JhZFNjYWxlcpSTlCmBlH2UKIwHX2RldmljZZSMBXRvcmNo"
    "lIwGZGV2aWNllJOUjANjcHWUhZRSlIwIX2VuYWJsZWSUiIwMX2VuZ2luZV9hcmdzlCiMA2NwdZRHQJAAAAAAAABHQAAAAAAA"
    "AABHP+AAAAAAAABLAohLAU5OaAZOiE0AEIh0lIwSX3JlY29yZHNfdGVsZW1ldHJ5lIiMC19zdGF0ZV9kaWN0lH2UKIwFc2Nh"
    "bGWUR0CAAAAAAAAAjA1ncm93dGhfZmFjdG9ylEdAAAAAAAAAAIwOYmFja29mZl9mYWN0b3KURz/gAAAAAAAAjA9ncm93dGhf"
    "aW50ZXJ2YWyUSwKMD19ncm93dGhfdHJhY2tlcpRLAYwKaHlzdGVyZXNpc5RLAYwTX2h5c3RlcmVzaXNfdHJhY2tlcpRLAYwJ"
    "bWluX3NjYWxllE6MCW1heF9zY2FsZZROjAZwb2xpY3mUjAV0b3JjaJSMC2FtYXhfdGFyZ2V0lEdAb/wAAAAAAHWMDl9zY2Fs"
    "ZV9oaXN0b3J5lIwMdG9yY2guX3V0aWxzlIwSX3JlYnVpbGRfdGVuc29yX3YylJOUKIwNdG9yY2guc3RvcmFnZZSMEF9sb2Fk"
    "X2Zyb21fYnl0ZXOUk5RCBwEAAIACigps/JxG+SBqqFAZLoACTekDLoACfXEAKFgQAAAAcHJvdG9jb2xfdmVyc2lvbnEBTekD"
    "WA0AAABsaXR0bGVfZW5kaWFucQKIWAoAAAB0eXBlX3NpemVzcQN9cQQoWAUAAABzaG9ydHEFSwJYAwAAAGludHEGSwRYBAAA"
    "AGxvbmdxB0sEdXUugAIoWAcAAABzdG9yYWdlcQBjdG9yY2gKRmxvYXRTdG9yYWdlCnEBWA4AAAA5NDUyMzE1NDU5OTMyOHEC"
    "WAMAAABjcHVxA0sDTnRxBFEugAJdcQBYDgAAADk0NTIzMTU0NTk5MzI4cQFhLgMAAAAAAAAAAACARAAAAEQAAABElIWUUpRL"
    "AEsDhZRLAYWUiYwLY29sbGVjdGlvbnOUjAtPcmRlcmVkRGljdJSTlClSlHSUUpR1Yi4=")


def _check_restored(restored, scale, growth_tracker, **made_with):
    assert restored.get_scale() == scale
    assert restored.state_dict()["_growth_tracker"] == growth_tracker
    assert not hasattr(restored, "_scale_history") and not hasattr(restored, "_history")
    # The pickled tuple of engine arguments, the scale-history flag left out, builds the
    # engine the scaler had.
    assert not hasattr(restored, "_engine_args")
    assert restored._engine_options == fusedamp.GradScaler("cpu", **made_with)._engine_options
    assert _scale_history(restored) == []  # the old history is dropped
    param = torch.nn.Parameter(torch.zeros(4))
    _iterate(restored, fusedamp.optim.SGD([param], lr=0.0), param)
    assert restored.telemetry()["scale"] == [scale]  # and the telemetry records from here on


def test_a_scaler_pickled_with_a_scale_history_ring_loads():
    restored = pickle.loads(RING_PICKLE)
    _check_restored(restored, scale=512.0, growth_tracker=1, init_scale=2.0 ** 10,
                    growth_interval=2)


@pytest.mark.parametrize("recorded", [[1024.0, 512.0, 1024.0], None])
def test_a_scaler_pickled_with_a_python_history_loads(monkeypatch, recorded):
    """Older still: 13 engine arguments and the scale history as a Python
    fusedamp.diagnostics.History (`_history`; None where history=False)."""
    scaler = fusedamp.GradScaler("cpu", init_scale=2.0 ** 10)
    state = scaler.__getstate__()
    del state["_engine_options"]  # the 13 engine arguments of that version, by position:
    state["_engine_args"] = ("cpu", 2.0 ** 10, 2.0, 0.5, 2000, True, 1, None, None, "torch",
                             None, True, 4096)
    old = None
    if recorded is not None:
        old = fusedamp.diagnostics.History()
        old.__dict__.update(capacity=100_000, _buf=torch.tensor(recorded), _n=len(recorded))
    state["_history"] = old
    monkeypatch.setattr(fusedamp.GradScaler, "__getstate__", lambda self: dict(state))
    data = pickle.dumps(scaler)
    monkeypatch.undo()
    assert b"fusedamp.diagnostics" in data or recorded is None
    _check_restored(pickle.loads(data), scale=1024.0, growth_tracker=0, init_scale=2.0 ** 10)


def test_history_is_no_longer_public():
    assert not hasattr(fusedamp, "History")
    assert "History" not in fusedamp.diagnostics.__all__
