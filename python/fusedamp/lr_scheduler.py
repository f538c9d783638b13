"""Learning-rate schedules counted in *applied* optimizer steps, computed on the device.

torch's schedulers count their own ``step()`` calls on the host, so under loss scaling a skipped
optimizer step still advances the schedule. These count the steps fusedamp's optimizers applied
(``optimizer.last_step_applied``, a device tensor): ``scheduler.step()`` after
``optimizer.step()`` adds that flag to a device counter and writes each group's lr, a device
tensor, from it. Nothing is read on the host, so the pair can run inside a captured CUDA graph.

Each schedule gives the lr torch's scheduler of the same name gives after as many ``step()``
calls as steps were applied (torch's closed forms, in FP64, stored into the group's lr tensor).

    opt = fusedamp.optim.AdamW(model.parameters(), lr=3e-4)
    sched = fusedamp.lr_scheduler.WarmupCosine(opt, warmup_steps=100, total_steps=10_000,
                                               min_lr_ratio=0.1)
    ...
    scaler.step(opt); scaler.update(); sched.step()

A float lr is replaced by a 0-dim FP32 tensor of the same value on the parameters' device (the
schedule writes it in place); the value the group started with is its base lr (``initial_lr``).
"""
from __future__ import annotations

import math

import torch

from . import compiled_step

__all__ = ["AppliedStepSchedule", "ConstantLR", "LinearLR", "StepLR", "ExponentialLR",
           "PolynomialLR", "CosineAnnealingLR", "OneCycleLR", "WarmupCosine", "InverseSqrt",
           "SequentialLR", "from_torch", "check_convertible"]


def _check_reports_applied_steps(optimizer):
    if not hasattr(type(optimizer), "last_step_applied"):
        raise TypeError(f"fusedamp.lr_scheduler: {type(optimizer).__name__} does not report "
                        "which steps it applied; use a fusedamp.optim optimizer (or torch's "
                        "schedulers, which count calls)")


