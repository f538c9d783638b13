"""fusedamp.debug.watch's write_tensorboard: the per-iteration values of every module as
scalars, the first non-finite as text, the heat map as a figure; into a SummaryWriter (read
back from its event file) or any writer with the same methods; a clear error without the
tensorboard package."""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import fusedamp  # noqa: E402
from debug_models import MODELS, fault_of  # noqa: E402

AT = 3
TAG = "fusedamp.debug"


class RecordingWriter:
    """The SummaryWriter methods write_tensorboard calls, kept in dicts."""

    def __init__(self):
        self.scalars, self.texts, self.figures = {}, {}, {}

    def add_scalar(self, tag, value, step):
        assert (tag, step) not in self.scalars, "written twice"
        self.scalars[tag, step] = value

    def add_text(self, tag, text, step):
        self.texts[tag, step] = text

    def add_figure(self, tag, figure, step):
        self.figures[tag, step] = figure


@pytest.fixture(scope="module")
def watched():
    """A watch over 6 iterations of the MLP, with a forward inf in its fault at AT."""
    torch.manual_seed(0)
    name, build, make_input = MODELS["mlp"]
    model = build()
    with fusedamp.debug.watch(model) as w:
        for i in range(6):
            fault_of(model, "mlp").inject(**(dict(forward=float("inf")) if i == AT else {}))
            model(make_input()).square().mean().backward()
            model.zero_grad()
    return w, name


def test_scalars_are_the_history(watched):
    w, name = watched
    writer = RecordingWriter()
    assert w.write_tensorboard(writer) is writer
    h = w.history()
    written = 0
    for m, module in enumerate(h["modules"]):
        label = module or "(root)"
        for col, it in enumerate(h["iterations"]):
            for key, history_key in (("forward_headroom_bits", "forward_headroom"),
                                     ("backward_headroom_bits", "backward_headroom"),
                                     ("underflow_fraction", "underflow_fraction")):
                value = h[history_key][m][col]
                got = writer.scalars.get((f"{TAG}/{key}/{label}", it))
                if value is None or not math.isfinite(value):
                    assert got is None   # not measured, or non-finite: left out
                else:
                    assert got == value
                    written += 1
    assert written > 0
    # amax: each module's largest over the iterations is report()'s
    for row in w.report():
        label = row["module"] or "(root)"
        for key in ("forward_amax", "backward_amax"):
            values = [v for (tag, _), v in writer.scalars.items() if tag == f"{TAG}/{key}/{label}"]
            assert max(values, default=None) == row[key]
    # the fault's forward headroom is missing exactly at AT (its output is non-finite there)
    fault_steps = sorted(s for t, s in writer.scalars if t == f"{TAG}/forward_headroom_bits/{name}")
    assert fault_steps == [i for i in h["iterations"] if i != AT]
    text = writer.texts[f"{TAG}/first_nonfinite", AT]
    assert f"`{name}`" in text and "forward" in text and str(AT) in text
    assert list(writer.figures) == [(f"{TAG}/heat_map", h["iterations"][-1])]


def test_summary_writer_event_file(watched, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    w, name = watched
    logdir = tmp_path / "run"
    assert w.write_tensorboard(str(logdir)) == str(logdir)
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    recorded = RecordingWriter()
    w.write_tensorboard(recorded)
    tags = events.Tags()
    assert sorted(tags["scalars"]) == sorted({t for t, _ in recorded.scalars})
    for (tag, step), value in recorded.scalars.items():
        got = {e.step: e.value for e in events.Scalars(tag)}
        assert got[step] == pytest.approx(value, rel=1e-6)   # stored as FP32
    text = events.Tensors(f"{TAG}/first_nonfinite/text_summary")
    assert [e.step for e in text] == [AT]
    assert name in text[0].tensor_proto.string_val[0].decode()
    assert tags["images"] == [f"{TAG}/heat_map"]


def test_without_tensorboard_the_error_names_the_package(watched, tmp_path, monkeypatch):
    w, _ = watched
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)   # import fails
    with pytest.raises(ImportError, match=r"tensorboard package \(pip install tensorboard\)"):
        w.write_tensorboard(str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    w.write_tensorboard(RecordingWriter())   # a writer object needs no package


def test_bad_writer(watched):
    w, _ = watched
    with pytest.raises(TypeError, match="add_scalar, add_text"):
        w.write_tensorboard(object())
    with pytest.raises(TypeError, match="add_text"):
        w.write_tensorboard(type("W", (), {"add_scalar": lambda *a: None})())
