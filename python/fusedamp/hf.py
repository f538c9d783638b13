"""fusedamp with transformers' ``Trainer``: ``FusedAmpTrainer``.

The recipe: convert the model and rebuild its optimizer with ``fusedamp.initialize``, hand the
optimizer (and an LR scheduler made on it) to the Trainer through ``optimizers=(opt, sched)``,
and the scaler through ``scaler=``; leave ``fp16``/``bf16`` of TrainingArguments off (the
model already is FP16/BF16 with FP32 master weights; autocast and torch's scaler would be a
second mixed-precision layer on top).

The Trainer does its backward and optimizer step through accelerate, whose ``Accelerator``
scales the loss with its ``scaler`` (``scaler.scale(loss).backward()``) and steps the
optimizer with ``scaler.step(opt); scaler.update()``. ``FusedAmpTrainer`` gives the
accelerator fusedamp's scaler, so the step is fusedamp's fused, sync-free one, and the
Trainer's checkpoints save and restore the scaler (``scaler.pt``) with the optimizer (master
weights included). The Trainer's own clipping (``max_grad_norm``, default 1.0) would clip the
still-scaled gradients outside the step: it becomes the optimizer's fused ``max_grad_norm``
instead. As with torch.amp and a fused optimizer, the Trainer cannot see a skipped step (the
skip happens on the device), so a torch LR scheduler steps every iteration; a
``fusedamp.lr_scheduler`` schedule handed in the same way counts only the applied steps.

Tested with transformers 5.24 and accelerate 1.15.
"""
from __future__ import annotations

import transformers

from .grad_scaler import GradScaler
from .optim import FusedOptimizer

__all__ = ["FusedAmpTrainer"]


class FusedAmpTrainer(transformers.Trainer):
    """``transformers.Trainer`` stepping fusedamp's optimizer under fusedamp's scaler.

    ``FusedAmpTrainer(model, args, ..., optimizers=(opt, sched), scaler=scaler)`` with
    ``model, opt, scaler = fusedamp.initialize(model, torch_opt, dtype)``.
    """

    def __init__(self, *args, scaler: GradScaler, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.optimizer, FusedOptimizer):
            raise TypeError("FusedAmpTrainer: pass fusedamp's optimizer as "
                            "optimizers=(optimizer, lr_scheduler) (fusedamp.initialize gives it)")
        if not isinstance(scaler, GradScaler):
            raise TypeError("FusedAmpTrainer: scaler must be a fusedamp.GradScaler, got "
                            f"{type(scaler).__name__}")
        if self.args.fp16 or self.args.bf16:
            raise ValueError("FusedAmpTrainer: leave TrainingArguments fp16/bf16 off: the model "
                             "is already FP16/BF16 with FP32 master weights (fusedamp.initialize)")
        if self.accelerator.scaler is not None:
            raise ValueError("FusedAmpTrainer: the accelerator already has a loss scaler")
        clip = self.args.max_grad_norm
        if clip is not None and clip > 0:
            for group in self.optimizer.param_groups:
                if group.get("max_grad_norm") is None:
                    group["max_grad_norm"] = float(clip)
            self.args.max_grad_norm = 0.0  # clipped in the fused step, by the unscaled norm
        self.accelerator.scaler = scaler
