"""The modules of a model as the user wrote them, seen through the wrappers that data
parallelism, compilation and activation checkpointing put around them."""
import torch

__all__ = ["user_modules"]

# Wrappers that hold the user's module under a name of their own: torch.compile's, FSDP1's,
# activation checkpointing's (DDP and DataParallel call theirs `module`, checked by type).
_WRAPPED = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def _unwrap(module):
    while True:
        if isinstance(module, (torch.nn.parallel.DistributedDataParallel,
                               torch.nn.DataParallel)):
            module = module.module
            continue
        inner = next((module._modules[a] for a in _WRAPPED if a in module._modules), None)
        if inner is None:
            return module
        module = inner


def user_modules(model):
    """named_modules() of the model as the user wrote it: each wrapper replaced by the module
    it holds, under the wrapper's name (no "module.", "_orig_mod.", "_fsdp_wrapped_module.")."""
    named, seen = [], set()

    def walk(name, module):
        module = _unwrap(module)
        if module in seen:   # a module reachable twice is listed once, as named_modules does
            return
        seen.add(module)
        named.append((name, module))
        for child_name, child in module.named_children():
            walk(f"{name}.{child_name}" if name else child_name, child)

    walk("", model)
    return named
