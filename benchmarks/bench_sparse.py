"""Embedding tables with sparse gradients: fusedamp's row-wise steps against torch's same
algorithm on the same tables, side by side in one run, taking turns.

Set-up (defaults): 8 tables x 200,000 rows x 64, nn.EmbeddingBag(mode="sum", sparse=True), a
batch of 2,048 bags of 20 lookups per table, indices skewed (a truncated power law over a
random ordering of the rows, ~Zipf with s = 1), one thread. For each algorithm both sides start
from the same tables and see the same gradients (uncoalesced, as autograd gives them); "step"
times optimizer.step() alone (the gradients precomputed), "fwd+bwd+step" the whole iteration.
The FP16 rows: an FP16 table with FP32 master rows stepped through fusedamp.GradScaler, against
torch's FP32 step. Ratios are torch's median time over fusedamp's, per round (> 1: fusedamp
faster). State bytes per row: what each optimizer keeps per table row after the run (torch's
SGD momentum is a sparse tensor that grows with every step).
"""
from __future__ import annotations

import gc
import statistics
import sys

import torch
import torch.nn as nn

import harness
from harness import machine, results, timing
from sparse import fbgemm_side

harness.use_paths("python")
import fusedamp  # noqa: E402

# name: (fusedamp's class, torch's class, arguments)
ALGORITHMS = {
    "sgd": (fusedamp.optim.SGD, torch.optim.SGD, dict(lr=0.01)),
    "sgd_momentum": (fusedamp.optim.SGD, torch.optim.SGD, dict(lr=0.01, momentum=0.9)),
    "adagrad": (fusedamp.optim.Adagrad, torch.optim.Adagrad, dict(lr=0.01)),
    "sparse_adam": (fusedamp.optim.SparseAdam, torch.optim.SparseAdam, dict(lr=0.001)),
    "rowwise_adagrad": (fusedamp.optim.RowWiseAdagrad, None, dict(lr=0.01)),
}


# The run's sizes (each a --option); batches: distinct batches, cycled.
SIZES = {"tables": 8, "rows": 200_000, "dim": 64, "batch": 2048, "pooling": 20, "batches": 3,
         "rounds": 10, "warmup": 2}


def skewed_indices(gen, rows, n, order):
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    rank = (rows ** u).floor().long().clamp_(1, rows) - 1  # P(rank) ~ 1 / rank
    return order[rank]


def make_batches(args, gen):
    """Per batch, per table: (flat indices, offsets) for EmbeddingBag."""
    orders = [torch.randperm(args.rows, generator=gen) for _ in range(args.tables)]
    offsets = torch.arange(0, args.batch * args.pooling, args.pooling)
    return [[(skewed_indices(gen, args.rows, args.batch * args.pooling, o), offsets)
             for o in orders] for _ in range(args.batches)]


class Tables(nn.Module):
    def __init__(self, weights, dtype):
        super().__init__()
        self.bags = nn.ModuleList(
            nn.EmbeddingBag.from_pretrained(w.to(dtype), freeze=False, mode="sum", sparse=True)
            for w in weights)

    def loss(self, batch, head):
        return sum((bag(i, o).float() * head).sum() for bag, (i, o) in zip(self.bags, batch))


def sparse_grads(model, batches, head):
    """Each batch's table gradients, as autograd gives them."""
    out = []
    for batch in batches:
        model.zero_grad(set_to_none=True)
        model.loss(batch, head).backward()
        out.append([b.weight.grad for b in model.bags])
    model.zero_grad(set_to_none=True)
    return out


def state_bytes_per_row(opt, tables):
    total = 0
    for p in tables:
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor):
                if v.is_sparse:
                    total += v._values().numel() * v.element_size() + v._indices().numel() * 8
                elif v.numel() > 1:
                    total += v.numel() * v.element_size()
    return total / sum(p.shape[0] for p in tables)


