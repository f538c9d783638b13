"""The engines bench_distributed.py compares, each built on one rank from the same initial
weights: FSDP2 (fully_shard) with fusedamp.optim.AdamW on the FP32 shards, and DDP with
fusedamp.distributed.ZeroRedundancyOptimizer on the converted BF16 model; what each rank holds
as optimizer state; the full weights after training."""
from __future__ import annotations

# The ddp+zero rows first: the reference of the ratios and of the loss agreement.
ENGINES = ("ddp+zero", "ddp+zero-bv", "fsdp2", "fsdp2-bf16r")
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _model(vocab, args):
    import torch
    from amp_models import CharGPT

    torch.manual_seed(0)  # the same initial weights for every engine and rank
    return CharGPT(vocab, context=args["context"], dim=args["dim"], layers=args["layers"],
                   heads=args["heads"])


def converted_model(vocab, args):
    """The model as fusedamp.convert_module leaves it: BF16 weights, FP32 norm layers."""
    import torch

    import fusedamp

    model = _model(vocab, args)
    fusedamp.convert_module(model, torch.bfloat16)
    return model


def build(name, vocab, args, mesh):
    """(module to call, optimizer, module whose weights are the model) for engine ``name``."""
    import torch
    import torch.distributed as dist

    import fusedamp

    if name.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = _model(vocab, args)
        # The other engines start from the BF16-rounded initial weights (their FP32 masters
        # are made from the converted model); so does this one, so that all of them train
        # from the same point and their losses can be compared step for step.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        # fsdp2-bf16r reduce-scatters the gradients in BF16: half fsdp2's bytes on the wire.
        reduce_dtype = torch.bfloat16 if name.endswith("-bf16r") else torch.float32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        opt = fusedamp.optim.AdamW(model.parameters(), master_weights=True, **ADAMW)
        return model, opt, model
    if name.startswith("ddp+zero"):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel as DDP

        from fusedamp.distributed import ZeroRedundancyOptimizer

        model = converted_model(vocab, args)
        if name.endswith("-bv"):
            # torch's flat bucket views take parameters of one dtype (ValueError: "only
            # supports using the same dense type for all parameters"), and the converted model
            # keeps its norm layers in FP32: they go to BF16 too (the converted model's casts
            # follow), as FSDP2's policy casts them. Their FP32 masters stay in the optimizer.
            model.to(torch.bfloat16)
        net = DDP(model)
        # DDP's built-in all-reduce runs in C++, out of reach of the Python wrappers that count
        # bytes; torch's allreduce_hook is the same averaging all-reduce of each bucket made
        # through dist.all_reduce (one Python call per bucket, a few per step).
        net.register_comm_hook(dist.group.WORLD, allreduce_hook)
        # Without the bucket view ZeRO broadcasts every parameter on its own (54 calls a step
        # here); with it, one bucket per rank, which an all-BF16 model allows.
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=fusedamp.optim.AdamW,
                                      parameters_as_bucket_view=name.endswith("-bv"),
                                      master_weights=True, **ADAMW)
        return net, opt, model
    raise ValueError(name)


def state_bytes(name, opt, model):
    """(optimizer state, state + FP32 master weights) held by this rank, in bytes."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    if name.startswith("ddp+zero"):  # the local fusedamp optimizer's state holds master_param
        b = sum(v.nbytes for s in opt.optim.state.values() for v in s.values()
                if hasattr(v, "nbytes"))
        return b, b
    # FSDP2: the moments are DTensors laid out like the parameters; the FP32 parameter shards
    # are the masters, held by the model rather than the optimizer.
    b = sum(local(v).nbytes for s in opt.state.values() for v in s.values()
            if hasattr(v, "nbytes"))
    return b, b + sum(local(p).nbytes for p in model.parameters())


def full_weights(model):
    import torch

    with torch.no_grad():
        return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).float().reshape(-1)
                          for p in model.parameters()])
