#!/usr/bin/env python3
"""master_weights="split" against master_weights=True on the demo's real models.

For the digits CNN and the character-level GPT of examples/python/amp_models.py, BF16, AdamW:
  teacher-forced  one model trains with master_weights=True; its gradients are copied into a
                  second model stepped with "split". After every step: the FP32 master rebuilt
                  from the split pair (weight pattern << 16 + remainder, torch integer ops) must
                  equal the True run's master bit for bit; the weights must be equal except
                  where the master lies exactly halfway between two BF16 values (lower 16 bits
                  0x8000), where "split" rounds away from zero (math/split_math.h).
  free-running    both train on their own gradients: the first step at which a weight differs
                  (a halfway master changes the forward, and the runs part) and the final loss.

    make bench-split-identity            # CPU, 1,000 steps, results into benchmarks/results/
    PYTHONPATH=python python3 benchmarks/split_identity.py --steps 200 --out /tmp
"""
from __future__ import annotations

import copy
import sys
import time

import torch

import fusedamp
from harness import results as res
from harness.machine import machine_info
from harness.timing import sync
from master_modes.accuracy import Task


def rebuilt_master(weight, remainder):
    high = weight.detach().contiguous().view(torch.int16).to(torch.int32) << 16
    return (high + remainder.to(torch.int32)).view(torch.float32)


def halfway(master):
    return (master.contiguous().view(torch.int32) & 0xFFFF) == 0x8000


def make_pair(task, seed, device):
    torch.manual_seed(seed)
    model = task.model().to(device).to(torch.bfloat16)
    other = copy.deepcopy(model)
    hyper = dict(lr=1e-3, weight_decay=0.01)
    return (model, fusedamp.optim.AdamW(model.parameters(), **hyper),
            other, fusedamp.optim.AdamW(other.parameters(), master_weights="split", **hyper))


def teacher_forced(task, steps, seed, device):
    model, opt, other, split_opt = make_pair(task, seed, device)
    gen = torch.Generator().manual_seed(seed + 1)
    master_mismatches = weight_diffs = off_halfway = 0
    elements = sum(p.numel() for p in model.parameters())
    for _ in range(steps):
        x, y = task.next_batch(gen, torch.bfloat16)
        task.loss(model, x, y).backward()
        for p, q in zip(model.parameters(), other.parameters()):
            q.grad = p.grad.clone()
        opt.step()
        split_opt.step()
        opt.zero_grad(set_to_none=True)
        split_opt.zero_grad(set_to_none=True)
        for p, q in zip(model.parameters(), other.parameters()):
            master = opt.state[p]["master_param"]
            rebuilt = rebuilt_master(q, split_opt.state[q]["param_remainder"])
            master_mismatches += int((rebuilt.view(torch.int32) != master.view(torch.int32)).sum())
            differs = p.detach().view(torch.int16) != q.detach().view(torch.int16)
            weight_diffs += int(differs.sum())
            off_halfway += int((differs & ~halfway(master)).sum())
    return {"element_steps": elements * steps, "master_mismatches": master_mismatches,
            "weight_differences": weight_diffs, "differences_off_halfway": off_halfway}


def free_running(task, steps, seed, device):
    model, opt, other, split_opt = make_pair(task, seed, device)
    gens = [torch.Generator().manual_seed(seed + 1), torch.Generator().manual_seed(seed + 1)]
    first_difference, losses = None, ([], [])
    for step in range(steps):
        for k, (m, o) in enumerate(((model, opt), (other, split_opt))):
            x, y = task.next_batch(gens[k], torch.bfloat16)
            loss = task.loss(m, x, y)
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)
            losses[k].append(float(loss.detach()))
        if first_difference is None and any(
                not torch.equal(p.view(torch.int16), q.view(torch.int16))
                for p, q in zip(model.parameters(), other.parameters())):
            first_difference = step + 1
    tail = lambda curve: sum(curve[-20:]) / len(curve[-20:])  # noqa: E731
    return {"first_step_with_a_weight_difference": first_difference,
            "final_train_loss_true": tail(losses[0]), "final_train_loss_split": tail(losses[1])}


def main(argv=None):
    ap = res.parser(__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--models", nargs="+", default=["digits-cnn", "char-gpt"])
    res.add_output(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    device = "cpu"
    rows = []
    for name in args.models:
        task = Task(name, device, args.batch)
        t0 = time.perf_counter()
        row = {"model": name, "params": sum(p.numel() for p in task.model().parameters()),
               "steps": args.steps}
        row.update(teacher_forced(task, args.steps, args.seed, device))
        row.update(free_running(task, args.steps, args.seed, device))
        sync(device)
        row["seconds"] = time.perf_counter() - t0
        print(row, file=sys.stderr, flush=True)
        rows.append(row)
    info = machine_info(device)
    text = markdown(info, rows, args)
    out = res.out_dir(args)
    if out is not None:
        res.write_results(out, "split_identity_cpu", {"machine": info, "rows": rows}, text)
    print(text, end="")
    return 0


def markdown(info, rows, args):
    lines = [
        "# master_weights=\"split\" vs master_weights=True (AdamW lr 1e-3, wd 0.01, BF16)", "",
        f"{info.get('cpu', '?')}, torch {info.get('torch')}, 1 thread, {info.get('date_utc')}; "
        f"batch {args.batch}, seed {args.seed}. Produced by benchmarks/split_identity.py.", "",
        res.machine_sentence(info), "",
        "Teacher-forced: the same gradients into both optimizers; free-running: each model on "
        "its own gradients.", ""]
    lines += res.table(
        ["model", "params", "steps", "master mismatches (element-steps)", "weight differences",
         "of them not at a halfway master", "first free-running step with a difference",
         "final loss True", "final loss split"], "lrrrrrrrr",
        [[r["model"], f"{r['params']:,}", r["steps"],
          f"{r['master_mismatches']} of {r['element_steps']:,}", r["weight_differences"],
          r["differences_off_halfway"], r["first_step_with_a_weight_difference"],
          f"{r['final_train_loss_true']:.4f}", f"{r['final_train_loss_split']:.4f}"]
         for r in rows], compact=True)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
