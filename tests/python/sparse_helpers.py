"""What the sparse-embedding tests share: the algorithms side by side with torch's, sparse
gradients as nn.Embedding(sparse=True) gives them, tables, a model of tables and a dense head,
and the snapshot a failed call must leave unchanged."""
import torch
import torch.nn as nn

import fusedamp

ROWS, DIM = 50, 20  # DIM: one partial pair on AVX-512 (32 lanes), a whole pair and a tail on AVX2

# Each algorithm: fusedamp's optimizer and torch's, with the same arguments.
ALGORITHMS = {
    "sgd": (fusedamp.optim.SGD, torch.optim.SGD, dict(lr=0.1)),
    "sgd_momentum": (fusedamp.optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9,
                                                              dampening=0.1)),
    "sgd_nesterov": (fusedamp.optim.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9,
                                                              nesterov=True)),
    "adagrad": (fusedamp.optim.Adagrad, torch.optim.Adagrad,
                dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)),
    "sparse_adam": (fusedamp.optim.SparseAdam, torch.optim.SparseAdam,
                    dict(lr=0.01, betas=(0.8, 0.99))),
    "sparse_adam_maximize": (fusedamp.optim.SparseAdam, torch.optim.SparseAdam,
                             dict(lr=0.01, maximize=True)),
}
# Everything fusedamp steps sparse tables with (the row-wise one has no torch twin).
SPARSE_OPTIMIZERS = {
    "sgd_momentum": (fusedamp.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "adagrad": (fusedamp.optim.Adagrad, dict(lr=0.1)),
    "sparse_adam": (fusedamp.optim.SparseAdam, dict(lr=0.01)),
    "rowwise_adagrad": (fusedamp.optim.RowWiseAdagrad, dict(lr=0.1)),
}

# Each case: the op, its state (None: no momentum buffer) and its hyper-parameters.
OPS = {
    "sgd": ("sparse_sgd_step_", [None], dict(lr=0.1)),
    "sgd_momentum": ("sparse_sgd_step_", ["table"], dict(lr=0.1, momentum=0.9, dampening=0.2)),
    "adagrad": ("sparse_adagrad_step_", ["table"], dict(lr=0.1, lr_decay=0.05, eps=1e-6)),
    "adam": ("sparse_adam_step_", ["table", "table"],
             dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8)),
    "rowwise_adagrad": ("sparse_rowwise_adagrad_step_", ["rows"], dict(lr=0.1, eps=1e-6)),
}


def sparse_grad(gen, rows=ROWS, dim=DIM, nnz=60, dtype=torch.float32, device="cpu",
                scale=1.0):
    """An uncoalesced row-wise gradient as nn.Embedding(sparse=True) gives: duplicates
    included (60 lookups into 50 rows, skewed towards the first rows)."""
    idx = (torch.rand(nnz, generator=gen) ** 2 * rows).long()
    values = torch.randn(nnz, dim, generator=gen) * scale
    return torch.sparse_coo_tensor(idx[None], values.to(dtype), (rows, dim),
                                   device=device)


def table(gen, dtype=torch.float32, device="cpu"):
    return nn.Parameter(torch.randn(ROWS, DIM, generator=gen).to(device=device, dtype=dtype))


def step_side_by_side(gen, pairs, steps):
    """The same sparse gradients, `steps` times, into each (parameter, optimizer) pair (on the
    first parameter's device)."""
    for _ in range(steps):
        g = sparse_grad(gen, device=pairs[0][0].device)
        for p, opt in pairs:
            p.grad = g.clone()
            opt.step()


def snapshot(p, opt):
    return [p.detach().clone()] + [v.clone() for v in opt.state[p].values()
                                   if isinstance(v, torch.Tensor)]


def unchanged(p, opt, snap):
    now = snapshot(p, opt)
    return len(now) == len(snap) and all(torch.equal(x, y) for x, y in zip(now, snap))


class TablesAndHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids, offsets):
        return self.head(self.bag(ids, offsets)).sum()


def bag_batch(gen, device="cpu"):
    ids = (torch.rand(48, generator=gen) ** 2 * ROWS).long()
    return ids.to(device), torch.arange(0, 48, 6, device=device)