class AppliedStepSchedule:
    """Base: each group's lr = ``lr_at(t, base_lr)``, t = the optimizer steps applied so far
    (an FP64 device scalar). Subclasses define ``lr_at`` with torch operations on t."""

    def __init__(self, optimizer):
        _check_reports_applied_steps(optimizer)
        self.optimizer = optimizer
        params = [p for g in optimizer.param_groups for p in g["params"]]
        device = params[0].device if params else torch.device("cpu")
        self.base_lrs = []
        for group in optimizer.param_groups:
            # The group's lr as given (a float, or a tensor read once here) is its base.
            group.setdefault("initial_lr", float(group["lr"]))
            self.base_lrs.append(float(group["initial_lr"]))
            if not torch.is_tensor(group["lr"]):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32,
                                           device=device)
        self._applied = torch.zeros((), dtype=torch.float64, device=device)
        self._step_target = compiled_step.make_target(self)  # in a compiled graph (its op)
        self._write()

    def lr_at(self, t, base_lr):
        raise NotImplementedError

    def step(self):
        """Advances by the optimizer's last step if it was applied; call it after that step."""
        if compiled_step.available and torch.compiler.is_compiling():
            compiled_step.schedule_step(self)
            return
        applied = self.optimizer.last_step_applied
        if applied is None:
            raise RuntimeError("fusedamp.lr_scheduler: step() before the optimizer's first step")
        self._applied += applied.reshape(()).to(self._applied.device, torch.float64)
        self._write()

    @torch.no_grad()
    def _write(self):
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"].copy_(self.lr_at(self._applied, base))

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_step_target"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._step_target = compiled_step.make_target(self)

    @property
    def applied_steps(self):
        """The optimizer steps applied since the schedule began (FP64 device scalar)."""
        return self._applied

    def get_last_lr(self):
        """Each group's lr tensor (no host read)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self):
        return {"applied_steps": self._applied.clone(), "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state_dict):
        base_lrs = list(state_dict["base_lrs"])
        if len(base_lrs) != len(self.optimizer.param_groups):
            raise ValueError(f"fusedamp.lr_scheduler: the state has {len(base_lrs)} base lrs, "
                             f"the optimizer {len(self.optimizer.param_groups)} groups")
        self._applied.copy_(state_dict["applied_steps"])
        self.base_lrs = base_lrs
        self._write()


def _positive_int(name, value):
    if int(value) != value or value < 1:
        raise ValueError(f"fusedamp.lr_scheduler: {name} must be a positive integer, got {value}")
    return int(value)


class ConstantLR(AppliedStepSchedule):
    """torch.optim.lr_scheduler.ConstantLR: base * factor for the first total_iters steps."""

    def __init__(self, optimizer, factor=1.0 / 3, total_iters=5):
        if not 0.0 <= factor <= 1.0:
            raise ValueError("fusedamp.lr_scheduler: factor must be in [0, 1]")
        self.factor, self.total_iters = float(factor), int(total_iters)
        super().__init__(optimizer)

    def lr_at(self, t, base_lr):
        return torch.where(t < self.total_iters, base_lr * self.factor, base_lr + 0 * t)


class LinearLR(AppliedStepSchedule):
    """torch.optim.lr_scheduler.LinearLR: the factor moves linearly from start_factor to
    end_factor over total_iters steps (a linear warm-up with end_factor=1)."""

    def __init__(self, optimizer, start_factor=1.0 / 3, end_factor=1.0, total_iters=5):
        if not 0.0 < start_factor <= 1.0 or not 0.0 <= end_factor <= 1.0:
            raise ValueError("fusedamp.lr_scheduler: start_factor must be in (0, 1] and "
                             "end_factor in [0, 1]")
        self.start_factor, self.end_factor = float(start_factor), float(end_factor)
        self.total_iters = _positive_int("total_iters", total_iters)
        super().__init__(optimizer)

    def lr_at(self, t, base_lr):
        done = torch.clamp(t, max=self.total_iters)
        return base_lr * (self.start_factor + (self.end_factor - self.start_factor) * done
                          / self.total_iters)


class StepLR(AppliedStepSchedule):
    """torch.optim.lr_scheduler.StepLR: base * gamma ** (t // step_size)."""

    def __init__(self, optimizer, step_size, gamma=0.1):
        self.step_size, self.gamma = _positive_int("step_size", step_size), float(gamma)
        super().__init__(optimizer)

    def lr_at(self, t, base_lr):
        return base_lr * torch.pow(torch.full_like(t, self.gamma),
                                   torch.floor(t / self.step_size))


class ExponentialLR(AppliedStepSchedule):
    """torch.optim.lr_scheduler.ExponentialLR: base * gamma ** t."""

    def __init__(self, optimizer, gamma):
        self.gamma = float(gamma)
        super().__init__(optimizer)

    def lr_at(self, t, base_lr):
        return base_lr * torch.pow(torch.full_like(t, self.gamma), t)


class PolynomialLR(AppliedStepSchedule):
    """torch.optim.lr_scheduler.PolynomialLR: base * (1 - min(t, total_iters) / total_iters)
    ** power (a linear decay to zero with power=1)."""

    def __init__(self, optimizer, total_iters=5, power=1.0):
        self.total_iters, self.power = _positive_int("total_iters", total_iters), float(power)
        super().__init__(optimizer)

    def lr_at(self, t, base_lr):
        left = 1.0 - torch.clamp(t, max=self.total_iters) / self.total_iters
        return base_lr * torch.pow(left, self.power)


class CosineAnnealingLR(AppliedStepSchedule):
    """torch.optim.lr_scheduler.CosineAnnealingLR (its closed form): eta_min + (base -
    eta_min) * (1 + cos(pi * t / T_max)) / 2."""

    def __init__(self, optimizer, T_max, eta_min=0.0):
        self.T_max, self.eta_min = _positive_int("T_max", T_max), float(eta_min)
        super().__init__(optimizer)

    def lr_at(self, t, base_lr):
        return self.eta_min + (base_lr - self.eta_min) * (
            1.0 + torch.cos(math.pi * t / self.T_max)) / 2.0


class OneCycleLR(AppliedStepSchedule):
    """torch.optim.lr_scheduler.OneCycleLR, lr only: from max_lr / div_factor up to max_lr over
    pct_start of total_steps, then down to that / final_div_factor (three_phase: back to the
    start first), by cosine or linear annealing. torch also cycles momentum by default; these
    schedules write only the lr, so cycle_momentum must be False. After total_steps applied
    steps the lr stays at its last value (torch raises instead)."""

    def __init__(self, optimizer, max_lr, total_steps, pct_start=0.3, anneal_strategy="cos",
                 cycle_momentum=True, div_factor=25.0, final_div_factor=1e4,
                 three_phase=False):
        _check_reports_applied_steps(optimizer)  # before initial_lr is written below
        if cycle_momentum:
            raise ValueError("fusedamp.lr_scheduler.OneCycleLR writes the lr only: pass "
                             "cycle_momentum=False (or use torch's OneCycleLR, which cycles "
                             "the momentum on the host)")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError("fusedamp.lr_scheduler: anneal_strategy must be 'cos' or 'linear'")
        if not 0.0 < pct_start < 1.0:
            raise ValueError("fusedamp.lr_scheduler: pct_start must be in (0, 1)")
        self.total_steps = _positive_int("total_steps", total_steps)
        groups = len(optimizer.param_groups)
        max_lrs = list(max_lr) if isinstance(max_lr, (list, tuple)) else [max_lr] * groups
        if len(max_lrs) != groups:
            raise ValueError(f"fusedamp.lr_scheduler: {len(max_lrs)} max_lr for {groups} groups")
        self.div_factor, self.final_div_factor = float(div_factor), float(final_div_factor)
        self.cosine = anneal_strategy == "cos"
        ends = [float(pct_start * total_steps) - 1, total_steps - 1]
        if three_phase:
            ends = [ends[0], float(2 * pct_start * total_steps) - 2, total_steps - 1]
        self.phase_ends = ends
        self.three_phase = bool(three_phase)
        for group, top in zip(optimizer.param_groups, max_lrs):
            group["initial_lr"] = float(top) / self.div_factor  # as torch's OneCycleLR sets it
        super().__init__(optimizer)

    def _anneal(self, start, end, pct):
        if self.cosine:
            return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1.0)
        return (end - start) * pct + start

    def lr_at(self, t, base_lr):
        initial = base_lr
        top = initial * self.div_factor
        low = initial / self.final_div_factor
        levels = ([initial, top, initial, low] if self.three_phase else [initial, top, low])
        t = torch.clamp(t, max=self.total_steps - 1)
        lr = None
        start = 0.0
        for k, end in enumerate(self.phase_ends):
            pct = (t - start) / (end - start)
            value = self._anneal(levels[k], levels[k + 1], pct)
            lr = value if lr is None else torch.where(t <= previous_end, lr, value)
            previous_end, start = end, end
        return lr