def run_algorithm(name, args, batches, weights, head):
    ours_cls, torch_cls, kwargs = ALGORITHMS[name]
    sides = {}
    setups = [("fusedamp", ours_cls, torch.float32, False)]
    if torch_cls is not None:
        setups.append(("torch", torch_cls, torch.float32, False))
    if name in args.fp16:
        setups.append(("fusedamp fp16+masters+scaler", ours_cls, torch.float16, True))
    for key, cls, dtype, scaled in setups:
        model = Tables(weights, dtype)
        opt = cls(model.parameters(), **kwargs)
        scaler = None
        if scaled:
            scaler = fusedamp.GradScaler("cpu", init_scale=1024.0)
            scaler.scale(torch.ones(()))  # the scale exists from the first iteration on
        grads = sparse_grads(model, batches, head)
        if scaled:  # the gradients a scaled loss gives
            grads = [[g * 1024.0 for g in gs] for gs in grads]
        sides[key] = dict(model=model, opt=opt, scaler=scaler, grads=grads, i=0)
    if args.fbgemm and name in fbgemm_side.OPTIMIZERS:
        fb = fbgemm_side.FbgemmTables(fbgemm_side.load(args.fbgemm), weights, name, kwargs)
        sides["fbgemm"] = dict(model=fb, opt=None, scaler=None, grads=None, i=0)

    def give_grads(side):
        def reset():  # untimed: the gradients a backward would leave (scaled ones are
            # unscaled in place by the step, so each step gets fresh copies)
            params = [b.weight for b in side["model"].bags]
            for p, g in zip(params, side["grads"][side["i"] % len(side["grads"])]):
                p.grad = g.clone() if side["scaler"] is not None else g
            side["i"] += 1
        return reset

    def stepper(side):
        def call():
            if side["scaler"] is None:
                side["opt"].step()
            else:
                side["scaler"].step(side["opt"])
                side["scaler"].update()
        return call

    def iteration(side):
        def call():
            batch = batches[side["i"] % len(batches)]
            side["i"] += 1
            loss = side["model"].loss(batch, head)
            if side["opt"] is None:  # FBGEMM: the step runs inside the backward
                loss.backward()
            elif side["scaler"] is None:
                side["opt"].zero_grad(set_to_none=True)
                loss.backward()
                side["opt"].step()
            else:
                side["opt"].zero_grad(set_to_none=True)
                side["scaler"].scale(loss).backward()
                side["scaler"].step(side["opt"])
                side["scaler"].update()
        return call

    out = {}
    for what, make in (("step", stepper), ("fwd+bwd+step", iteration)):
        timed = {k: s for k, s in sides.items() if what != "step" or k != "fbgemm"}
        reset = {k: give_grads(s) for k, s in timed.items()} if what == "step" else None
        times = timing.time_in_turns({k: make(s) for k, s in timed.items()}, args.rounds,
                                     warmup=args.warmup, order="rotate", reset=reset,
                                     gc_off=True)
        out[what] = {k: [t / 1e9 for t in wall] for k, (wall, _) in times.items()}
    out["state_bytes_per_row"] = {
        k: s["model"].state_bytes_per_row() if k == "fbgemm" else
        state_bytes_per_row(s["opt"], [b.weight for b in s["model"].bags])
        for k, s in sides.items()}
    return out


def report(args, found, info):
    rows = []
    for name, r in found.items():
        for what in ("step", "fwd+bwd+step"):
            t = r[what]
            cells = []
            for key in t:
                if key in ("torch", "fbgemm"):
                    continue
                for base in ("torch", "fbgemm"):
                    ratio = timing.paired_ratio(t[base], t[key]) if base in t else None
                    cells.append(results.ratio_cell(ratio, bold_below=1.0))
                rows.append([name, what, key, timing.fmt_ms(statistics.median(t[key]))] +
                            [timing.fmt_ms(statistics.median(t[b])) if b in t else "—"
                             for b in ("torch", "fbgemm")] + cells[-2:])
    lines = ["# Sparse embedding steps (CPU)", "",
             f"`{results.command(sys.argv[0])}`", "", __doc__.split("\n\n")[1].strip(), "",
             results.machine_sentence(info) + f" Load average at start: "
             f"{info.get('load_average_at_start', '?')}.", "",
             f"{args.tables} tables x {args.rows} rows x {args.dim}, batch {args.batch}, pooling "
             f"{args.pooling}, {args.rounds} rounds (median ms).", ""]
    lines += results.table(["algorithm", "timed", "fusedamp set-up", "fusedamp ms", "torch ms",
                            "FBGEMM ms", "torch / fusedamp", "FBGEMM / fusedamp"], "lllrrrrr",
                           rows)
    lines += ["", "Bytes per table row after the run: the table's own (dim x its element size) "
              "and the optimizer's state (an FP16 table's FP32 master counted as state):", ""]
    lines += results.table(["algorithm", "set-up", "table B/row", "state B/row"], "llrr", [
        [name, k, 2 * args.dim if "fp16" in k else 4 * args.dim, f"{v:.1f}"]
        for name, r in found.items() for k, v in r["state_bytes_per_row"].items()])
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = results.parser(__doc__)
    for option, default in SIZES.items():
        ap.add_argument(f"--{option}", type=int, default=default)
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--fp16", default="sgd,adagrad,rowwise_adagrad",
                    help="algorithms also run as FP16 tables with masters under a GradScaler")
    ap.add_argument("--fbgemm", default=None, metavar="DIR",
                    help="a folder holding fbgemm-gpu-cpu (pip install --target): adds FBGEMM's "
                         "TBE to the row-wise Adagrad and SGD iterations")
    results.add_output(ap)
    args = ap.parse_args(argv)
    args.fp16 = args.fp16.split(",")
    torch.set_num_threads(1)
    info = machine.machine_info("cpu")
    gen = torch.Generator().manual_seed(0)
    batches = make_batches(args, gen)
    weights = [torch.randn(args.rows, args.dim, generator=gen) * 0.1 for _ in range(args.tables)]
    head = torch.randn(args.dim, generator=gen)
    found = {}
    for name in args.algorithms.split(","):
        found[name] = run_algorithm(name, args, batches, weights, head)
        gc.collect()
        print(f"{name}: done", file=sys.stderr)
    text = report(args, found, info)
    print(text)
    folder = results.out_dir(args)
    if folder is not None:
        results.write_results(folder, "sparse_cpu", {"args": results.recorded(args),
                                                     "machine": info, "results": found}, text)


if __name__ == "__main__":
    main()
