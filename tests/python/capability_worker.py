"""Runs a fixed set of fused steps on the CPU and saves every result, for
test_cpu_capabilities.py: run once per instruction set (ATEN_CPU_CAPABILITY=default / avx2 /
the machine's best), the files must hold the same bits. test_cuda_same_bits.py runs the same
steps on CUDA (run_case's and split_edges' device).

    python capability_worker.py OUT.pt
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import fusedamp  # noqa: E402

# Sizes that leave partial vectors, partial 8-bit blocks and a tail past the last full group.
SHAPES = [(7,), (33, 3), (257, 129), (3000,)]
LR = 1e-2

# (name, optimizer, parameter dtype, constructor arguments). A case that steps without the
# non-finite skip gets an inf, a -inf and a NaN gradient element on its second step (8-bit
# states keep them to their elements: math/quantized_moments_math.h).
CASES = [
    ("adamw_fp32", "AdamW", torch.float32, dict(weight_decay=0.1)),
    ("adam_amsgrad_bf16_state", "Adam", torch.float32,
     dict(amsgrad=True, state_dtype=torch.bfloat16, weight_decay=0.01)),
    ("adamw_fp16_master", "AdamW", torch.float16, dict(master_weights=True)),
    ("adamw_bf16_split", "AdamW", torch.bfloat16, dict(master_weights="split")),
    ("adamw_bf16_split8_int8", "AdamW", torch.bfloat16,
     dict(master_weights="split8", state_dtype=torch.int8)),
    ("adamw_bf16_master_int8", "AdamW", torch.bfloat16,
     dict(master_weights=True, state_dtype=torch.int8)),
    ("adamw_bf16_kahan", "AdamW", torch.bfloat16, dict(master_weights="kahan")),
    ("adamw_bf16_stochastic", "AdamW", torch.bfloat16,
     dict(master_weights="stochastic", rounding_seed=5)),
    ("sgd_nesterov", "SGD", torch.float32, dict(momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("sgd_bf16_split_dampening", "SGD", torch.bfloat16,
     dict(momentum=0.9, dampening=0.1, master_weights="split")),
    ("sgd_bf16_split_int8", "SGD", torch.bfloat16,
     dict(momentum=0.9, master_weights="split", state_dtype=torch.int8)),
    ("adamw_bf16_master_int8_nonfinite", "AdamW", torch.bfloat16,
     dict(master_weights=True, state_dtype=torch.int8, skip_nonfinite=False)),
    ("sgd_fp32_int8_nonfinite", "SGD", torch.float32,
     dict(momentum=0.9, weight_decay=0.01, state_dtype=torch.int8, skip_nonfinite=False)),
]

# Clipped steps: every clipped element depends on the global norm's sum of squares. The CPU
# builds take it in the same order; CUDA in another (test_cuda_same_bits.py runs CASES only).
CPU_ONLY_CASES = [
    ("adamw_fp32_clipped", "AdamW", torch.float32, dict(weight_decay=0.1, max_grad_norm=0.05)),
    ("adamw_fp16_master_clipped", "AdamW", torch.float16,
     dict(master_weights=True, max_grad_norm=0.05)),
    ("sgd_bf16_split_clipped", "SGD", torch.bfloat16,
     dict(momentum=0.9, master_weights="split", max_grad_norm=0.05)),
]
# Sizes for the sum of squares alone: within one vector, one pair and one group of lanes, just
# past each, and over several of the CPU's chunks of 16,384 elements.
NORM_SIZES = (1, 7, 9, 15, 17, 20, 31, 33, 47, 100, 1000, 4097, 33153, 100003)


def sums_of_squares():
    """grad_stats_'s sum of squares of FP32, FP16 and BF16 gradients of NORM_SIZES."""
    rng = np.random.default_rng(3)
    out = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for n in NORM_SIZES:
            g = torch.from_numpy(rng.standard_normal(n, dtype=np.float32)).to(dtype)
            found, sum_sq = torch.zeros(1), torch.zeros(1)
            torch.ops.fusedamp.grad_stats_([g], found, sum_sq)
            out[f"{str(dtype)[6:]}.{n}"] = sum_sq
    return out


