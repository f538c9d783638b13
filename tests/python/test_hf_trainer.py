"""transformers' Trainer with fusedamp (fusedamp.hf.FusedAmpTrainer): a tiny GPT-2 made from a
config trains a few steps on the CPU with fusedamp's optimizer (optimizers=(opt, sched)) and
fusedamp's loss scaler (handed to the Trainer's accelerator); the Trainer's max_grad_norm
becomes the fused clipping; a checkpoint resume continues bit for bit."""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import fusedamp  # noqa: E402
from fusedamp.hf import FusedAmpTrainer  # noqa: E402

VOCAB, SEQ = 64, 16


class Counting(torch.utils.data.Dataset):
    """Sequences that count up modulo VOCAB from a random start: easy to learn."""

    def __init__(self, n=64):
        g = torch.Generator().manual_seed(0)
        self.starts = torch.randint(0, VOCAB, (n,), generator=g)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        ids = (self.starts[i] + torch.arange(SEQ)) % VOCAB
        return {"input_ids": ids, "labels": ids.clone()}


# A scale at which this GPT-2's first FP16 gradients overflow: at 2**17 their largest
# magnitude is about 18,000 (transformers 5.24), at 2**20 about 145,000, above FP16's 65504.
INIT_SCALE = 2.0 ** 20


def recipe(out_dir, max_steps=30, init_scale=INIT_SCALE, **args):
    """The README's recipe (fusedamp.initialize, optimizers=(opt, sched), scaler=scaler)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                     n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt, scaler = fusedamp.initialize(model, opt, torch.float16, init_scale=init_scale,
                                             growth_interval=4)
    sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=3,
                                                         num_training_steps=max_steps)
    targs = transformers.TrainingArguments(
        output_dir=out_dir, max_steps=max_steps, per_device_train_batch_size=8,
        logging_steps=1, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, **dict(dict(save_strategy="no"), **args))
    trainer = FusedAmpTrainer(model=model, args=targs, train_dataset=Counting(),
                              optimizers=(opt, sched), scaler=scaler)
    return trainer, model, opt, scaler


def losses_of(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_gpt2_trains_with_fused_optimizer_and_scaler(tmp_path):
    trainer, model, opt, scaler = recipe(str(tmp_path))
    assert trainer.accelerator.scaler is scaler
    trainer.train()
    assert model.transformer.h[0].attn.c_attn.weight.dtype == torch.float16
    assert model.transformer.h[0].ln_1.weight.dtype == torch.float32
    assert opt.state[model.transformer.wte.weight]["master_param"].dtype == torch.float32
    # The loss scale was used: INIT_SCALE overflows FP16 gradients, so the first step is skipped
    # on the device and the scale backs off; it grows after 4 good steps, backs off again at
    # the next overflow. Every backoff is a skipped step.
    telemetry = scaler.telemetry()
    carried = telemetry["scale"]  # each step's scale, before its update
    assert len(carried) == 30 and carried[0] == INIT_SCALE
    scales = carried[1:] + [scaler.get_scale()]  # the scale after each update
    assert scales[0] < INIT_SCALE and max(scales) > min(scales)
    backoffs = sum(b < a for a, b in zip([INIT_SCALE] + scales, scales))
    assert int(opt.skipped_steps) == backoffs >= 1
    assert sum(telemetry["skipped"]) == backoffs
    # The Trainer's max_grad_norm (1.0 by default) is the fused step's clipping.
    assert trainer.args.max_grad_norm == 0.0
    assert all(g["max_grad_norm"] == 1.0 for g in opt.param_groups)
    losses = losses_of(trainer)
    assert len(losses) == 30 and losses[-1] < 0.6 * losses[0], losses


def test_refuses_trainer_amp_on_top(tmp_path):
    with pytest.raises(ValueError, match="leave TrainingArguments fp16/bf16 off"):
        recipe(str(tmp_path), bf16=True)


def test_checkpoint_resume_is_bit_exact(tmp_path):
    """20 steps in one go vs 10 steps, the Trainer's checkpoint (model, optimizer with master
    weights, scheduler, scaler.pt), and 10 more in a fresh Trainer."""
    full, full_model, full_opt, full_scaler = recipe(str(tmp_path / "full"), max_steps=20)
    full.train()
    first, *_ = recipe(str(tmp_path / "half"), max_steps=20, save_strategy="steps",
                       save_steps=10)
    first.train()
    ckpt = os.path.join(str(tmp_path / "half"), "checkpoint-10")
    assert os.path.isfile(os.path.join(ckpt, "scaler.pt"))
    resumed, model, opt, scaler = recipe(str(tmp_path / "resumed"), max_steps=20)
    resumed.train(resume_from_checkpoint=ckpt)
    assert scaler.get_scale() == full_scaler.get_scale()
    assert int(opt.skipped_steps) == int(full_opt.skipped_steps)
    for (name, a), b in zip(full_model.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    for p, q in zip(full_model.parameters(), model.parameters()):
        for k, v in full_opt.state[p].items():
            assert torch.equal(v, opt.state[q][k]), k


def test_a_fusedamp_schedule_counts_only_the_applied_steps(tmp_path):
    """Handed in through optimizers=(opt, sched), a fusedamp.lr_scheduler schedule does not move
    on the iterations the step was skipped (the first ones here: INIT_SCALE overflows FP16)."""
    trainer, model, opt, scaler = recipe(str(tmp_path), max_steps=12)
    sched = fusedamp.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
    trainer.lr_scheduler = sched
    trainer.train()
    skipped = scaler.telemetry()["skipped"]
    assert skipped[0] and not all(skipped)
    assert float(sched.applied_steps) == 12 - int(opt.skipped_steps) == skipped.count(False)
    # The lr each iteration logged is the one its step used: from the steps applied before it.
    logged = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    applied_before = [skipped[:i].count(False) for i in range(12)]
    want = [1e-2 * (0.1 + 0.9 * min(a, 3) / 3) for a in applied_before]
    assert logged == pytest.approx(want, rel=1e-6)
