"""The two training tasks of the storage-format studies (moment_formats.py, momentum_formats.py):
the demo's digits CNN and character GPT with a seed's weights and batches, and the
teacher-forced comparison of a reference optimizer with torch's on the same gradients."""
from __future__ import annotations

from dataclasses import dataclass

import torch

import harness

harness.use_paths("python", "examples")
from amp_models import (CharGPT, DigitsCNN, char_batch, char_data, char_eval,  # noqa: E402
                        char_loss, digits_data, digits_eval, digits_loss)


@dataclass
class TaskSpec:
    model: str
    lr: float
    batch: int
    steps: int


def make_task(spec, seed):
    """(model, next_batch(), loss_fn, evaluate() -> dict) with seed's weights and batches."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    if spec.model == "digits-cnn":
        (xtr, ytr), (xte, yte) = digits_data("cpu")
        model = DigitsCNN()

        def batch():
            ix = torch.randint(0, len(xtr), (spec.batch,), generator=g)
            return xtr[ix], ytr[ix]

        def evaluate():
            loss, acc = digits_eval(model, xte, yte)
            return {"heldout_loss": loss, "accuracy": acc}

        return model, batch, digits_loss, evaluate
    if spec.model == "char-gpt":
        context = 64
        train, val, vocab = char_data("cpu", context)
        model = CharGPT(vocab, context, dim=128, layers=2, heads=4)

        def batch():
            return char_batch(train, spec.batch, context, g)

        def evaluate():
            model.eval()
            loss, _ = char_eval(model, val, context)
            model.train()
            return {"heldout_loss": loss}

        return model, batch, char_loss, evaluate
    raise ValueError(spec.model)


def teacher_forced_difference(spec, make_ours, make_ref, steps=5):
    """The largest weight difference after `steps` steps of a reference optimizer
    (make_ours(model)) and a torch one over copies of the weights (make_ref(params)), both
    given the reference model's gradients (teacher-forced: biases ahead of BatchNorm get
    gradients at rounding-noise level, so two free-running copies part within steps however
    exact the optimizer)."""
    model, batch, loss_fn, _ = make_task(spec, seed=0)
    twin = [p.detach().clone().requires_grad_() for p in model.parameters()]
    ours, ref = make_ours(model), make_ref(twin)
    for _ in range(steps):
        loss_fn(model, *batch()).backward()
        for p, q in zip(model.parameters(), twin):
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
        ours.zero_grad()
        ref.zero_grad()
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), twin))
