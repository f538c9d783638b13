"""What the autocast scope of a converted model costs: the training step (forward, backward,
scaler step) of transformers' GPT-2 and BERT architectures (small configs, no downloads) under
``fusedamp.initialize``, with the converted model's autocast scope on (the default) and off,
timed in turns in one process. Also the loss each model computes inside its forward, against
the FP32 cross-entropy of the logits it returns, with the scope on and off.

    python benchmarks/bench_conversion.py [--steps 20] [--dtypes bf16,fp16]

Writes benchmarks/results/conversion_autocast_<device>.{md,json}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

import fusedamp  # noqa: E402
from fusedamp.convert import _ScopedForward  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BATCH, SEQ, VOCAB = 8, 128, 1024


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=256, n_layer=4,
                                  n_head=4)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return model, dict(input_ids=ids, labels=ids.clone())


def bert():
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4,
                                  num_attention_heads=4, intermediate_size=1024,
                                  max_position_embeddings=SEQ, num_labels=3)
    model = transformers.BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(0)
    return model, dict(input_ids=torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                       labels=torch.randint(0, 3, (BATCH,), generator=g))


MODELS = {"gpt2": gpt2, "bert": bert}


class Scope:
    """Switches a converted model's autocast scope off (and on again) for the comparison."""

    def __init__(self, model):
        self.model, self.scoped = model, model.__dict__["forward"]
        assert isinstance(self.scoped, _ScopedForward)

    def set(self, on):
        if on:
            self.model.forward = self.scoped
        else:
            self.model.__dict__.pop("forward", None)


def loss_error(name, out, labels):
    logits = out.logits.float()
    if name == "gpt2":
        logits, labels = logits[:, :-1], labels[:, 1:]
    ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return abs(out.loss.double().item() - ref.double().item()) / ref.double().item()


def measure(name, dtype, steps):
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    model, opt, scaler = fusedamp.initialize(model, torch.optim.AdamW(model.parameters()), dtype)
    scope = Scope(model)

    def step():
        out = model(**batch)
        scaler.scale(out.loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return out

    times = {True: [], False: []}
    errors = {}
    for on in (True, False):  # warm-up, and the loss each way
        scope.set(on)
        with torch.no_grad():
            out = model(**batch)
        errors[on] = loss_error(name, out, batch["labels"])
        step()
    for _ in range(steps):
        for on in (True, False):
            scope.set(on)
            t0 = time.perf_counter()
            step()
            times[on].append(time.perf_counter() - t0)
    scope.set(True)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return dict(model=name, dtype=str(dtype).replace("torch.", ""), step_on_ms=on * 1e3,
                step_off_ms=off * 1e3, ratio=on / off, loss_rel_error_on=errors[True],
                loss_rel_error_off=errors[False])


def machine():
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    return dict(cpu=cpu, threads=torch.get_num_threads(), torch=torch.__version__,
                transformers=transformers.__version__, commit=commit,
                date=datetime.date.today().isoformat())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    rows = [measure(name, DTYPES[d], args.steps) for d in args.dtypes.split(",")
            for name in MODELS]
    info = machine()
    lines = [f"# The converted model's autocast scope: step time on against off (cpu)", "",
             f"{info['date']}, commit {info['commit']}, {info['cpu']}, {info['threads']} threads, "
             f"torch {info['torch']}, transformers {info['transformers']}. Batch {BATCH}x{SEQ}; "
             f"median of {args.steps} steps each, on and off in turns in one process. Loss error: "
             "|loss computed inside the model - FP32 cross-entropy of its returned logits| / "
             "the latter.", "",
             "| model | dtype | step, scope on (ms) | step, scope off (ms) | on / off | "
             "loss error on | loss error off |", "| --- | --- | --: | --: | --: | --: | --: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dtype']} | {r['step_on_ms']:.1f} | "
                     f"{r['step_off_ms']:.1f} | {r['ratio']:.3f} | {r['loss_rel_error_on']:.1e} "
                     f"| {r['loss_rel_error_off']:.1e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "conversion_autocast_cpu.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "conversion_autocast_cpu.json"), "w") as f:
        json.dump(dict(machine=info, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