class WarmupCosine(AppliedStepSchedule):
    """The common LLM schedule: linear warm-up from 0 over warmup_steps, then a cosine decay to
    min_lr_ratio * base at total_steps, constant after (transformers' cosine schedule with a
    floor; torch: LambdaLR with the same factor)."""

    def __init__(self, optimizer, warmup_steps, total_steps, min_lr_ratio=0.0):
        if not 0 <= warmup_steps < total_steps:
            raise ValueError("fusedamp.lr_scheduler: need 0 <= warmup_steps < total_steps")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError("fusedamp.lr_scheduler: min_lr_ratio must be in [0, 1]")
        self.warmup_steps, self.total_steps = int(warmup_steps), int(total_steps)
        self.min_lr_ratio = float(min_lr_ratio)
        super().__init__(optimizer)

    def factor(self, t):
        warm = t / max(1, self.warmup_steps)
        progress = torch.clamp((t - self.warmup_steps) / (self.total_steps - self.warmup_steps),
                               0.0, 1.0)
        cosine = self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (
            1.0 + torch.cos(math.pi * progress))
        return torch.where(t < self.warmup_steps, warm, cosine)

    def lr_at(self, t, base_lr):
        return base_lr * self.factor(t)


class InverseSqrt(AppliedStepSchedule):
    """Linear warm-up over warmup_steps, then base * sqrt(warmup_steps / t) (the Transformer's
    schedule, normalised to reach base at the end of the warm-up; torch: LambdaLR)."""

    def __init__(self, optimizer, warmup_steps):
        self.warmup_steps = _positive_int("warmup_steps", warmup_steps)
        super().__init__(optimizer)

    def lr_at(self, t, base_lr):
        w = self.warmup_steps
        return base_lr * torch.where(t < w, t / w, torch.rsqrt(torch.clamp(t, min=w) / w))


