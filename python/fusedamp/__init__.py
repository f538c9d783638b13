"""fusedamp — a fused mixed-precision training engine for PyTorch.

- ``fusedamp.GradScaler``: drop-in for torch.amp.GradScaler (state on the device; sync-free
  with fusedamp optimizers; hysteresis and bounds).
- ``fusedamp.optim.AdamW / Adam / SGD``: torch.optim optimizers with FP32 master weights,
  fused clipping and on-device skipping.
- ``fusedamp.initialize(model, optimizer, dtype)``: wrap an existing model and optimizer;
  ``fusedamp.restore(model)`` undoes it; ``fusedamp.master_weights(model, optimizer)`` /
  ``fp32_state_dict`` give the FP32 model behind a master-weight run.
- ``fusedamp.release_gradients(model, optimizer, scaler)``: each parameter's step inside
  backward, its gradient freed at once (gradient release), with loss scaling.
- ``fusedamp.lr_scheduler``: schedules counted in applied optimizer steps (a skipped step does
  not advance them), computed on the device.
- ``fusedamp.distributed.ZeroRedundancyOptimizer``: torch's ZeRO stage 1 over fusedamp's
  optimizers, with global clipping and skips.
- The operators: ``torch.ops.fusedamp.*``, and ``fusedamp.ops.*``: the same operators from
  Python without torch.ops' boxing of every list element.
"""

from ._library import _C, cmake_prefix_path, library_path  # noqa: F401
from . import optim  # noqa: F401
from . import lr_scheduler  # noqa: F401
from . import distributed  # noqa: F401
from . import ops  # noqa: F401
from .convert import convert_module, is_norm_layer, restore  # noqa: F401
from .export import fp32_state_dict, master_weights  # noqa: F401
from .diagnostics import nonfinite_grads  # noqa: F401
from . import debug  # noqa: F401
from .grad_scaler import GradScaler  # noqa: F401
from .initialize import initialize  # noqa: F401
from .release import release_gradients  # noqa: F401

__version__ = "0.1.0"