def run_case(name, cls, dtype, kwargs, device="cpu"):
    # numpy's generator, not torch's: torch.randn's vectorised path is itself compiled per
    # instruction set and draws other low bits under ATEN_CPU_CAPABILITY=default.
    rng = np.random.default_rng(sum(map(ord, name)))

    def randn(shape):
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))

    params = [torch.nn.Parameter((randn(s) * 0.1).to(dtype).to(device)) for s in SHAPES]
    # Clipping (max_grad_norm) only in CPU_ONLY_CASES: CUDA sums the squares in its blocks'
    # order, the CPU builds in one order of their own (cpu/lane_reduce.h SquareSums).
    opt = getattr(fusedamp.optim, cls)(params, lr=LR, **kwargs)
    scaler = fusedamp.GradScaler(device, init_scale=1024.0) if dtype == torch.float16 else None
    for step in range(3):
        for p in params:
            g = randn(p.shape) * 10 ** -(step + 1)
            if step == 1 and not kwargs.get("skip_nonfinite", True) and p.numel() > 1000:
                g.view(-1)[[40, 45, 1000]] = torch.tensor([float("inf"), float("-inf"),
                                                           float("nan")])
            p.grad = (g * (1024.0 if scaler else 1.0)).to(dtype).to(device)
        if scaler is not None:
            if step == 1:  # an overflow: the step is skipped, the scale backs off
                params[1].grad.view(-1)[5] = float("inf")
            # As a loss would be: the scale is made on first use.
            scaler.scale(torch.ones((), device=device))
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    out = {f"param{i}": p.detach().cpu().clone() for i, p in enumerate(params)}
    if scaler is not None:
        out["scale"] = torch.tensor(scaler.get_scale())
    for i, p in enumerate(params):
        for key, value in opt.state[p].items():
            if torch.is_tensor(value):
                out[f"param{i}.{key}"] = value.cpu().clone()
    if not kwargs.get("skip_nonfinite", True):
        # A NaN's bits are its conversion's, not the step's: torch's vectorised FP32-to-BF16
        # conversion writes 0xFFFF, its scalar one (DEFAULT's) 0x7FC0. One NaN for both.
        out = {k: torch.where(v.isnan(), float("nan"), v) if v.is_floating_point() else v
               for k, v in out.items()}
    return out


def split_edges(device="cpu"):
    """The split weight stores' load and store alone (lr 0: the update adds nothing exactly):
    random BF16 patterns with random remainders, zeros with negative remainders, infinities,
    NaNs, over sizes with partial vectors. No FP32 arithmetic is involved, so every
    instruction set must give the same bits, DEFAULT included."""
    rng = np.random.default_rng(11)
    out = {}
    for mode, rdtype in (("split", np.int16), ("split8", np.int8)):
        for n in (1, 7, 31, 32, 33, 65, 1000):
            weights = torch.from_numpy(rng.integers(0, 2 ** 16, n, dtype=np.int64))
            weights = weights.to(torch.int32).to(torch.int16).view(torch.bfloat16)
            special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0],
                                   dtype=torch.bfloat16)
            weights[:min(n, 6)] = special[:min(n, 6)]
            info = np.iinfo(rdtype)
            rest = torch.from_numpy(rng.integers(info.min, info.max + 1, n).astype(rdtype))
            if n > 1:
                rest[0] = rest[1] = info.min  # below both zeros
            p = torch.nn.Parameter(weights.clone().to(device))
            opt = fusedamp.optim.AdamW([p], lr=0.0, master_weights=mode)
            p.grad = torch.ones_like(p)
            opt.step()  # makes the state (remainders 0)
            state = opt.state[p]
            key = "param_remainder"
            with torch.no_grad():
                p.copy_(weights)
                state[key].copy_(rest.to(device))
            for _ in range(2):
                opt.step()
            out[f"{mode}.{n}.param"] = p.detach().cpu().clone()
            out[f"{mode}.{n}.remainder"] = state[key].cpu().clone()
    return out


def cpu_results():
    """Every case's results on the CPU, the split edges and the sums of squares, by name."""
    results = {name: run_case(name, *rest) for name, *rest in CASES + CPU_ONLY_CASES}
    results["split_edges"] = split_edges()
    results["sums_of_squares"] = sums_of_squares()
    return results


def main(path):
    torch.set_num_threads(1)
    results = {"capability": fusedamp._C.cpu_capability(), **cpu_results()}
    torch.save(results, path)


if __name__ == "__main__":
    main(sys.argv[1])
