"""fusedamp's operators, called from Python without torch.ops' per-element boxing.

``fusedamp.ops.adam_step_(...)`` is ``torch.ops.fusedamp.adam_step_(...)``: the same schema
(arguments, keyword-only arguments, defaults), the same dispatcher entry, hence the same checks,
kernels, errors and version-counter bumps. What differs is the way in. torch.ops converts every
element of every tensor list into an IValue and back; this entry reads the lists straight from
their Python objects and calls the op's typed dispatcher handle with the GIL released, as torch
calls its own ``torch._fused_adamw_``. With thousands of tensors per call that is most of the
host time of a bare op call (``benchmarks/bench_host_overhead.py``).

A call it does not take exactly as it is -- an active ``__torch_function__`` mode, a tensor
subclass, a list element that is not a tensor, a number that is not a plain int / float / bool,
a missing, unknown or doubly given argument -- goes to ``torch.ops.fusedamp.<op>`` unchanged,
which handles or refuses it as always. Under torch.compile these functions are
``torch.ops.fusedamp.<op>`` (the compiler traces the operator, which it knows).
"""
import torch

from ._library import _C


def _operator(name):
    direct = getattr(_C.ops, name)
    registered = getattr(torch.ops.fusedamp, name)
    is_compiling = torch.compiler.is_compiling

    def call(*args, **kwargs):
        if is_compiling():
            return registered(*args, **kwargs)
        return direct(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = direct.__doc__
    return call


# Every operator _C.ops defines (csrc/schemas.cpp's, in its order; the step operators are the
# C++ list of step algorithms'), each under its own name here.
__all__ = [name for name, entry in vars(_C.ops).items()
           if not name.startswith("_") and callable(entry)]
globals().update({name: _operator(name) for name in __all__})
