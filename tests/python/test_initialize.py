"""fusedamp.initialize on models no one here wrote: torchvision's resnet18 and a GPT-2-style
transformer from transformers' GPT2LMHeadModel (small config, no downloaded weights)."""
import pytest
import torch

import fusedamp

torchvision = pytest.importorskip("torchvision")
transformers = pytest.importorskip("transformers")


def _norms_fp32(model):
    seen = 0
    for m in model.modules():
        if fusedamp.is_norm_layer(m):
            for p in m.parameters(recurse=False):
                assert p.dtype == torch.float32, type(m).__name__
                seen += 1
    return seen


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_initialize_resnet18(device, dtype):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # 4 images of 16x16 (every stage still runs; the last ones on 1x1 maps) and a first scale
    # of 2^10 (2^16 overflows the first steps' FP16 gradients, each skipped step a whole pass):
    # FP16 convolutions are slow on a CPU (on one thread of the 2-core Xeon a pass takes ~40x
    # BF16's; these 5 steps 6.5 s, 8.4 s on 24x24 images).
    model, opt, scaler = fusedamp.initialize(model, opt, dtype, init_scale=2.0 ** 10)
    assert _norms_fp32(model) > 0
    assert model.conv1.weight.dtype == dtype
    x = torch.randn(4, 3, 16, 16, device=device)
    y = torch.randint(0, 10, (4,), device=device)
    losses = []
    for _ in range(5):
        out = model(x)
        assert out.dtype == torch.float32
        loss = torch.nn.functional.cross_entropy(out, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert scaler.is_enabled() == (dtype == torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_initialize_gpt2(device, dtype):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model, opt, scaler = fusedamp.initialize(model, opt, dtype, max_grad_norm=1.0)
    assert _norms_fp32(model) == 2 * (2 * 2 + 1)  # ln_1, ln_2 per block + ln_f: weight, bias
    ids = torch.randint(0, 64, (4, 32), device=device)
    losses = []
    for _ in range(15):
        out = model(ids, labels=ids)
        assert out.logits.dtype == torch.float32
        scaler.scale(out.loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    assert opt.skipped_steps.item() <= 2
