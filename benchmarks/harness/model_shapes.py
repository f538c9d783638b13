"""The parameter shapes of resnet50 and GPT-2 small, the models whose optimizer step the step
benchmarks time. From torchvision / transformers when installed (recorded as the "shape
source"), else from the built-in derivations below, which reproduce the libraries' parameter
counts exactly (25,557,032 and 124,439,808; the GPT-2 LM head is tied to the token embedding
and is not a separate tensor)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BUILT_IN = "built-in derivation (benchmarks/harness/model_shapes.py)"


def resnet50_shapes() -> list[tuple[int, ...]]:
    """torchvision resnet50: stem, 4 stages of bottlenecks [3, 4, 6, 3], fc; BN weight+bias."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for width, blocks in [(64, 3), (128, 4), (256, 6), (512, 3)]:
        out = width * 4
        for b in range(blocks):
            shapes += [(width, inplanes, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (out, width, 1, 1), (out,), (out,)]
            if b == 0:  # projection shortcut
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]
            inplanes = out
    return shapes + [(1000, 2048), (1000,)]


def gpt2_shapes(d: int = 768, layers: int = 12, vocab: int = 50257, ctx: int = 1024):
    """transformers GPT2LMHeadModel (Conv1D weights are (in, out)); LM head tied to wte."""
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,),
                   (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return shapes + [(d,), (d,)]


def library_shapes(name: str):
    """(shapes, source) from the real architecture definition, built on the meta device (no
    memory); (None, None) where the library is not installed or not usable."""
    try:
        with torch.device("meta"):
            if name == "resnet50":
                import torchvision
                model = torchvision.models.resnet50(weights=None)
                src = f"torchvision {torchvision.__version__} models.resnet50"
            else:
                import transformers
                model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
                src = f"transformers {transformers.__version__} GPT2LMHeadModel"
        return [tuple(p.shape) for p in model.parameters()], src
    except Exception:  # not installed (or unusable): use the built-in derivation
        return None, None


@dataclass
class SizeSpec:
    """One set of parameter shapes: its name, the shapes, where they come from."""
    name: str
    shapes: list
    source: str
    numel: int = 0

    def __post_init__(self):
        self.numel = sum(math.prod(s) for s in self.shapes)

    def as_dict(self):
        return {"name": self.name, "tensors": len(self.shapes), "parameters": self.numel,
                "shape_source": self.source}


def model_sizes(from_libraries=True) -> list[SizeSpec]:
    """resnet50 and gpt2-124M: the libraries' shapes where available (noted where they equal
    the built-in derivation), else the built-in ones."""
    sizes = []
    for name, builtin in [("resnet50", resnet50_shapes), ("gpt2-124M", gpt2_shapes)]:
        shapes, src = library_shapes("resnet50" if name == "resnet50" else "gpt2") \
            if from_libraries else (None, None)
        if shapes is None:
            shapes, src = builtin(), BUILT_IN
        elif shapes == builtin():
            src += " (identical to the built-in derivation)"
        sizes.append(SizeSpec(name, shapes, src))
    return sizes


def split(flat: torch.Tensor, shapes, dtype, device="cpu", scale=1.0):
    """Separate tensors (own allocations, like a model's), filled from one random buffer."""
    out, off = [], 0
    for s in shapes:
        n = math.prod(s)
        t = torch.empty(s, dtype=dtype, device=device)
        t.view(-1).copy_(flat[off:off + n])
        if scale != 1.0:
            t.mul_(scale)
        out.append(t)
        off += n
    return out
