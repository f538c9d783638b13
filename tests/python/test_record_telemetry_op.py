"""record_telemetry_: a loss scaler's record of one iteration, one row of its telemetry ring
(columns: scale, found_inf, grad_stats_'s four telemetry slots, the sum of squares), at the
row the ring's position names, which the op advances (on the device)."""
import math

import pytest
import torch

from op_helpers import assert_bitwise_equal, ops, scalar, snapshot

COLUMNS = 7


def at(position, device):
    return torch.tensor([position], dtype=torch.int64, device=device)


def measured(device, sum_sq=10.5):
    # amax, subnormal count, zero count, first non-finite position (+inf: none), sum of squares
    return torch.tensor([3.25, 7.0, 11.0, math.inf, sum_sq], dtype=torch.float64, device=device)


def test_the_row_is_the_scale_the_flag_and_the_measurements(device):
    ring = torch.full((4, COLUMNS), -1.0, dtype=torch.float64, device=device)
    pass_sum = scalar(0.1, device)  # FP32: added in FP64, as add_ into the FP64 sum did
    position = at(6, device)  # six records taken: the seventh goes to row 6 mod 4
    ops.record_telemetry_(ring, position, scalar(65536.0, device), scalar(1.0, device),
                          measured(device), pass_sum)
    assert position.item() == 7
    want = torch.tensor([65536.0, 1.0, 3.25, 7.0, 11.0, math.inf, 10.5], dtype=torch.float64,
                        device=device)
    want[6] += pass_sum.double().item()
    assert_bitwise_equal([want], [ring[2]])
    assert ring[[0, 1, 3]].eq(-1.0).all()  # the other rows are untouched
    # Without a pending sum the row holds measured's own.
    ops.record_telemetry_(ring, at(0, device), scalar(2.0, device), scalar(0.0, device),
                          measured(device))
    assert ring[0].tolist() == [2.0, 0.0, 3.25, 7.0, 11.0, math.inf, 10.5]


def test_records_go_round_the_ring(device):
    """Each record takes the next row and wraps; a position below zero still names a row."""
    ring = torch.zeros(3, COLUMNS, dtype=torch.float64, device=device)
    position = at(0, device)
    for k in range(7):
        ops.record_telemetry_(ring, position, scalar(float(k), device), scalar(0.0, device),
                              measured(device))
    assert position.item() == 7
    assert ring[:, 0].tolist() == [6.0, 4.0, 5.0]  # records 6, 4 and 5 are the last three
    position = at(-1, device)
    ops.record_telemetry_(ring, position, scalar(9.0, device), scalar(0.0, device),
                          measured(device))
    assert ring[2, 0].item() == 9.0 and position.item() == 0


def test_measured_may_overlap_the_row_it_writes(device):
    """Every input is read before the row is written."""
    ring = torch.zeros(2, COLUMNS, dtype=torch.float64, device=device)
    ring[1, 2:] = measured(device)
    ops.record_telemetry_(ring, at(1, device), scalar(8.0, device), scalar(0.0, device),
                          ring[1, 2:])
    assert ring[1].tolist() == [8.0, 0.0, 3.25, 7.0, 11.0, math.inf, 10.5]
    ring[0, :5] = measured(device)
    ops.record_telemetry_(ring, at(0, device), scalar(4.0, device), scalar(1.0, device),
                          ring[0, :5])
    assert ring[0].tolist() == [4.0, 1.0, 3.25, 7.0, 11.0, math.inf, 10.5]


def test_opcheck(device):
    ring = torch.zeros(3, COLUMNS, dtype=torch.float64, device=device)
    torch.library.opcheck(ops.record_telemetry_.default,
                          (ring, at(1, device), scalar(2.0, device),
                           torch.zeros((), device=device),
                           measured(device), scalar(0.5, device)))


def test_the_versions_of_ring_and_position_are_bumped(device):
    ring = torch.zeros(3, COLUMNS, dtype=torch.float64, device=device)
    position = at(0, device)
    before = ring._version, position._version
    ops.record_telemetry_(ring, position, scalar(2.0, device), scalar(0.0, device),
                          measured(device))
    assert ring._version > before[0] and position._version > before[1]


def _bad_cases(device):
    f64 = dict(dtype=torch.float64, device=device)
    return [
        ("six columns", dict(ring=torch.zeros(3, 6, **f64)), r"shape \[capacity, 7\]"),
        ("float32 ring", dict(ring=torch.zeros(3, COLUMNS, device=device)), "float64"),
        ("1-D ring", dict(ring=torch.zeros(COLUMNS, **f64)), "shape"),
        ("no rows", dict(ring=torch.zeros(0, COLUMNS, **f64)), "at least one row"),
        ("int32 position", dict(position=torch.zeros(1, dtype=torch.int32, device=device)),
         "position"),
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
    position = at(1, device)
    call = dict(ring=ring, position=position, scale=scalar(2.0, device),
                found_inf=scalar(0.0, device), measured=measured(device),
                pass_sum_sq=scalar(1.0, device))
    before = snapshot([ring, position])
    call.update(changes)
    with pytest.raises(RuntimeError, match=message):
        ops.record_telemetry_(**call)
    assert_bitwise_equal(before, snapshot([ring, position])), what
