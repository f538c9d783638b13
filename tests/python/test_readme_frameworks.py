"""The README's "Use it with…" snippets for Lightning and transformers' Trainer, executed as
written (the names they take as given — a LightningModule `model`; a GPT-2 `model`, `args`
and `dataset` — come from the framework tests' fixtures). The FSDP2 snippet needs ranks:
fsdp_worker.py makes the same calls on 2 Gloo ranks."""
import os
import re

import pytest
import torch

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")


def snippet(title):
    """The first ```python block after the bold `title` in the README's "Use it with…"."""
    with open(README) as f:
        text = f.read()
    section = text[text.index("## Use it with"):]
    after = section[section.index(f"**{title}**"):]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def test_lightning_snippet(tmp_path, monkeypatch):
    pytest.importorskip("pytorch_lightning")
    from test_lightning import Regressor

    monkeypatch.chdir(tmp_path)  # Lightning's default logger writes into the working directory
    ns = {"model": Regressor()}
    exec(snippet("PyTorch Lightning"), ns)
    trainer, model = ns["trainer"], ns["model"]
    import fusedamp

    assert type(trainer.optimizers[0]) is fusedamp.optim.AdamW
    assert model.net[0].weight.dtype == torch.float16
    assert trainer.optimizers[0].param_groups[0]["max_grad_norm"] == 1.0
    assert len(trainer.precision_plugin.scaler.telemetry()["scale"]) == trainer.global_step


def test_transformers_snippet(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from test_hf_trainer import SEQ, VOCAB, Counting

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                     n_head=2)
    ns = {"torch": torch, "transformers": transformers,
          "model": transformers.GPT2LMHeadModel(config), "dataset": Counting(),
          "args": transformers.TrainingArguments(
              output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=8,
              report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)}
    exec(snippet("transformers `Trainer`"), ns)
    trainer, opt, scaler = ns["trainer"], ns["opt"], ns["scaler"]
    import fusedamp

    assert trainer.optimizer.optimizer is opt and isinstance(opt, fusedamp.optim.AdamW)
    assert trainer.accelerator.scaler is scaler and len(scaler.telemetry()["scale"]) == 6
    assert ns["model"].transformer.wte.weight.dtype == torch.float16
    assert trainer.state.global_step == 6
