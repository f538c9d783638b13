"""The demo's models and data: real data that ships with a package or with Python itself.

- digits: scikit-learn's 8x8 handwritten digits (1,797 images), a small CNN with BatchNorm;
- chars:  a character-level GPT (pre-norm transformer, causal attention) trained on the Python
  standard library's own source files.

Also the four training set-ups compared everywhere (demo, end-to-end benchmark, tests):
FP32, torch.amp (autocast FP16 + GradScaler + AdamW), fusedamp FP16 and fusedamp BF16.
"""
from __future__ import annotations

import glob
import math
import os
import sysconfig

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("fp32", "torch.amp", "fusedamp-fp16", "fusedamp-bf16")


# ------------------------------------------------------------------------------- data
def digits_data(device, seed=0):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=g)
    x, y = x[perm], y[perm]
    n_train = 1500
    return ((x[:n_train].to(device), y[:n_train].to(device)),
            (x[n_train:].to(device), y[n_train:].to(device)))


def stdlib_text(max_chars=600_000):
    """Concatenated source of the standard library's modules (same files on every machine
    with this Python version), restricted to printable ASCII."""
    root = sysconfig.get_paths()["stdlib"]
    parts, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, encoding="utf-8", errors="ignore") as f:
            text = "".join(c for c in f.read() if c == "\n" or 32 <= ord(c) < 127)
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def char_data(device, context=64):
    text = stdlib_text()
    vocab = sorted(set(text))
    stoi = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n = int(0.9 * len(data))
    return data[:n].to(device), data[n:].to(device), len(vocab)


def char_batch(data, batch, context, generator):
    ix = torch.randint(0, len(data) - context - 1, (batch,), generator=generator)
    ix = ix.to(data.device)
    offs = torch.arange(context, device=data.device)
    x = data[ix[:, None] + offs]
    y = data[ix[:, None] + offs + 1]
    return x, y


# ------------------------------------------------------------------------------- models
class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 16, 128), nn.ReLU(),
                                  nn.Linear(128, 10))

    def forward(self, x):
        return self.head(self.features(x))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.heads = heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab, context=64, dim=128, layers=2, heads=4):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        return self.head(self.ln(self.blocks(x)))


# ------------------------------------------------------------------------------- set-ups
class Setup:
    """One training set-up: model + optimizer + the per-step recipe of its mode."""

    def __init__(self, mode, model, lr, weight_decay, device, max_grad_norm=None):
        import fusedamp

        self.mode, self.device, self.max_grad_norm = mode, device, max_grad_norm
        dev_type = torch.device(device).type
        self.autocast_dtype = None
        if mode == "fp32":
            self.model = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                                         fused=True)
            self.scaler = None
        elif mode == "torch.amp":
            self.model = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                                         fused=True)
            self.scaler = torch.amp.GradScaler(dev_type)
            self.autocast_dtype = torch.float16
        elif mode in ("fusedamp-fp16", "fusedamp-bf16"):
            dtype = torch.float16 if mode.endswith("fp16") else torch.bfloat16
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
            self.model, self.opt, self.scaler = fusedamp.initialize(
                model, opt, dtype, max_grad_norm=max_grad_norm)
        else:
            raise ValueError(mode)
        self.fused = mode.startswith("fusedamp")

    def train_step(self, loss_fn, *batch):
        dev_type = torch.device(self.device).type
        if self.autocast_dtype is not None:
            with torch.autocast(dev_type, dtype=self.autocast_dtype):
                loss = loss_fn(self.model, *batch)
        else:
            loss = loss_fn(self.model, *batch)
        if self.scaler is not None and self.scaler.is_enabled():
            self.scaler.scale(loss).backward()
            if self.max_grad_norm and not self.fused:
                self.scaler.unscale_(self.opt)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            if self.max_grad_norm and not self.fused:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def skipped_steps(self):
        if self.fused:
            s = self.opt.skipped_steps
            return 0 if s is None else int(s.item())
        return None  # torch.amp does not count them

    def scale(self):
        if self.scaler is None or not self.scaler.is_enabled():
            return None
        return float(self.scaler.get_scale())


def digits_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def char_loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


@torch.no_grad()
def digits_eval(model, x, y, autocast_dtype=None):
    model.eval()
    with torch.autocast(x.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        logits = model(x).float()
    model.train()
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


@torch.no_grad()
def char_eval(model, data, context, autocast_dtype=None, batches=8):
    model.eval()
    g = torch.Generator().manual_seed(1234)
    total = 0.0
    for _ in range(batches):
        x, y = char_batch(data, 32, context, g)
        with torch.autocast(x.device.type, dtype=autocast_dtype,
                            enabled=autocast_dtype is not None):
            total += char_loss(model, x, y).item()
    model.train()
    return total / batches, math.exp(total / batches)
