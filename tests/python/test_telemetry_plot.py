"""fusedamp.diagnostics.plot and write_tensorboard on synthetic scaler.telemetry() records."""
import importlib.util
import math
import warnings

import pytest

from fusedamp import diagnostics
from fusedamp.diagnostics import plot, write_tensorboard

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# matplotlib is optional for fusedamp; input validation and write_tensorboard work without it.
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib not installed")


def make_telemetry(n=40, scale=2.0 ** 16, skip_every=10, step0=0):
    """A run that skips every ``skip_every``-th step (halving the scale) and grows otherwise."""
    tele = {key: [] for key in ("step", "scale", "found_inf", "skipped", "grad_norm", "amax",
                                "underflow_fraction", "first_nonfinite")}
    for i in range(n):
        overflow = i % skip_every == skip_every - 1
        tele["step"].append(step0 + i)
        tele["scale"].append(scale)
        tele["found_inf"].append(overflow)
        tele["skipped"].append(overflow)
        tele["grad_norm"].append(math.nan if overflow else 1.0 / (i + 1))
        tele["amax"].append(70000.0 if overflow else scale * 0.01)
        tele["underflow_fraction"].append(0.001 * (i % 5))
        tele["first_nonfinite"].append("fc.weight" if overflow else None)
        scale = scale / 2 if overflow else scale * 1.05
    tele["dtype_max"] = 65504.0
    return tele


def assert_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE


@needs_matplotlib
def test_plot_single_run_with_loss(tmp_path):
    tele = make_telemetry()
    tele["amax_target"] = 2.0 ** 14
    loss = [2.0 / (i + 1) for i in range(30)]  # shorter than the telemetry
    path = tmp_path / "run.png"
    assert plot(tele, path, loss=loss, title="single run") == path
    assert_png(path)


@needs_matplotlib
def test_plot_accepts_tuples_and_missing_optional_keys(tmp_path):
    tele = {key: tuple(values) for key, values in make_telemetry(12).items()
            if key not in ("step", "first_nonfinite", "dtype_max")}
    path = str(tmp_path / "tuples.png")
    assert plot(tele, path) == path
    assert_png(path)


@needs_matplotlib
def test_plot_overlay(tmp_path):
    runs = {"torch policy": make_telemetry(40),
            "amax policy": dict(make_telemetry(30, scale=2.0 ** 10, skip_every=7),
                                amax_target=2.0 ** 14)}
    loss = {"torch policy": [1.0] * 40, "amax policy": [0.5] * 25}
    path = tmp_path / "overlay.png"
    assert plot(runs, path, loss=loss) == path
    assert_png(path)


@needs_matplotlib
def test_plot_empty_telemetry(tmp_path):
    tele = {key: [] for key in ("step", "scale", "found_inf", "skipped", "grad_norm", "amax",
                                "underflow_fraction", "first_nonfinite")}
    path = tmp_path / "empty.png"
    plot(tele, path)
    assert_png(path)
    overlay_path = tmp_path / "empty_overlay.png"
    plot({"a": tele, "b": tele}, overlay_path)
    assert_png(overlay_path)


@needs_matplotlib
def test_plot_nan_zero_and_negative_values(tmp_path):
    n = 6
    tele = make_telemetry(n)
    tele["grad_norm"] = [math.nan] * n  # nothing positive on a log axis
    tele["amax"] = [0.0, -1.0, math.inf, math.nan, 1.0, 2.0]
    tele["scale"] = [0.0, 1.0, 2.0, math.nan, 4.0, 8.0]
    tele["underflow_fraction"] = [math.nan] + [0.0] * (n - 1)
    tele["amax_target"] = None
    path = tmp_path / "nan.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # masked values must not make matplotlib complain
        plot(tele, path, loss=[math.nan, 1.0, math.inf])
    assert_png(path)


@pytest.mark.parametrize("break_it", ["length", "missing", "not_a_list", "dtype_max", "long_loss",
                                      "mixed_overlay", "overlay_loss_label"])
