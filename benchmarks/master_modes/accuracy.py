"""The master-weight modes benchmark's accuracy: the demo's models (digits CNN, character GPT)
trained in BF16 with each row's optimizer from the same weights on the same batches, beside an
FP32 reference; the final training loss, the held-out loss and the digits' test accuracy."""
from __future__ import annotations

import gc
import math
import sys
import time

import torch

import harness
from harness.timing import sync
from master_modes.rows import Row, build_row, fp32_reference_row, short_error
from master_modes.timing import measured_state_bytes

def _amp_models():
    harness.use_paths("examples")
    import amp_models
    return amp_models


class Task:
    """One model, its data and its evaluation; batches come from a generator seeded per run."""

    def __init__(self, name, device, batch):
        self.am = am = _amp_models()
        self.name, self.device, self.batch = name, device, batch
        if name == "digits-cnn":
            (self.xtr, self.ytr), (self.xte, self.yte) = am.digits_data(device)
        elif name == "char-gpt":
            self.context = 64
            self.train, self.val, self.vocab = am.char_data(device, self.context)
        else:
            raise ValueError(name)

    def model(self):
        am = self.am
        return am.DigitsCNN() if self.name == "digits-cnn" else am.CharGPT(self.vocab,
                                                                              self.context)

    def next_batch(self, gen, dtype):
        if self.name == "digits-cnn":
            ix = torch.randint(0, len(self.xtr), (self.batch,), generator=gen).to(self.device)
            return self.xtr[ix].to(dtype), self.ytr[ix]
        return self.am.char_batch(self.train, self.batch, self.context, gen)

    def loss(self, model, x, y):
        logits = model(x)
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model, dtype):
        model.eval()
        try:
            if self.name == "digits-cnn":
                logits = model(self.xte.to(dtype)).float()
                return {"eval_loss": torch.nn.functional.cross_entropy(logits, self.yte).item(),
                        "accuracy": (logits.argmax(1) == self.yte).float().mean().item()}
            loss, ppl = self.am.char_eval(model, self.val, self.context)
            return {"eval_loss": loss, "perplexity": ppl}
        finally:
            model.train()


def train_one(task: Task, row: Row, steps, hyper, seed, device) -> dict:
    torch.manual_seed(seed)
    model = task.model().to(device)  # FP32 init, identical for every row
    dtype = row.param_dtype
    model.to(dtype)
    params = list(model.parameters())
    opt, seeded = build_row(row, params, hyper, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    losses, t0 = [], time.perf_counter()
    for i in range(steps):
        if i == 1:  # the first step allocates the state (and compiles, for torchao)
            sync(device)
            t0 = time.perf_counter()
        x, y = task.next_batch(gen, dtype)
        loss = task.loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    sync(device)
    wall = time.perf_counter() - t0
    curve = [float(v) for v in torch.stack(losses).float().cpu().tolist()]
    tail = curve[-20:]
    out = {"row": row.key, "model": task.name, "steps": steps,
           "final_train_loss": sum(tail) / len(tail),
           "ms_per_step": 1e3 * wall / max(steps - 1, 1),
           "state_bytes_measured": measured_state_bytes(opt),
           "nonfinite_loss": not all(math.isfinite(v) for v in curve), "loss_curve": curve}
    if seeded:
        out["seed_kwargs"] = seeded
    out.update(task.evaluate(model, dtype))
    return out


def run_accuracy(args, rows, device, hyper):
    results, failures = [], []
    acc_rows = [fp32_reference_row()] + rows
    for name in args.models:
        task = Task(name, device, args.digits_batch if name == "digits-cnn" else args.char_batch)
        for row in acc_rows:
            label = f"{name:>10} | {row.key:<36}"
            if row.unavailable:
                failures.append({"row": row.key, "model": name, "error": row.unavailable})
                print(f"{label} skipped: {row.unavailable}", file=sys.stderr, flush=True)
                continue
            try:
                r = train_one(task, row, args.steps, hyper, args.seed, device)
                results.append(r)
                extra = f"  acc {r['accuracy']:.3f}" if "accuracy" in r else ""
                print(f"{label} train {r['final_train_loss']:.4f}  eval {r['eval_loss']:.4f}"
                      f"{extra}  ({r['ms_per_step']:.1f} ms/step)", file=sys.stderr, flush=True)
            except Exception as e:
                failures.append({"row": row.key, "model": name, "error": short_error(e)})
                print(f"{label} failed: {short_error(e)}", file=sys.stderr, flush=True)
            gc.collect()
    return results, failures, acc_rows
