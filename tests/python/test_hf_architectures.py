"""Five transformers architectures (BERT, GPT-2, Llama, T5, ViT; two layers, hidden 64, built
from configs, nothing downloaded) under ``fusedamp.initialize`` in FP16 and BF16, against the
same model under ``torch.autocast`` (+ torch.amp.GradScaler for FP16) with torch's AdamW:
- the loss each model computes inside its forward is the FP32 cross-entropy of the logits it
  returns (autocast's FP32 list reaches inside the converted model);
- the first step is applied with default settings (an FP32 loss at the default scale);
- 30 steps end within 1 % of the autocast run's loss;
- buffers keep FP32 (Llama's rotary frequencies), as do transformers' _keep_in_fp32_modules."""
import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import fusedamp  # noqa: E402

VOCAB, SEQ, BATCH, STEPS = 96, 16, 8, 30
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def _bert():
    cfg = transformers.BertConfig(vocab_size=VOCAB, max_position_embeddings=SEQ, num_labels=3,
                                  **SMALL)
    return transformers.BertForSequenceClassification(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2,
                                  n_head=4)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=SEQ,
                                   num_key_value_heads=2, **SMALL)
    return transformers.LlamaForCausalLM(cfg)


def _t5():
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                num_heads=4, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg)


def _vit():
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, num_labels=5,
                                 **SMALL)
    return transformers.ViTForImageClassification(cfg)


def _tokens(g, shape):
    return torch.randint(0, VOCAB, shape, generator=g)