def test_plot_bad_input_raises_and_writes_nothing(tmp_path, break_it):
    tele = make_telemetry(10)
    loss = None
    if break_it == "length":
        tele["amax"] = tele["amax"][:-1]
    elif break_it == "missing":
        del tele["underflow_fraction"]
    elif break_it == "not_a_list":
        tele["scale"] = 1.0
    elif break_it == "dtype_max":
        tele["dtype_max"] = [65504.0]
    elif break_it == "long_loss":
        loss = [1.0] * 11
    elif break_it == "mixed_overlay":
        tele = {"run": make_telemetry(10), "scale": [1.0] * 10}
    elif break_it == "overlay_loss_label":
        tele = {"run": tele}
        loss = {"other run": [1.0]}
    path = tmp_path / "bad.png"
    with pytest.raises(ValueError):
        plot(tele, path, loss=loss)
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


class FakeWriter:
    def __init__(self):
        self.calls = []

    def add_scalar(self, tag, value, step):
        self.calls.append((tag, value, step))


def test_write_tensorboard_exact_calls():
    tele = {
        "step": [7, 8],
        "scale": [1024.0, 512.0],
        "found_inf": [False, True],
        "skipped": [False, True],
        "grad_norm": [0.5, math.nan],
        "amax": [3.0, math.nan],
        "underflow_fraction": [0.25, 0.0],
        "first_nonfinite": [None, "fc.weight"],
        "dtype_max": 65504.0,
    }
    writer = FakeWriter()
    assert write_tensorboard(tele, writer) == 10
    assert writer.calls == [
        ("fusedamp/scale", 1024.0, 7),
        ("fusedamp/grad_norm", 0.5, 7),
        ("fusedamp/amax", 3.0, 7),
        ("fusedamp/underflow_fraction", 0.25, 7),
        ("fusedamp/found_inf", 0, 7),
        ("fusedamp/skipped", 0, 7),
        ("fusedamp/scale", 512.0, 8),
        ("fusedamp/underflow_fraction", 0.0, 8),
        ("fusedamp/found_inf", 1, 8),
        ("fusedamp/skipped", 1, 8),
    ]


def test_write_tensorboard_steps_from_start_and_prefix():
    tele = {key: values for key, values in make_telemetry(3, skip_every=100).items()
            if key != "step"}
    writer = FakeWriter()
    assert write_tensorboard(tele, writer, start=100, prefix="amp") == 18
    assert [step for _, _, step in writer.calls] == [100] * 6 + [101] * 6 + [102] * 6
    assert all(tag.startswith("amp/") for tag, _, _ in writer.calls)
    assert writer.calls[6] == ("amp/scale", tele["scale"][1], 101)


def test_write_tensorboard_empty_and_bad_input():
    empty = {key: [] for key in ("scale", "found_inf", "skipped", "grad_norm", "amax",
                                 "underflow_fraction")}
    writer = FakeWriter()
    assert write_tensorboard(empty, writer) == 0
    assert writer.calls == []
    bad = dict(make_telemetry(4), skipped=[False] * 3)
    with pytest.raises(ValueError, match="differ in length"):
        write_tensorboard(bad, writer)
    with pytest.raises(ValueError, match="missing"):
        write_tensorboard({"scale": [1.0]}, writer)
    assert writer.calls == []


def test_draw_panel_on_a_figure_of_ones_own(tmp_path):
    """Each panel of plot() can be drawn on a caller's Axes (the demo composes its figure)."""
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = {"torch": make_telemetry(), "amax": make_telemetry(scale=2.0 ** 10)}
    fig = Figure()
    axes = fig.subplots(1, len(diagnostics.PANELS))
    for ax, key in zip(axes, diagnostics.PANELS):
        diagnostics.draw_panel(ax, runs, key, loss={"amax": [1.0, 0.5]})
    FigureCanvasAgg(fig)
    fig.savefig(tmp_path / "own.png")
    assert (tmp_path / "own.png").read_bytes().startswith(b"\x89PNG")
    scale_ax = axes[diagnostics.PANELS.index("scale")]
    assert scale_ax.get_yscale() == "log" and len(scale_ax.get_lines()) >= 2
    with pytest.raises(ValueError, match="key must be one of"):
        diagnostics.draw_panel(axes[0], runs, "temperature")


def test_write_tensorboard_writes_the_subnormal_fraction():
    tele = {"scale": [8.0], "found_inf": [False], "skipped": [False], "grad_norm": [1.0],
            "amax": [2.0], "underflow_fraction": [0.5], "subnormal_fraction": [0.125]}
    writer = FakeWriter()
    assert write_tensorboard(tele, writer, start=3) == 7
    assert ("fusedamp/subnormal_fraction", 0.125, 3) in writer.calls
