"""8-bit storage formats for AdamW's two moments, as moment_formats.py studies them: the element
codes of exp_avg (int8) and exp_avg_sq (uint8), one scale per block of B elements, and Storage,
a pair of formats with the round trip through it (quantized and dequantized, in FP32)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCKS = (32, 64, 128, 256)
M_CODES = ("lin", "softsign", "sqrt")
V_CODES = ("lin", "sqrt", "4th-root")
V_POWER = {"lin": 1.0, "sqrt": 0.5, "4th-root": 0.25}

SCALE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def block_scale(absmax, scale):
    """absmax as stored: rounded up to FP16 (saturating at its largest) or BF16, or FP32 as it
    is; returned in FP32."""
    if scale == "fp32":
        return absmax
    dtype = SCALE_DTYPES[scale]
    top = torch.finfo(dtype).max
    s = absmax.clamp(max=top).to(dtype)
    low = (s.float() < absmax) & (s < top)
    s = torch.where(low, torch.nextafter(s, torch.full_like(s, math.inf)), s)
    return s.float()


def _compand(code, u):
    if code == "lin":
        return u
    if code == "softsign":
        return 2 * u / (1 + u.abs())
    if code == "sqrt":
        return u.sign() * u.abs().sqrt()
    raise ValueError(code)


def _expand(code, c):
    if code == "lin":
        return c
    if code == "softsign":
        return c / (2 - c.abs())
    if code == "sqrt":
        return c * c.abs()
    raise ValueError(code)


def roundtrip_m(x, code, block, scale="fp16"):
    """exp_avg through int8 storage: codes -127..127 of c(m / absmax), one absmax per block
    (FP16; BF16 or FP32 to tell the code's error from the FP16 scale's)."""
    xb = x.view(-1, block)
    scale = block_scale(xb.abs().amax(1, keepdim=True), scale)
    u = xb / torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(127 * _compand(code, u)).clamp_(-127, 127)
    return (_expand(code, q / 127) * scale).view(-1)


def power(x, p):
    if p == 1.0:
        return x
    if p == 0.5:
        return x.sqrt()
    if p == 0.25:
        return x.sqrt().sqrt()
    return x.pow(p)


def unpower(y, p):
    if p == 1.0:
        return y
    if p == 0.5:
        return y * y
    if p == 0.25:
        y = y * y
        return y * y
    return y.pow(1 / p)


def roundtrip_v(x, code, block, scale="fp16"):
    """exp_avg_sq through uint8 storage: codes 0..255 of v**p / max(v**p), one max per block."""
    p = V_POWER[code]
    yb = power(x, p).view(-1, block)
    scale = block_scale(yb.amax(1, keepdim=True), scale)
    u = yb / torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(255 * u).clamp_(0, 255)
    return unpower(q / 255 * scale, p).view(-1)


@dataclass(frozen=True)
class Storage:
    """How the two moments are stored: "fp32", "bf16", or an 8-bit code with block size."""
    m: str
    v: str
    block: int | None = None
    scale: str = "fp16"                 # both moments' block scales ...
    m_scale: str | None = None          # ... or exp_avg's, where it differs

    @property
    def key(self):
        if self.m == self.v and self.m in ("fp32", "bf16"):
            return self.m.upper()
        return (f"m {self.m} / v {self.v}" + (f", B={self.block}" if self.block else "")
                + self._scale_text())

    @property
    def scale_of_m(self):
        return self.m_scale or self.scale

    def _scale_text(self):
        if self.scale_of_m != self.scale:
            return (f", {self.scale_of_m.upper()} scale for m"
                    + ("" if self.scale == "fp16" else f", {self.scale.upper()} for v"))
        return "" if self.scale == "fp16" else f", {self.scale.upper()} scale"

    def element_bytes(self, code):
        return {"fp32": 4.0, "bf16": 2.0}.get(code, 1 + 2 / (self.block or 1))

    @property
    def bytes_per_param(self):
        """Storage of both moments per parameter (codes plus their share of the FP16 scales)."""
        return self.element_bytes(self.m) + self.element_bytes(self.v)

    def _store(self, x, code, roundtrip, scale):
        if code == "fp32":
            return x
        if code == "bf16":
            return x.bfloat16().float()
        return roundtrip(x, code, self.block, scale)

    def store_m(self, x):
        return self._store(x, self.m, roundtrip_m, self.scale_of_m)

    def store_v(self, x):
        return self._store(x, self.v, roundtrip_v, self.scale)

    def as_dict(self):
        return {"key": self.key, "exp_avg": self.m, "exp_avg_sq": self.v, "block": self.block,
                "scale": self.scale, "m_scale": self.m_scale,
                "bytes_per_param": self.bytes_per_param}


FP32 = Storage("fp32", "fp32")
BF16 = Storage("bf16", "bf16")


def pairs(block):
    return [Storage(m, v, block) for m in M_CODES for v in V_CODES]
