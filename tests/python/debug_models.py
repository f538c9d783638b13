"""Small models with a switchable fault, shared by the fusedamp.debug tests.

The fault is set through buffers (`Fault.forward_mul`, `Fault.backward_mul`), never through
Python attributes, so a torch.compile'd model runs the same graph with and without it.
"""
import torch
from torch import nn


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `mul` (a one-element tensor)."""

    @staticmethod
    def forward(ctx, x, mul):
        ctx.save_for_backward(mul)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (mul,) = ctx.saved_tensors
        return grad * mul, None


class Fault(nn.Module):
    """A Linear whose output is multiplied by forward_mul (forward) and whose output gradient is
    multiplied by backward_mul (backward only): set either to inf, or to 1e-30, to inject."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("forward_mul", torch.ones(1))
        self.register_buffer("backward_mul", torch.ones(1))

    def forward(self, x):
        y = self.lin(x) * self.forward_mul
        return _ScaleGradient.apply(y, self.backward_mul)

    def inject(self, forward=1.0, backward=1.0):
        self.forward_mul.fill_(forward)
        self.backward_mul.fill_(backward)


class Residual(nn.Module):
    """Linear, LayerNorm, `out += identity`, ReLU(inplace=True): the in-place patterns."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.norm(self.lin(x))
        out += x
        return self.relu(out)


def mlp(width=16):
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(inplace=True), Residual(width),
                         Fault(width), Residual(width), nn.Linear(width, 4))


class BasicBlock(nn.Module):
    """ResNet's basic block: conv, BN, ReLU(inplace), conv, BN, `out += identity`, ReLU."""

    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class FaultConv(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.fault = Fault(channels)

    def forward(self, x):   # the Linear acts on channels
        return self.fault(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    def inject(self, **kw):
        self.fault.inject(**kw)


class CNN(nn.Module):
    def __init__(self, channels=4):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.block1 = BasicBlock(channels)
        self.middle = FaultConv(channels)
        self.block2 = BasicBlock(channels)
        self.head = nn.Linear(channels, 3)

    def forward(self, x):
        x = self.block2(self.middle(self.block1(self.stem(x))))
        return self.head(x.mean((2, 3)))


def cnn():
    return CNN()


# name of the injected module, the model, an input batch
MODELS = {
    "mlp": ("3", mlp, lambda: torch.randn(6, 8)),
    "cnn": ("middle.fault", cnn, lambda: torch.randn(2, 3, 6, 6)),
}


def fault_of(model, kind):
    return model[3] if kind == "mlp" else model.middle


def tiny_gpt2():
    import transformers
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)
