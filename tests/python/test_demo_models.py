"""The demo's digits CNN trained briefly under fusedamp FP16 and BF16 reaches FP32's accuracy
(within 3 percentage points on the 297 held-out images)."""
import os
import sys

import pytest
import torch

pytest.importorskip("sklearn")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python"))
import amp_models as am  # noqa: E402

TOLERANCE = 0.03


def _train(mode, device, steps=50):
    torch.manual_seed(0)
    (xtr, ytr), (xte, yte) = am.digits_data(device)
    setup = am.Setup(mode, am.DigitsCNN().to(device), lr=3e-3, weight_decay=1e-4, device=device)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ix = torch.randint(0, len(xtr), (64,), generator=g).to(device)
        setup.train_step(am.digits_loss, xtr[ix], ytr[ix])
    return am.digits_eval(setup.model, xte, yte)[1], setup


def test_digits_fusedamp_reaches_fp32_accuracy(device):
    fp32_acc, _ = _train("fp32", device)
    assert fp32_acc > 0.9  # the task is learnable in this budget: the comparison means something
    for mode in ("fusedamp-fp16", "fusedamp-bf16"):
        acc, setup = _train(mode, device)
        assert acc >= fp32_acc - TOLERANCE, (mode, acc, fp32_acc)
        assert setup.skipped_steps() <= 3, mode


def test_which_layer_run_names_the_first_layer_that_overflowed():
    """The demo's FP16 run that goes NaN: the watch names the forward of the first module (in
    the Sequential's order) whose output is non-finite, at the step the loss turns non-finite,
    and the scaler skips every step from then on."""
    import math

    from which_layer import describe, which_layer_run
    run = which_layer_run()
    first = run["first_nonfinite"]
    assert first is not None and first["phase"] == "forward"
    bad = next(k for k, v in enumerate(run["loss"]) if not math.isfinite(v))
    assert first["iteration"] == bad
    col = run["iterations"].index(bad)
    rooms = {name: row[col] for name, row in zip(run["modules"], run["forward_headroom"])}
    order = [name for name in run["modules"] if name]   # the Sequential's children, in order
    named = order.index(first["module"])
    assert rooms[first["module"]] == -math.inf
    assert all(math.isfinite(rooms[name]) for name in order[:named])
    assert all(run["skipped"][bad:])
    assert f"`{first['module']}`" in describe(run)


def test_loss_too_small_stress_run_amax_policy_learns_where_torch_rule_does_not(device):
    """The demo's "loss too small" stress run: the loss x1e-8 (eps and the clip threshold with
    it) underflows almost every FP16 gradient at torch's default scale. The amax policy must end
    where the unscaled run ends; torch's rule, whose scale stays put, must end clearly above."""
    import demo

    factor = demo.STRESS["loss too small"]["loss_factor"]
    assert factor < 1e-6  # the stress the demo shows, not a milder one

    def eval_loss(policy, loss_factor):
        run = am.policy_run("char-gpt", policy, 30, loss_factor=loss_factor, batch_size=4)
        return run["eval"]["eval_loss"], run["telemetry"]

    reference, _ = eval_loss("torch", 1.0)
    amax, amax_t = eval_loss("amax", factor)
    rule, rule_t = eval_loss("torch", factor)
    assert rule_t["underflow_fraction"][-1] > 0.9 > amax_t["underflow_fraction"][-1]
    assert abs(amax - reference) < 0.1, (amax, reference)
    assert rule > reference + 0.25, (rule, reference)
