"""Data-parallel training of the demo's character-level GPT with fusedamp.

    torchrun --nproc_per_node=2 examples/python/train_distributed.py [--steps 50] [--mode both]

Trains the model twice from the same initial weights, a fusedamp.initialize'd FP16 model wrapped
in DistributedDataParallel both times: once with fusedamp.optim.AdamW (every rank keeps the full
FP32 master weights and moments), once with fusedamp.distributed.ZeroRedundancyOptimizer
(torch's ZeRO-1 over fusedamp's AdamW: each rank keeps the state of its partition, about 1/N).
Prints the loss and each rank's optimizer-state bytes. Gloo on CPU, NCCL on GPU (one rank per
GPU).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
import fusedamp  # noqa: E402
from fusedamp.distributed import ZeroRedundancyOptimizer, optimizer_state_bytes  # noqa: E402
from amp_models import CharGPT, char_batch, char_data  # noqa: E402  (the demo's model and data)


def train(mode, args, device, rank, world, data, vocab):
    torch.manual_seed(0)  # the same initial weights on every rank and in both modes
    model = CharGPT(vocab, context=args.context, dim=args.dim, layers=args.layers).to(device)
    if mode == "ddp":
        base = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        model, opt, scaler = fusedamp.initialize(model, base, torch.float16, max_grad_norm=1.0)
    else:  # the same training, each rank stepping its partition of the parameters
        fusedamp.convert_module(model, torch.float16)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=fusedamp.optim.AdamW,
                                      lr=args.lr, weight_decay=0.1, max_grad_norm=1.0)
        scaler = fusedamp.GradScaler(device.type)
    ids = [device.index] if device.type == "cuda" else None
    net = DDP(model, device_ids=ids)
    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own part of the batch
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = char_batch(data, args.batch // world, args.context, gen)
        logits = net(x)
        loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            if rank == 0:
                print(f"[{mode:7s}] step {step:4d}  loss {avg.item() / world:.4f}  "
                      f"scale {scaler.get_scale():g}", flush=True)
    elapsed = time.perf_counter() - t0
    state = torch.tensor([optimizer_state_bytes(opt)], dtype=torch.int64, device=device)
    per_rank = [torch.zeros_like(state) for _ in range(world)]
    dist.all_gather(per_rank, state)
    skipped = opt.skipped_steps
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"[{mode:7s}] {n_params} parameters, {args.steps} steps in {elapsed:.1f} s, "
              f"{int(skipped.item()) if skipped is not None else 0} skipped; optimizer-state "
              f"bytes per rank: {[int(b.item()) for b in per_rank]}", flush=True)
    # Every rank must hold the same weights: compare a checksum.
    check = torch.stack([p.detach().float().sum() for p in model.parameters()]).sum().reshape(1)
    sums = [torch.zeros_like(check) for _ in range(world)]
    dist.all_gather(sums, check)
    if rank == 0:
        same = all(torch.equal(s, sums[0]) for s in sums)
        print(f"[{mode:7s}] parameters identical on every rank: {same}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("ddp", "zero", "both"), default="both")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=24, help="global batch (split over ranks)")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the world size {world}")
    data, _, vocab = char_data(device, context=args.context)
    if rank == 0:
        print(f"{world} ranks, backend {dist.get_backend()}, device {device.type}", flush=True)
    for mode in (("ddp", "zero") if args.mode == "both" else (args.mode,)):
        train(mode, args, device, rank, world, data, vocab)
    dist.barrier()  # let every rank finish its last collective before the teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
