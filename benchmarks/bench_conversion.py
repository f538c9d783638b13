"""What the autocast scope of a converted model costs: the training step (forward, backward,
scaler step) of transformers' GPT-2 and BERT architectures (small configs, no downloads) under
``fusedamp.initialize``, with the converted model's autocast scope on (the default) and off,
timed in turns in one process. Also the loss each model computes inside its forward, against
the FP32 cross-entropy of the logits it returns, with the scope on and off.

    python benchmarks/bench_conversion.py [--steps 20] [--dtypes bf16,fp16]

Writes benchmarks/results/conversion_autocast_<device>.{md,json}.
"""
from __future__ import annotations

import datetime
import statistics
import sys

import torch
import torch.nn.functional as F
import transformers

import harness
from harness import results as res
from harness.machine import CPU_FLAGS, cpu_model_and_flags, short_commit
from harness.timing import time_in_turns

harness.use_paths("python")
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

    errors = {}
    for on in (True, False):  # warm-up, and the loss each way
        scope.set(on)
        with torch.no_grad():
            out = model(**batch)
        errors[on] = loss_error(name, out, batch["labels"])
        step()
    # On and off in turns, the scope switched untimed before each step.
    times = time_in_turns({on: step for on in (True, False)}, steps,
                          reset={on: (lambda on=on: scope.set(on)) for on in (True, False)})
    scope.set(True)
    on, off = (statistics.median(times[k][0]) / 1e9 for k in (True, False))
    return dict(model=name, dtype=str(dtype).replace("torch.", ""), step_on_ms=on * 1e3,
                step_off_ms=off * 1e3, ratio=on / off, loss_rel_error_on=errors[True],
                loss_rel_error_off=errors[False])


def machine():
    cpu, flags = cpu_model_and_flags()
    return dict(cpu=cpu, threads=torch.get_num_threads(), torch=torch.__version__,
                transformers=transformers.__version__, commit=short_commit(),
                date=datetime.date.today().isoformat(),
                cpu_flags=[f for f in CPU_FLAGS if f in flags])


def main(argv=None):
    ap = res.parser(__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtypes", default="bf16,fp16")
    res.add_output(ap)
    args = ap.parse_args(argv)
    rows = [measure(name, DTYPES[d], args.steps) for d in args.dtypes.split(",")
            for name in MODELS]
    info = machine()
    lines = ["# The converted model's autocast scope: step time on against off (cpu)", "",
             f"{info['date']}, commit {info['commit']}, {info['cpu']} (flags: "
             f"{', '.join(info['cpu_flags']) or 'none recorded'}), {info['threads']} threads, "
             f"torch {info['torch']}, transformers {info['transformers']}. Batch {BATCH}x{SEQ}; "
             f"median of {args.steps} steps each, on and off in turns in one process. Loss error: "
             "|loss computed inside the model - FP32 cross-entropy of its returned logits| / "
             "the latter.", ""]
    lines += res.table(["model", "dtype", "step, scope on (ms)", "step, scope off (ms)",
                        "on / off", "loss error on", "loss error off"], "llrrrrr",
                       [[r["model"], r["dtype"], f"{r['step_on_ms']:.1f}",
                         f"{r['step_off_ms']:.1f}", f"{r['ratio']:.3f}",
                         f"{r['loss_rel_error_on']:.1e}", f"{r['loss_rel_error_off']:.1e}"]
                        for r in rows])
    text = "\n".join(lines) + "\n"
    print(text)
    out = res.out_dir(args)
    if out is not None:
        res.write_results(out, "conversion_autocast_cpu", dict(machine=info, rows=rows), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
