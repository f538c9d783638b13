"""fusedamp — a fused mixed-precision training engine for PyTorch.

The operators are registered as ``torch.ops.fusedamp.*``; see README.md.
"""
from ._library import cmake_prefix_path, library_path, _C  # noqa: F401

__version__ = "0.1.0"

ops = __import__("torch").ops.fusedamp
