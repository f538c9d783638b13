"""convert_module and the way back: norm layers are found by what they are, not by their
container's name; each layer gets the dtype it computes in (a LayerNorm's weight gradient as
accurate as in an FP32 model); an initialized model cast again with .float(), .to() or .half()
runs as that dtype; fusedamp.restore gives a plain FP32 module with the masters' bits. Every
test runs on every device present."""
import pytest
import torch
from torch import nn

import fusedamp
from model_helpers import _trained


# ---- norm layers by what they are -----------------------------------------------------------
class PreNorm(nn.Module):
    """ViT-style wrapper: a norm and a block. Not a norm layer itself."""

    def __init__(self, dim, fn):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.norm(x))


class ThirdPartyRMSNorm(nn.Module):
    """An RMSNorm that does not derive from torch's (as transformers' LlamaRMSNorm)."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (self.weight * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_norm_layers_by_type_not_by_container_name(device):
    model = nn.Sequential(PreNorm(16, nn.Sequential(nn.Linear(16, 64), nn.GELU(),
                                                    nn.Linear(64, 16))),
                          ThirdPartyRMSNorm(16), nn.Linear(16, 4)).to(device)
    fusedamp.convert_module(model, torch.bfloat16)
    fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert fp32 == {"0.norm.weight", "0.norm.bias", "1.weight"}
    assert model(torch.randn(2, 16, device=device)).dtype == torch.float32
    transformers = pytest.importorskip("transformers")
    llama_norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(8)
    assert fusedamp.is_norm_layer(llama_norm)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layer_norm_weight_gradients_keep_fp32_precision(device, dtype):
    """A LayerNorm of a converted model computes in FP32 from its 16-bit input, so the FP32
    weight's gradient is as accurate as in an FP32 model. (torch 2.11's CPU LayerNorm also takes
    16-bit input with FP32 weights directly, as autocast uses it, but its weight gradient is
    then off by about one 16-bit rounding: measured 2.7e-4 relative for FP16 and 4e-3 for BF16
    against the FP64 reference, where this path stays near 1e-7.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)).to(device)
    nn.init.normal_(model[1].weight)
    fusedamp.convert_module(model, dtype)
    x = torch.randn(8, 64, device=device)
    upstream = torch.randn(8, 64, device=device)
    model(x).mul(upstream).sum().backward()
    # FP64 reference from the same 16-bit activation that reached the norm layer.
    hidden = model[0](x.to(dtype)).detach().double().requires_grad_()
    reference = nn.LayerNorm(64).to(device).double()
    reference.load_state_dict({k: v.double() for k, v in model[1].state_dict().items()})
    reference(hidden).mul(upstream.to(dtype).double()).sum().backward()
    got, want = model[1].weight.grad.double(), reference.weight.grad
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_convert_module_dtypes_at_each_layer(device, dtype):
    """Norm parameters stay FP32; batch norm runs on the low-precision activations natively,
    the other norms get FP32 input; the model takes FP32 input and returns FP32."""
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                            torch.nn.Linear(4 * 4 * 4, 8), torch.nn.LayerNorm(8),
                            torch.nn.Linear(8, 2)).to(device)
    fusedamp.convert_module(m, dtype)
    seen = {}
    for name, mod in m.named_children():
        mod.register_forward_hook(
            lambda mod, inp, out, name=name: seen.__setitem__(name, (inp[0].dtype, out.dtype)))
    out = m(torch.randn(2, 3, 6, 6, device=device))
    assert out.dtype == torch.float32
    assert m[1].weight.dtype == m[1].running_mean.dtype == m[4].weight.dtype == torch.float32
    assert m[0].weight.dtype == m[3].weight.dtype == m[5].weight.dtype == dtype
    assert seen["1"] == (dtype, dtype)            # batch norm: native mixed precision
    assert seen["4"][0] == torch.float32          # layer norm computes in FP32 ...
    assert seen["5"][0] == dtype                  # ... and hands the model's dtype on
    out.sum().backward()
    assert m[0].weight.grad.dtype == dtype and m[1].weight.grad.dtype == torch.float32


# ---- an initialized model cast again ---------------------------------------------------------
def _norm_net(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
        torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.GroupNorm(4, 16),
        torch.nn.Linear(16, 3)).to(device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_initialized_model_cast_again_runs_as_that_dtype(device, dtype):
    """Evaluation and export after training: model.float(), .to(bf16) and .half() of an
    initialized model run (the casts follow the parameters' dtypes), equal to a plain model of
    the same weights, and the model runs as trained again once cast back."""
    model = _norm_net(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt, scaler = fusedamp.initialize(model, opt, dtype)
    x = torch.randn(8, 6, device=device)
    scaler.scale(model(x).square().mean()).backward()
    scaler.step(opt)
    scaler.update()
    model.eval()
    for cast in (torch.float32, torch.bfloat16, torch.float16):
        model.to(cast)
        plain = _norm_net(device).to(cast).eval()
        plain.load_state_dict(model.state_dict())
        out = model(x)
        assert out.dtype == cast
        assert torch.equal(out, plain(x.to(cast)))
    exported = torch.export.export(model.float(), (x,))
    assert torch.equal(exported.module()(x), model(x))
    model.to(dtype)  # as trained: its dtype inside, FP32 out, norm layers FP32 again
    for m in model.modules():
        if isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.BatchNorm1d)):
            m.float()
    assert model(x).dtype == torch.float32


# ---- a way back ------------------------------------------------------------------------------
def test_restore_gives_a_plain_module_and_the_fp32_masters(device):
    model, opt, _ = _trained(device)
    weights = fusedamp.master_weights(model, opt)
    sd = fusedamp.fp32_state_dict(model, opt)
    for name, p in model.named_parameters():
        assert weights[name].dtype == torch.float32
        assert torch.equal(sd[name], weights[name])
        master = opt.state[p].get("master_param")
        if master is not None:
            assert torch.equal(weights[name], master)  # the masters' bits, not the rounding
    fusedamp.restore(model, weights=weights)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), weights[name])
    x = torch.randn(2, 6, device=device)
    assert model(x).dtype == torch.float32
    model.to(torch.bfloat16)  # once crashed: the casting hooks stayed behind
    assert model(x.bfloat16()).dtype == torch.bfloat16
    fusedamp.convert_module(model, torch.float16)  # and can be converted again