class SequentialLR(AppliedStepSchedule):
    """torch.optim.lr_scheduler.SequentialLR: schedules[i] from milestones[i - 1] on, each
    counting from its own start. The parts are schedules built on the same optimizer; only
    this one writes the lr (their own step() is not called)."""

    def __init__(self, optimizer, schedules, milestones):
        if len(milestones) != len(schedules) - 1 or list(milestones) != sorted(milestones):
            raise ValueError("fusedamp.lr_scheduler: need len(schedules) - 1 increasing milestones")
        if any(s.optimizer is not optimizer for s in schedules):
            raise ValueError("fusedamp.lr_scheduler: every schedule must be on this optimizer")
        self.schedules, self.milestones = list(schedules), [int(m) for m in milestones]
        super().__init__(optimizer)  # the parts set the lr when built; the first one's now

    def lr_at(self, t, base_lr):
        lr = self.schedules[-1].lr_at(t - (self.milestones[-1] if self.milestones else 0),
                                      base_lr)
        for k in range(len(self.milestones) - 1, -1, -1):
            start = self.milestones[k - 1] if k > 0 else 0
            lr = torch.where(t < self.milestones[k],
                             self.schedules[k].lr_at(t - start, base_lr), lr)
        return lr


def from_torch(scheduler, optimizer):
    """The schedule of ``optimizer`` (a fusedamp.optim optimizer) that gives ``scheduler``'s lr
    (a freshly made torch scheduler: its construction step only) counted in applied steps.
    torch's StepLR, ExponentialLR, LinearLR, ConstantLR, PolynomialLR, CosineAnnealingLR,
    OneCycleLR (cycle_momentum=False) and SequentialLR of those; anything else is refused with
    a ValueError (nothing is changed)."""
    check_convertible(scheduler)
    return _converted(scheduler, optimizer)


def _converted(scheduler, optimizer):
    if isinstance(scheduler, torch.optim.lr_scheduler.SequentialLR):
        parts = [_converted(s, optimizer) for s in scheduler._schedulers]
        return SequentialLR(optimizer, parts, milestones=list(scheduler._milestones))
    kind = type(scheduler).__name__
    if kind == "StepLR":
        return StepLR(optimizer, scheduler.step_size, scheduler.gamma)
    if kind == "ExponentialLR":
        return ExponentialLR(optimizer, scheduler.gamma)
    if kind == "LinearLR":
        return LinearLR(optimizer, scheduler.start_factor, scheduler.end_factor,
                        scheduler.total_iters)
    if kind == "ConstantLR":
        return ConstantLR(optimizer, scheduler.factor, scheduler.total_iters)
    if kind == "PolynomialLR":
        return PolynomialLR(optimizer, scheduler.total_iters, scheduler.power)
    if kind == "CosineAnnealingLR":
        return CosineAnnealingLR(optimizer, scheduler.T_max, scheduler.eta_min)
    # OneCycleLR (cycle_momentum=False, checked): the groups hold the levels it was made with,
    # its phases the exact step where each ends.
    groups = optimizer.param_groups
    phases = scheduler._schedule_phases
    ours = OneCycleLR(optimizer, max_lr=[g["max_lr"] for g in groups],
                      total_steps=scheduler.total_steps,
                      pct_start=(phases[0]["end_step"] + 1) / scheduler.total_steps,
                      anneal_strategy="cos" if scheduler._anneal_func_type == "cos" else "linear",
                      cycle_momentum=False,
                      div_factor=groups[0]["max_lr"] / groups[0]["initial_lr"],
                      final_div_factor=groups[0]["initial_lr"] / groups[0]["min_lr"],
                      three_phase=len(phases) == 3)
    ours.phase_ends = [float(phase["end_step"]) for phase in phases]
    ours._write()
    return ours


_CONVERTIBLE = ("StepLR", "ExponentialLR", "LinearLR", "ConstantLR", "PolynomialLR",
                "CosineAnnealingLR", "OneCycleLR", "SequentialLR")


def check_convertible(scheduler, inner=False):
    """Raises ValueError (changing nothing) unless from_torch can convert `scheduler`."""
    kind = type(scheduler).__name__
    # A SequentialLR undoes its later parts' construction step (their last_epoch is -1).
    fresh = (-1, 0) if inner else (0,)
    if (kind not in _CONVERTIBLE or type(scheduler).__module__ != "torch.optim.lr_scheduler"
            or getattr(scheduler, "last_epoch", None) not in fresh):
        raise ValueError(f"fusedamp.lr_scheduler: no skip-aware counterpart of {kind} "
                         f"(convertible: torch's {', '.join(_CONVERTIBLE)}, before their first "
                         "step())")
    if kind == "OneCycleLR" and getattr(scheduler, "cycle_momentum", False):
        raise ValueError("fusedamp.lr_scheduler: OneCycleLR(cycle_momentum=True) cycles the "
                         "momentum too; these schedules write only the lr")
    for part in getattr(scheduler, "_schedulers", ()) or ():
        check_convertible(part, inner=True)
