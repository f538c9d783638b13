"""What the amax scale policy's target must leave free: how far the largest gradient anywhere
in a backward pass exceeds the parameter gradients' amax, which is all the policy measures.

    python benchmarks/amax_margin.py [--steps 200]          (make bench-amax-margin)

The demo's models (examples/python/amp_models.py) train as fusedamp FP16 runs them (FP16
weights and activations, FP32 norm layers and loss, AdamW on FP32 masters) on their real data,
unscaled. In every step a dispatch mode watches every FP16 tensor the backward pass computes
and keeps those that carry the loss scale (activation gradients, their intermediates inside
attention, norm and loss backward, the parameter gradients; found by running the backward a
second time with the loss multiplied by 2^8): the values that can overflow. Loss scaling
multiplies all of them alike, so the ratios hold at any scale (up to what underflows at scale
1, which only lowers the maxima of tiny tensors).

The policy sets step t+1's scale from step t's parameter amax P[t], so what must fit under
FP16's maximum is step t+1's largest gradient anywhere, A[t+1]: the margin needed is
max_t A[t+1] / P[t]. Writes benchmarks/results/amax_margin.{json,md}.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import harness
from harness import results as res
from harness.machine import machine_info

harness.use_paths("python", "examples")


class ComputedMaxima(TorchDispatchMode):
    """The largest finite |value| of every FP16 tensor each op returns while active, in order."""

    def __init__(self):
        super().__init__()
        self.maxima = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float16 and t.numel():
                self.maxima.append(t.detach().abs().nan_to_num(posinf=0.0).max().item())
        return out


# The backward pass also handles saved activations and weights (detached, transposed): they do
# not carry the loss scale and cannot overflow because of it. Running the same backward with the
# loss multiplied by PROBE tells them apart: a gradient's maximum grows PROBE-fold.
PROBE = 2.0 ** 8


def backward_maxima(loss):
    runs = []
    for factor in (1.0, PROBE):
        watch = ComputedMaxima()
        with watch:
            (loss * factor).backward(retain_graph=factor == 1.0)
        runs.append(watch.maxima)
    plain, probed = runs
    assert len(plain) == len(probed), "the two backward passes ran different ops"
    return max([m for m, p in zip(plain, probed) if m > 0 and 0.5 * PROBE <= p / m <= 2 * PROBE],
               default=0.0)


def measure(model_name, steps, seed=0):
    import amp_models as am

    torch.manual_seed(seed)
    setup, batch, loss_fn, _ = am._task(model_name, "fusedamp-fp16", "cpu", seed)
    model, opt = setup.model, setup.opt  # the scaler is not used: unscaled on purpose
    param_amax, anywhere_amax = [], []
    for _ in range(steps):
        x, y = batch()
        loss = loss_fn(model, x, y)
        anywhere = backward_maxima(loss)
        # The parameters' gradients of the unscaled pass: the sum of both passes / (1 + PROBE).
        grads = [p.grad.float() / (1.0 + PROBE) for p in model.parameters()
                 if p.grad is not None]
        param_amax.append(max(g.abs().max().item() for g in grads))
        anywhere_amax.append(max(anywhere, param_amax[-1]))
        opt.zero_grad(set_to_none=True)
        (loss_fn(model, x, y)).backward()  # the step itself, from an unprobed gradient
        opt.step()
        opt.zero_grad(set_to_none=True)
    within = [a / p for a, p in zip(anywhere_amax, param_amax)]
    next_over = [anywhere_amax[t + 1] / param_amax[t] for t in range(steps - 1)]
    growth = [param_amax[t + 1] / param_amax[t] for t in range(steps - 1)]
    return {
        "model": model_name, "steps": steps,
        "param_amax_first_last": [param_amax[0], param_amax[-1]],
        "max_backward_over_param_same_step": max(within),
        "max_param_amax_growth_per_step": max(growth),
        "max_next_step_backward_over_param": max(next_over),
        "p99_next_step_backward_over_param": sorted(next_over)[int(0.99 * (len(next_over) - 1))],
    }


def main(argv=None):
    ap = res.parser(__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    res.add_output(ap)
    args = ap.parse_args(argv)
    rows = [measure(m, args.steps) for m in ("digits-cnn", "char-gpt")]
    needed = max(r["max_next_step_backward_over_param"] for r in rows)
    out = {"rows": rows, "needed_margin": needed,
           "needed_margin_pow2": 2 ** math.ceil(math.log2(needed)),
           "torch": torch.__version__}
    lines = ["# How far a backward pass's largest gradient exceeds the parameter gradients' amax",
             "", f"fusedamp FP16 training, unscaled, on the CPU, {args.steps} steps per model, "
             f"FP16 tensors of the backward pass only, torch "
             f"{torch.__version__} (benchmarks/amax_margin.py).", "",
             res.machine_sentence(machine_info("cpu")), ""]
    lines += res.table(["model", "backward / param amax, same step (max)",
                        "param amax growth per step (max)",
                        "next step's backward / this step's param amax (max)", "(p99)"],
                       "lrrrr",
                       [[r["model"], f"{r['max_backward_over_param_same_step']:.2f}",
                         f"{r['max_param_amax_growth_per_step']:.2f}",
                         f"{r['max_next_step_backward_over_param']:.2f}",
                         f"{r['p99_next_step_backward_over_param']:.2f}"] for r in rows],
                       compact=True)
    lines += ["", f"Margin needed over these runs: {needed:.2f}x, the next power of two "
              f"{out['needed_margin_pow2']}x."]
    text = "\n".join(lines) + "\n"
    folder = res.out_dir(args)
    if folder is not None:
        res.write_results(folder, "amax_margin", out, text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
