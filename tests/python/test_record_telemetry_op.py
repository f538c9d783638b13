"""record_telemetry_: a loss scaler's record of one iteration, one row of its telemetry ring
(columns: scale, found_inf, grad_stats_'s four telemetry slots, the sum of squares)."""
import math

import pytest
import torch

from op_helpers import assert_bitwise_equal, ops, scalar, snapshot

COLUMNS = 7


def measured(device, sum_sq=10.5):
    # amax, subnormal count, zero count, first non-finite position (+inf: none), sum of squares
    return torch.tensor([3.25, 7.0, 11.0, math.inf, sum_sq], dtype=torch.float64, device=device)


def test_the_row_is_the_scale_the_flag_and_the_measurements(device):
    ring = torch.full((4, COLUMNS), -1.0, dtype=torch.float64, device=device)
    pass_sum = scalar(0.1, device)  # FP32: added in FP64, as add_ into the FP64 sum did
    ops.record_telemetry_(ring, 2, scalar(65536.0, device), scalar(1.0, device),
                          measured(device), pass_sum)
    want = torch.tensor([65536.0, 1.0, 3.25, 7.0, 11.0, math.inf, 10.5], dtype=torch.float64,
                        device=device)
    want[6] += pass_sum.double().item()
    assert_bitwise_equal([want], [ring[2]])
    assert ring[[0, 1, 3]].eq(-1.0).all()  # the other rows are untouched
    # Without a pending sum the row holds measured's own.
    ops.record_telemetry_(ring, 0, scalar(2.0, device), scalar(0.0, device), measured(device))
    assert ring[0].tolist() == [2.0, 0.0, 3.25, 7.0, 11.0, math.inf, 10.5]


def test_measured_may_overlap_the_row_it_writes(device):
    """Every input is read before the row is written."""
    ring = torch.zeros(2, COLUMNS, dtype=torch.float64, device=device)
    ring[1, 2:] = measured(device)
    ops.record_telemetry_(ring, 1, scalar(8.0, device), scalar(0.0, device), ring[1, 2:])
    assert ring[1].tolist() == [8.0, 0.0, 3.25, 7.0, 11.0, math.inf, 10.5]
    ring[0, :5] = measured(device)
    ops.record_telemetry_(ring, 0, scalar(4.0, device), scalar(1.0, device), ring[0, :5])
    assert ring[0].tolist() == [4.0, 1.0, 3.25, 7.0, 11.0, math.inf, 10.5]


def test_opcheck(device):
    ring = torch.zeros(3, COLUMNS, dtype=torch.float64, device=device)
    torch.library.opcheck(ops.record_telemetry_.default,
                          (ring, 1, scalar(2.0, device), torch.zeros((), device=device),
                           measured(device), scalar(0.5, device)))


def test_the_rings_version_is_bumped(device):
    ring = torch.zeros(3, COLUMNS, dtype=torch.float64, device=device)
    before = ring._version
    ops.record_telemetry_(ring, 0, scalar(2.0, device), scalar(0.0, device), measured(device))
    assert ring._version > before


def _bad_cases(device):
    f64 = dict(dtype=torch.float64, device=device)
    return [
        ("six columns", dict(ring=torch.zeros(3, 6, **f64)), r"shape \[capacity, 7\]"),
        ("float32 ring", dict(ring=torch.zeros(3, COLUMNS, device=device)), "float64"),
        ("1-D ring", dict(ring=torch.zeros(COLUMNS, **f64)), "shape"),
        ("slot past the end", dict(slot=3), "slot 3 is outside ring"),
        ("negative slot", dict(slot=-1), "slot -1 is outside ring"),
        ("float64 scale", dict(scale=torch.ones(1, **f64)), "scale"),
        ("two-element found_inf", dict(found_inf=torch.zeros(2, device=device)), "found_inf"),
        ("four measurements", dict(measured=torch.zeros(4, **f64)), "5 elements"),
        ("float32 measurements", dict(measured=torch.zeros(5, device=device)), "measured"),
        ("float64 pass_sum_sq", dict(pass_sum_sq=torch.ones(1, **f64)), "pass_sum_sq"),
        ("scale on the meta device", dict(scale=torch.ones(1, device="meta")), "scale"),
    ]


@pytest.mark.parametrize("case", range(11))
def test_bad_input_raises_and_changes_nothing(device, case):
    what, changes, message = _bad_cases(device)[case]
    ring = torch.zeros(3, COLUMNS, dtype=torch.float64, device=device)
    call = dict(ring=ring, slot=1, scale=scalar(2.0, device), found_inf=scalar(0.0, device),
                measured=measured(device), pass_sum_sq=scalar(1.0, device))
    before = snapshot([ring])
    call.update(changes)
    with pytest.raises(RuntimeError, match=message):
        ops.record_telemetry_(**call)
    assert_bitwise_equal(before, snapshot([ring])), what
