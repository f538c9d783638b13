"""A DLRM-style recommender trained three ways: FP32, torch.amp (autocast FP16 + GradScaler)
and fusedamp (FP16 tables with FP32 master rows, FP16 MLPs with FP32 masters, one
fusedamp.GradScaler for both optimizers).

The model: sparse features looked up in embedding tables (nn.EmbeddingBag, sparse=True, one
bag of ids per table and example), dense features through a bottom MLP, the pooled embeddings
and the dense vector concatenated into a top MLP that predicts a click. The data is synthetic
with a learnable signal: each id has a hidden score (ids drawn with a Zipf-like skew), the click
probability is the sigmoid of the bag scores plus a linear function of the dense features.
Tables step with Adagrad (fusedamp.optim.Adagrad / torch.optim.Adagrad), the MLPs with AdamW.

    PYTHONPATH=python python3 examples/python/recommender.py [--steps 300]

prints each set-up's held-out loss (binary cross-entropy) and that of the true probabilities
(the floor no model can beat).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import fusedamp


class ClickData:
    def __init__(self, tables, rows, dense, pooling, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.gen, self.tables, self.rows, self.pooling = gen, tables, rows, pooling
        self.id_score = torch.randn(tables, rows, generator=gen) * 0.6
        self.dense_w = torch.randn(dense, generator=gen) * 0.5
        self.dense = dense

    def batch(self, n):
        u = torch.rand(self.tables, n * self.pooling, generator=self.gen, dtype=torch.float64)
        ids = ((self.rows ** u).floor().long().clamp_(1, self.rows) - 1)  # P(id) ~ 1 / id
        x = torch.randn(n, self.dense, generator=self.gen)
        bag_scores = sum(self.id_score[t][ids[t]].view(n, self.pooling).mean(1)
                         for t in range(self.tables))
        prob = torch.sigmoid(bag_scores + x @ self.dense_w - 0.5)
        y = torch.bernoulli(prob, generator=self.gen)
        return ids, x, y, prob


class DLRM(nn.Module):
    def __init__(self, tables, rows, dim, dense):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="mean", sparse=True)
                                  for _ in range(tables))
        for b in self.bags:
            nn.init.normal_(b.weight, std=0.05)
        self.bottom = nn.Sequential(nn.Linear(dense, 64), nn.ReLU(), nn.Linear(64, dim))
        self.top = nn.Sequential(nn.Linear(dim * (tables + 1), 128), nn.ReLU(),
                                 nn.Linear(128, 1))

    def forward(self, ids, x, pooling):
        n = x.shape[0]
        offsets = torch.arange(0, n * pooling, pooling)
        pooled = [bag(ids[t], offsets) for t, bag in enumerate(self.bags)]
        dense = self.bottom(x.to(self.bottom[0].weight.dtype))
        features = torch.cat([p.to(dense.dtype) for p in pooled] + [dense], dim=1)
        return self.top(features).float().squeeze(1)


def make_setup(mode, args):
    torch.manual_seed(1)  # the same initial weights for every set-up
    model = DLRM(args.tables, args.rows, args.dim, args.dense)
    tables = [b.weight for b in model.bags]
    mlp = [p for n, p in model.named_parameters() if not n.startswith("bags")]
    if mode == "fusedamp-fp16":
        model.half()
        opts = [fusedamp.optim.Adagrad(tables, lr=args.table_lr),
                fusedamp.optim.AdamW(mlp, lr=args.lr, weight_decay=0.0)]
        return model, opts, fusedamp.GradScaler("cpu")
    opts = [torch.optim.Adagrad(tables, lr=args.table_lr),
            torch.optim.AdamW(mlp, lr=args.lr, weight_decay=0.0)]
    return model, opts, torch.amp.GradScaler("cpu") if mode == "torch.amp" else None


def train(mode, args, data, test):
    model, opts, scaler = make_setup(mode, args)
    start = time.perf_counter()
    for _ in range(args.steps):
        ids, x, y, _ = data.batch(args.batch)
        for o in opts:
            o.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=mode == "torch.amp"):
            logits = model(ids, x, args.pooling)
        loss = F.binary_cross_entropy_with_logits(logits.float(), y)
        if scaler is None:
            loss.backward()
            for o in opts:
                o.step()
        else:
            scaler.scale(loss).backward()
            for o in opts:
                scaler.step(o)
            scaler.update()
    seconds = time.perf_counter() - start
    ids, x, y, _ = test
    with torch.no_grad():
        held_out = F.binary_cross_entropy_with_logits(model(ids, x, args.pooling), y).item()
    return held_out, seconds


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--dense", type=int, default=8)
    ap.add_argument("--pooling", type=int, default=5)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--table-lr", type=float, default=0.05)
    args = ap.parse_args(argv)
    test = ClickData(args.tables, args.rows, args.dense, args.pooling, seed=0)
    test.gen.manual_seed(123)
    held = test.batch(4096)
    floor = F.binary_cross_entropy(held[3], held[2]).item()
    print(f"held-out BCE of the true probabilities (the floor): {floor:.4f}")
    for mode in ("fp32", "torch.amp", "fusedamp-fp16"):
        data = ClickData(args.tables, args.rows, args.dense, args.pooling, seed=0)
        loss, seconds = train(mode, args, data, held)
        print(f"{mode:>14}: held-out BCE {loss:.4f} after {args.steps} steps ({seconds:.1f} s)")


if __name__ == "__main__":
    main()
