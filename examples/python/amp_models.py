"""The demo's models and data: real data that ships with a package or with Python itself.

- digits: scikit-learn's 8x8 handwritten digits (1,797 images), a small CNN with BatchNorm;
- chars:  a character-level GPT (pre-norm transformer, causal attention) trained on the Python
  standard library's own source files.

Also the four training set-ups compared everywhere (demo, end-to-end benchmark, tests):
FP32, torch.amp (autocast FP16 + GradScaler + AdamW), fusedamp FP16 and fusedamp BF16.
"""
from __future__ import annotations

import functools
import glob
import math
import os
import resource
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("fp32", "torch.amp", "fusedamp-fp16", "fusedamp-bf16")
# torch.amp with autocast bfloat16 (no scaler): fusedamp BF16's like-for-like reference
# (bench_train runs it; the demo keeps the four above).
TORCH_AMP_BF16 = "torch.amp-bf16"
# The torch.amp set-up each mode is compared with: the same low-precision dtype.
REFERENCE_OF = {"fp32": "torch.amp", "torch.amp": "torch.amp", "fusedamp-fp16": "torch.amp",
                "fusedamp-bf16": TORCH_AMP_BF16, TORCH_AMP_BF16: TORCH_AMP_BF16}


def reference_run(results, r):
    """The run of `results` that run `r` is compared with: its model under REFERENCE_OF's
    set-up for r's."""
    return next(b for b in results
                if b["model"] == r["model"] and b["mode"] == REFERENCE_OF[r["mode"]])


# ------------------------------------------------------------------------------- data
# Cached: train_run loads a task's data before it starts counting memory (see _load_inputs).
@functools.lru_cache(maxsize=None)
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


@functools.lru_cache(maxsize=None)
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

    def __init__(self, mode, model, lr, weight_decay, device, max_grad_norm=None,
                 scaler_args=None, eps=1e-8):
        import fusedamp

        self.mode, self.device, self.max_grad_norm = mode, device, max_grad_norm
        dev_type = torch.device(device).type
        self.autocast_dtype = None
        if mode == "fp32":
            self.model = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                                         eps=eps, fused=True)
            self.scaler = None
        elif mode in ("torch.amp", TORCH_AMP_BF16):
            self.model = model
            self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                                         eps=eps, fused=True)
            bf16 = mode == TORCH_AMP_BF16
            self.scaler = None if bf16 else torch.amp.GradScaler(dev_type)
            self.autocast_dtype = torch.bfloat16 if bf16 else torch.float16
        elif mode in ("fusedamp-fp16", "fusedamp-bf16"):
            dtype = torch.float16 if mode.endswith("fp16") else torch.bfloat16
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, eps=eps)
            self.model, self.opt, self.scaler = fusedamp.initialize(
                model, opt, dtype, max_grad_norm=max_grad_norm, **(scaler_args or {}))
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

    def scale_curve(self):
        """The loss scale of each step (the one its gradients carried), from fusedamp's
        telemetry; None without a fusedamp scaler (torch.amp keeps no record)."""
        if not self.fused or not self.scaler.is_enabled():
            return None
        return self.scaler.telemetry()["scale"]


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
    """Mean validation loss of ``model`` (any callable idx -> logits; the caller switches
    it to eval mode) and its perplexity."""
    g = torch.Generator().manual_seed(1234)
    total = 0.0
    for _ in range(batches):
        x, y = char_batch(data, 32, context, g)
        with torch.autocast(x.device.type, dtype=autocast_dtype,
                            enabled=autocast_dtype is not None):
            total += char_loss(model, x, y).item()
    return total / batches, math.exp(total / batches)


# ------------------------------------------------------------------------------- one run
MODELS = ("digits-cnn", "char-gpt", "resnet18", "gpt2")


