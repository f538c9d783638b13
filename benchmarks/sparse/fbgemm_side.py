"""FBGEMM's table-batched embeddings (fbgemm-gpu-cpu) as a side of bench_sparse.py: the same
tables and batches in one SplitTableBatchedEmbeddingBagsCodegen on the CPU, its optimizer fused
into the backward (so it has an iteration time, not a step time of its own). Only
EXACT_ROWWISE_ADAGRAD and EXACT_SGD exist on the CPU.

    pip install --no-deps --target DIR fbgemm-gpu-cpu==1.6.0
    python3 benchmarks/bench_sparse.py --fbgemm DIR
"""
from __future__ import annotations

import logging
import sys

import torch

OPTIMIZERS = {"rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "sgd": "EXACT_SGD"}


def load(path):
    sys.path.insert(0, path)
    logging.getLogger().setLevel(logging.ERROR)  # its torch-version table warns on import
    from fbgemm_gpu import split_table_batched_embeddings_ops_training as tbe  # noqa: F401
    return tbe


class FbgemmTables:
    """One TBE module over all tables; loss() as bench_sparse.Tables'."""

    def __init__(self, tbe, weights, name, kwargs, eps=1e-10):
        from fbgemm_gpu.split_embedding_configs import SparseType
        specs = [(w.shape[0], w.shape[1], tbe.EmbeddingLocation.HOST, tbe.ComputeDevice.CPU)
                 for w in weights]
        self.module = tbe.SplitTableBatchedEmbeddingBagsCodegen(
            specs, optimizer=getattr(tbe.OptimType, OPTIMIZERS[name]),
            learning_rate=kwargs["lr"], eps=eps, weights_precision=SparseType.FP32,
            pooling_mode=tbe.PoolingMode.SUM)
        with torch.no_grad():
            for table, w in zip(self.module.split_embedding_weights(), weights):
                table.copy_(w)
        self.tables = len(weights)

    def loss(self, batch, head):
        indices = torch.cat([i for i, _ in batch])
        bags = sum(o.numel() for _, o in batch)
        pooling = batch[0][0].numel() // batch[0][1].numel()
        offsets = torch.arange(0, bags * pooling + 1, pooling)
        out = self.module(indices, offsets)  # [batch, tables * dim]
        return (out.view(out.shape[0], self.tables, -1) * head).sum()

    def state_bytes_per_row(self):
        states = self.module.split_optimizer_states()
        rows = sum(t.shape[0] for t in self.module.split_embedding_weights())
        return sum(s.numel() * s.element_size() for st in states for s in st) / rows
