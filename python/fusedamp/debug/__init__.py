"""Numerics debugging: which layer produced the first inf/NaN, and which layers need FP32.

- ``watch(model, capacity=64)``: per module and iteration, on the device and without host
  synchronisation, the amax and non-finite flag of each module's output and of the gradient it
  produces, and that gradient's underflow fraction. ``first_nonfinite()`` names the module,
  phase and iteration that made the first inf/NaN; ``report()``, ``history()``, ``plot(path)``,
  ``write_tensorboard(writer_or_logdir)`` summarise; ``remove()`` (or a ``with`` block) detaches
  it. Modules keep the user's names under DDP, FSDP, DataParallel and torch.compile.
- ``precision_audit(model, inputs, dtype=torch.float16)``: each module's own error in `dtype`
  (run on the FP32 run's inputs) and the error it inherits in a full low-precision run, with
  timings, worst first; ``.keep_fp32`` lists the modules to keep in FP32
  (``fusedamp.initialize(..., keep_fp32=audit.keep_fp32)``).

See docs/debugging.md.
"""
from .watch import Watch, watch  # noqa: F401
from .audit import precision_audit  # noqa: F401

__all__ = ["watch", "Watch", "precision_audit"]
