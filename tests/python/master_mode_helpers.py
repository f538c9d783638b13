"""What the master-weight mode tests (test_master_modes_*.py) share: the FP32 master a "split"
pair stands for, rebuilt from bit patterns with torch integer ops (independent of the kernels),
the masters that lie exactly halfway between two BF16 values, and a small BF16 model."""
import torch
from torch import nn


def combine_reference(weight_bf16, remainder_int16):
    """The FP32 master a split pair holds: weight pattern * 2^16 + remainder (torch int ops)."""
    high = weight_bf16.contiguous().view(torch.int16).to(torch.int32) << 16
    return (high + remainder_int16.to(torch.int32)).view(torch.float32)


def is_halfway(master_fp32):
    """Masters whose lower 16 bits are 0x8000: exactly halfway between two BF16 values."""
    return (master_fp32.contiguous().view(torch.int32) & 0xFFFF) == 0x8000


def bf16_mlp(device, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(device,
                                                                           torch.bfloat16)