def _batches(name):
    """Four fixed batches with labels; the runs cycle through them."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(4):
        if name == "bert":
            out.append(dict(input_ids=_tokens(g, (BATCH, SEQ)),
                            labels=torch.randint(0, 3, (BATCH,), generator=g)))
        elif name in ("gpt2", "llama"):
            ids = _tokens(g, (BATCH, SEQ))
            out.append(dict(input_ids=ids, labels=ids.clone()))
        elif name == "t5":
            out.append(dict(input_ids=_tokens(g, (BATCH, SEQ)), labels=_tokens(g, (BATCH, 8))))
        else:
            out.append(dict(pixel_values=torch.randn(BATCH, 3, 16, 16, generator=g),
                            labels=torch.randint(0, 5, (BATCH,), generator=g)))
    return out


MODELS = {"bert": _bert, "gpt2": _gpt2, "llama": _llama, "t5": _t5, "vit": _vit}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _model(name):
    torch.manual_seed(0)
    return MODELS[name]().train()


def _fp32_cross_entropy(name, logits, labels):
    logits = logits.float()
    if name in ("gpt2", "llama"):  # causal LMs predict the next token
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _fusedamp_run(name, dtype):
    model = _model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, scaler = fusedamp.initialize(model, opt, dtype)  # default settings
    losses = []
    for i in range(STEPS):
        out = model(**_batches(name)[i % 4])
        if i == 0:
            reference = _fp32_cross_entropy(name, out.logits, _batches(name)[0]["labels"])
            assert out.loss.dtype == torch.float32
            torch.testing.assert_close(out.loss, reference, rtol=2e-6, atol=0)
        scaler.scale(out.loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if i == 0:
            assert bool(opt.last_step_applied), "the first step was skipped"
        losses.append(out.loss.item())
    return model, losses, int(opt.skipped_steps)


def _autocast_run(name, dtype):
    model = _model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    losses, skipped = [], 0
    for i in range(STEPS):
        with torch.autocast("cpu", dtype=dtype):
            loss = model(**_batches(name)[i % 4]).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        before = scaler.get_scale()
        scaler.update()
        skipped += scaler.get_scale() < before  # torch's scaler backs off on each skip
        opt.zero_grad()
        losses.append(loss.item())
    return losses, skipped


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("name", MODELS)
def test_initialize_trains_as_autocast_does(name, dtype):
    model, ours, skipped = _fusedamp_run(name, DTYPES[dtype])
    ref, ref_skipped = _autocast_run(name, DTYPES[dtype])
    assert skipped <= ref_skipped, (skipped, ref_skipped)
    assert ours[-1] < 0.9 * ours[0]  # it learned: the comparison means something
    assert abs(ours[-1] - ref[-1]) <= 0.01 * ref[-1], (ours[-1], ref[-1])
    for buf_name, buf in model.named_buffers():
        if buf.is_floating_point():
            assert buf.dtype == torch.float32, buf_name


def test_rotary_frequencies_stay_fp32():
    model = _model("llama")
    before = {n: b.clone() for n, b in model.named_buffers()}
    fusedamp.initialize(model, torch.optim.AdamW(model.parameters()), torch.float16)
    inv_freq = dict(model.named_buffers())["model.rotary_emb.inv_freq"]
    assert inv_freq.dtype == torch.float32
    assert torch.equal(inv_freq, before["model.rotary_emb.inv_freq"])


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
def test_keep_in_fp32_modules_are_honoured(dtype):
    """T5 lists "wo" in _keep_in_fp32_modules: from_pretrained keeps it FP32 for FP16 only,
    and so does initialize."""
    model = _model("t5")
    fusedamp.initialize(model, torch.optim.AdamW(model.parameters()), DTYPES[dtype])
    wo = model.encoder.block[0].layer[1].DenseReluDense.wo.weight
    wi = model.encoder.block[0].layer[1].DenseReluDense.wi.weight
    assert wo.dtype == (torch.float32 if dtype == "fp16" else torch.bfloat16)
    assert wi.dtype == DTYPES[dtype]
    out = model(**_batches("t5")[0])
    assert torch.isfinite(out.loss)


def test_keep_fp32_option_and_restore():
    model = _model("gpt2").eval()  # no dropout: outputs comparable
    plain = copy.deepcopy(model)
    with pytest.raises(ValueError, match="keep_fp32 names no module"):
        fusedamp.initialize(model, torch.optim.AdamW(model.parameters()), torch.float16,
                            keep_fp32=["no_such_module"])
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing changed
    assert "forward" not in model.__dict__
    fusedamp.initialize(model, torch.optim.AdamW(model.parameters()), torch.float16,
                        keep_fp32=["lm_head", "mlp"])
    assert model.transformer.h[1].mlp.c_fc.weight.dtype == torch.float32
    assert model.transformer.h[1].attn.c_attn.weight.dtype == torch.float16
    batch = _batches("gpt2")[0]
    assert torch.isfinite(model(**batch).loss)
    copied = copy.deepcopy(model)  # its scoped forward runs the copy, not the original
    with torch.no_grad():
        for p in copied.parameters():
            p.zero_()
    assert not torch.equal(copied(**batch).logits, model(**batch).logits)
    fusedamp.restore(model)
    assert "forward" not in model.__dict__
    assert all("forward" not in m.__dict__ for m in model.modules())
    torch.testing.assert_close(model(**batch).logits, plain(**batch).logits, rtol=0.05, atol=0.05)


def test_the_scale_fits_an_fp16_loss(device):
    """A loss the model computes in FP16 (here autocast keeps nothing in FP32 for it): the
    default scale 2^16 would reach it as an FP16 gradient of inf; scale() holds the scale at
    2^15 and the first step is applied. An FP32 loss keeps torch's sequence."""
    w = torch.nn.Parameter(torch.full((4,), 0.5, device=device, dtype=torch.float16))
    opt = fusedamp.optim.SGD([w], lr=0.1)
    scaler = fusedamp.GradScaler(device)
    loss = (w * w).sum()  # FP16
    scaler.scale(loss).backward()
    assert torch.isfinite(w.grad).all()
    scaler.step(opt)
    scaler.update()
    assert bool(opt.last_step_applied) and scaler.get_scale() == 2.0 ** 15
    fp32 = fusedamp.GradScaler(device)
    fp32.scale(torch.ones((), device=device))
    assert fp32.get_scale() == 2.0 ** 16


def test_a_converted_model_pickles_with_its_scope():
    """torch.save of the whole converted model: the copy runs under its own autocast scope (the
    scope holds the module, not a bound method of the original)."""
    import io
    model = _model("bert").eval()
    fusedamp.initialize(model, torch.optim.AdamW(model.parameters()), torch.bfloat16)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.forward.module is loaded
    batch = _batches("bert")[0]
    a, b = model(**batch), loaded(**batch)
    assert b.loss.dtype == torch.float32 and torch.equal(a.logits, b.logits)


def test_a_model_with_kept_modules_cast_again_runs_in_that_dtype():
    """After model.to(bfloat16) a converted model runs as a plain BF16 model, its keep_fp32
    modules included: their inputs follow their own weights' dtype, not FP32."""
    model = _model("gpt2").eval()
    fusedamp.initialize(model, torch.optim.AdamW(model.parameters()), torch.float16,
                        keep_fp32=["mlp"])
    model.to(torch.bfloat16)
    out = model(**_batches("gpt2")[0])
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