def _rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _task(model_name, mode, device, seed, scaler_args=None, batch_size=None, loss_factor=1.0):
    """(setup, batch(), loss_fn, evaluate()) for one model; scaler_args go to
    fusedamp.initialize (fusedamp set-ups); batch_size: None for the model's own (64 digits,
    32 sequences). loss_factor (char models): the loss will be multiplied by it, so AdamW's eps
    and the clipping threshold are too, which leaves the exact-arithmetic trajectory unchanged."""
    g = torch.Generator().manual_seed(seed)
    if model_name == "digits-cnn":
        (xtr, ytr), (xte, yte) = digits_data(device)
        setup = Setup(mode, DigitsCNN().to(device), lr=3e-3, weight_decay=1e-4, device=device,
                      scaler_args=scaler_args)

        def batch():
            ix = torch.randint(0, len(xtr), (batch_size or 64,), generator=g).to(device)
            return xtr[ix], ytr[ix]

        def evaluate():
            loss, acc = digits_eval(setup.model, xte, yte, setup.autocast_dtype)
            return {"eval_loss": loss, "accuracy": acc}

        return setup, batch, digits_loss, evaluate
    if model_name in ("char-gpt", "gpt2"):
        context = 64
        train, val, vocab = char_data(device, context)
        if model_name == "char-gpt":
            model = CharGPT(vocab, context)
            loss_fn = char_loss
        else:  # transformers' GPT-2 architecture from a small config, no downloaded weights
            import transformers

            cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=context, n_embd=128,
                                          n_layer=2, n_head=4, bos_token_id=0,
                                          eos_token_id=0)
            model = transformers.GPT2LMHeadModel(cfg)

            def loss_fn(m, x, y):
                return char_loss(lambda idx: m(idx).logits, x, y)
        setup = Setup(mode, model.to(device), lr=2e-3, weight_decay=0.01, device=device,
                      max_grad_norm=loss_factor, scaler_args=scaler_args, eps=1e-8 * loss_factor)

        def batch():
            return char_batch(train, batch_size or 32, context, g)

        def evaluate():
            fwd = setup.model if model_name == "char-gpt" else (
                lambda idx: setup.model(idx).logits)
            setup.model.eval()
            loss, ppl = char_eval(fwd, val, context, setup.autocast_dtype)
            setup.model.train()
            return {"eval_loss": loss, "perplexity": ppl}

        return setup, batch, loss_fn, evaluate
    if model_name == "resnet18":  # torchvision's architecture on CIFAR-sized synthetic images
        import torchvision

        model = torchvision.models.resnet18(weights=None, num_classes=10).to(device)
        setup = Setup(mode, model, lr=1e-3, weight_decay=1e-4, device=device)
        xs = torch.randn(16, 3, 32, 32, generator=g).to(device)
        ys = torch.randint(0, 10, (16,), generator=g).to(device)

        def batch():
            return xs, ys

        def evaluate():
            return {}

        return setup, batch, digits_loss, evaluate
    raise ValueError(model_name)


def _load_inputs(model_name, device):
    """The imports and (cached) data of a task, as _task will use them."""
    if model_name == "digits-cnn":
        digits_data(device)
    elif model_name in ("char-gpt", "gpt2"):
        char_data(device, 64)
        if model_name == "gpt2":
            import transformers  # noqa: F401
    elif model_name == "resnet18":
        import torchvision  # noqa: F401


def train_run(model_name, mode, steps, seed=0, progress=False, batch_size=None):
    """Trains one model under one set-up; returns curves, timings, memory and results."""
    from tqdm import tqdm

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    # The CPU's peak is counted from after the task's imports and data and before the model
    # exists, so that every set-up's weights are in it (torch.amp's FP32 weights as much as
    # fusedamp's 16-bit weights and masters) and nothing else.
    _load_inputs(model_name, device)
    rss0 = _rss_mb()
    setup, batch, loss_fn, evaluate = _task(model_name, mode, device, seed, batch_size=batch_size)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    bar = tqdm(range(steps), desc=f"{model_name:>10s} {mode:<14s}", ncols=90, mininterval=1.0,
               disable=None if progress else True)
    for _ in bar:
        xb, yb = batch()
        t0 = time.perf_counter()
        loss = setup.train_step(loss_fn, xb, yb)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    losses = [float(v) for v in torch.stack(losses).float().cpu().tolist()]
    warm = times[steps // 5:] or times
    result = {
        "model": model_name, "mode": mode, "device": device, "steps": steps,
        "batch_size": batch_size,
        "loss_curve": losses, "scale_curve": setup.scale_curve(),
        "final_train_loss": sum(losses[-20:]) / min(20, len(losses)),
        "ms_per_step": 1e3 * sorted(warm)[len(warm) // 2],
        "skipped_steps": setup.skipped_steps(), "final_scale": setup.scale(),
    }
    result.update(evaluate())
    if device == "cuda":
        result["peak_mem_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
    else:  # growth of the process's peak resident set from before the model was made
        result["peak_mem_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0
    return result


def policy_run(model_name, policy, steps, *, init_scale=2.0 ** 16, loss_factor=1.0, seed=0,
               batch_size=None):
    """A fusedamp FP16 run under a loss-scale policy ("torch" or "amax"), optionally with the
    loss multiplied by `loss_factor` (a deliberately tiny loss); returns the scaler's telemetry,
    the per-step losses (divided back by loss_factor) and the evaluation."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    setup, batch, loss_fn, evaluate = _task(model_name, "fusedamp-fp16", device, seed,
                                            scaler_args=dict(policy=policy,
                                                             init_scale=init_scale),
                                            batch_size=batch_size, loss_factor=loss_factor)

    def scaled_loss(model, x, y):
        return loss_fn(model, x, y) * loss_factor

    losses = [setup.train_step(scaled_loss, *batch()) for _ in range(steps)]
    return {"telemetry": setup.scaler.telemetry(setup.model),
            "loss": [v / loss_factor for v in torch.stack(losses).float().cpu().tolist()],
            "eval": evaluate()}
