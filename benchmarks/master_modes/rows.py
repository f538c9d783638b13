"""The master-weight modes benchmark's rows: each optimizer compared, how it is built, and what
it moves per parameter (its state buffers and, where it is not one fused pass, the passes it
runs). A row whose library is missing records why instead of failing the run."""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field

import torch

BF16, FP32 = torch.bfloat16, torch.float32
ERR_CHARS = 300  # error messages are cut to this length in the tables

# A pass: (what it does, tensors read, tensors written); tensor names: g = grad, p = weight,
# the other names are state buffers of the row (or temporaries listed in Row.temps).
Pass = tuple[str, str, str]


@dataclass
class Row:
    key: str
    family: str                      # torch / optimi / torchao / fusedamp
    factory: str                     # dotted name of the optimizer class
    kwargs: dict                     # constructor arguments besides params and the hyper-parameters
    state: list[tuple[str, int]]     # per-parameter state besides the weight: (name, bytes)
    param_dtype: torch.dtype = BF16
    passes: list[Pass] | None = None   # as implemented, when not a single fused pass
    extra_passes: list[tuple[str, int]] = field(default_factory=list)  # (what, bytes/param)
    temps: dict[str, int] = field(default_factory=dict)  # temporaries used by the passes
    note: str = ""
    unavailable: str | None = None   # why the row cannot run here
    state_dtype_text: str = ""
    baseline: bool = False

    # --- bytes per parameter ---
    @property
    def weight_bytes(self):
        return torch.empty((), dtype=self.param_dtype).element_size()

    def sizes(self):
        d = {"g": self.weight_bytes, "p": self.weight_bytes}
        d.update(dict(self.state))
        d.update(self.temps)
        return d

    def state_bytes(self):
        return sum(b for _, b in self.state)

    def moved_one_pass(self):
        """grad read; weight read + write; every state buffer read + written."""
        return self.weight_bytes + 2 * self.weight_bytes + 2 * self.state_bytes()

    def moved_as_implemented(self):
        if self.passes is None:
            return self.moved_one_pass() + sum(b for _, b in self.extra_passes)
        size = self.sizes()
        total = 0
        for _, reads, writes in self.passes:
            total += sum(size[t] for t in reads.split()) + sum(size[t] for t in writes.split())
        return total

    def implementation_text(self):
        if self.passes is not None:
            return f"{len(self.passes)} passes: " + "; ".join(p[0] for p in self.passes)
        extra = "".join(f" + {what} ({b} B)" for what, b in self.extra_passes)
        return "one fused pass" + extra

    # --- construction ---
    def _kwargs(self, hyper, extra=None):
        return dict(lr=hyper["lr"], betas=tuple(hyper["betas"]), eps=hyper["eps"],
                    weight_decay=hyper["weight_decay"], **self.kwargs, **(extra or {}))

    def ctor_text(self, hyper):
        kw = self._kwargs(hyper)
        return f"{self.factory}(params, " + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")"

    def build(self, params, hyper, extra=None):
        if self.unavailable:
            raise RuntimeError(self.unavailable)
        mod, _, name = self.factory.rpartition(".")
        cls = getattr(importlib.import_module(mod), name)
        return cls(params, **self._kwargs(hyper, extra))


def _try_import(module):
    """(module, None) or (None, why not)."""
    try:
        return importlib.import_module(module), None
    except ImportError as e:
        if getattr(e, "name", None) == module.split(".")[0]:
            return None, "not installed"
        return None, f"import {module} failed: {e!r}"[:ERR_CHARS]
    except Exception as e:  # a broken build, an ABI mismatch...
        return None, f"import {module} failed: {e!r}"[:ERR_CHARS]


def _version(dist, module=None):
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:
        return getattr(module, "__version__", None)


def torch_fused_bf16_ok(device) -> str | None:
    """None if torch.optim.AdamW(fused=True) steps BF16 parameters on this device."""
    try:
        p = torch.nn.Parameter(torch.ones(8, dtype=BF16, device=device))
        p.grad = torch.ones_like(p)
        torch.optim.AdamW([p], lr=1e-3, fused=True).step()
        return None
    except Exception as e:
        return repr(e)[:ERR_CHARS]


# torch's _multi_tensor_adam (non-capturable, decoupled weight decay), torch 2.x.
TORCH_FOREACH_PASSES = [
    ("p *= 1-lr*wd", "p", "p"), ("m.lerp_(g)", "m g", "m"), ("v *= b2", "v", "v"),
    ("v.addcmul_(g, g)", "v g", "v"), ("t = sqrt(v)", "v", "t"), ("t /= sqrt(bc2)", "t", "t"),
    ("t += eps", "t", "t"), ("p.addcdiv_(m, t)", "p m t", "p")]
# optimi 0.3 _foreach_adam with kahan_sum (uses g as scratch space).
OPTIMI_FOREACH_PASSES = [
    ("p *= 1-lr*wd", "p", "p"), ("m.lerp_(g)", "m g", "m"), ("v *= b2", "v", "v"),
    ("v.addcmul_(g, g)", "v g", "v"), ("g = v", "v", "g"), ("g.sqrt_()", "g", "g"),
    ("g += eps", "g", "g"), ("c.addcdiv_(m, g)", "c m g", "c"), ("g = p", "p", "g"),
    ("p += c", "p c", "p"), ("g -= p", "g p", "g"), ("c += g", "c g", "c")]

FUSEDAMP_MODES = [  # (label, master_weights, extra state besides the moments)
    ("fp32-master", True, [("master (fp32)", 4)]),
    ("bf16-rtn", False, []),
    ("split", "split", [("remainder (int16)", 2)]),
    ("split8", "split8", [("remainder (int8)", 1)]),
    ("kahan", "kahan", [("compensation (bf16)", 2)]),
    ("stochastic", "stochastic", []),
]
STATE_DTYPES = [("fp32", FP32), ("bf16", BF16), ("int8", torch.int8)]


def moment_state(sname, sdt):
    """The moments' (buffer, bytes per parameter) of a state dtype: int8 keeps 8-bit codes of
    both moments and, per block of 32 elements, two FP32 scales."""
    if sdt == torch.int8:
        return [("exp_avg (int8 codes)", 1), ("exp_avg_sq (uint8 codes)", 1),
                ("moment_scales (2 fp32 per 32 elements)", 0.25)]
    return [(f"exp_avg ({sname})", sdt.itemsize), (f"exp_avg_sq ({sname})", sdt.itemsize)]


def make_rows(device, fusedamp_kw: dict) -> list[Row]:
    rows = []
    # torch baseline
    why = torch_fused_bf16_ok(device)
    if why is None:
        rows.append(Row("torch AdamW fused", "torch", "torch.optim.AdamW", dict(fused=True),
                        [("exp_avg (bf16)", 2), ("exp_avg_sq (bf16)", 2)], baseline=True,
                        state_dtype_text="bf16 (param dtype)",
                        note="plain BF16 round-to-nearest weights, no master copy; torch keeps "
                             "the moments in the parameter dtype"))
    else:
        rows.append(Row("torch AdamW foreach", "torch", "torch.optim.AdamW", dict(foreach=True),
                        [("m", 2), ("v", 2)], passes=TORCH_FOREACH_PASSES, temps={"t": 2},
                        baseline=True, state_dtype_text="bf16 (param dtype)",
                        note=f"fused=True failed on {device} ({why}); foreach instead"))
    # torch-optimi, Kahan summation
    optimi, why = _try_import("optimi")
    impls = ["foreach"] if device == "cpu" else ["triton", "foreach"]
    for impl in impls:
        kw = dict(kahan_sum=True, foreach=True, triton=False) if impl == "foreach" else \
            dict(kahan_sum=True, triton=True)
        rows.append(Row(f"optimi AdamW kahan ({impl})", "optimi", "optimi.AdamW", kw,
                        [("m", 2), ("v", 2), ("c", 2)], state_dtype_text="bf16 (param dtype)",
                        passes=OPTIMI_FOREACH_PASSES if impl == "foreach" else None,
                        unavailable=why,
                        note="m, v, c = exp_avg, exp_avg_sq, kahan_comp, all zeros_like(param) "
                             "(BF16); debiased-beta formulation of Adam"))
    # torchao, stochastic rounding
    ao, why = _try_import("torchao.optim")
    factory = "torchao.optim._AdamW"
    if ao is not None and not hasattr(ao, "_AdamW"):
        if hasattr(ao, "AdamW"):
            factory = "torchao.optim.AdamW"
        else:
            why = "torchao.optim has no _AdamW/AdamW in this version"
    rows.append(Row("torchao AdamW bf16-SR", "torchao", factory, dict(bf16_stochastic_round=True),
                    [("exp_avg (bf16)", 2), ("exp_avg_sq (bf16)", 2)], unavailable=why,
                    state_dtype_text="bf16 (param dtype)",
                    note="FP32 math, BF16 moments (zeros_like(param)), stochastic rounding of "
                         "the weight; torch.compile per parameter shape, one fused kernel per "
                         "parameter assumed"))
    # Other libraries' 8-bit AdamW: both keep BF16 weights updated in place (no master bits)
    # and two 8-bit codes per element with one FP32 absmax per block of 256 and a 256-entry
    # dynamic quantization map; a different algorithm from fusedamp's blocks of 32.
    eight = [("exp_avg (uint8 codes)", 1), ("exp_avg_sq (uint8 codes)", 1),
             ("absmax (2 fp32 per 256 elements)", 2 * 4 / 256)]
    bnb, why = _try_import("bitsandbytes")
    rows.append(Row("bitsandbytes AdamW8bit", "bitsandbytes", "bitsandbytes.optim.AdamW8bit",
                    {}, eight, unavailable=why, state_dtype_text="8-bit (blocks of 256)",
                    note="plain BF16 round-to-nearest weights; dynamic-map 8-bit moments"))
    ao8, why = _try_import("torchao.optim")
    if ao8 is not None and not hasattr(ao8, "AdamW8bit"):
        why = "torchao.optim has no AdamW8bit in this version"
    rows.append(Row("torchao AdamW8bit", "torchao", "torchao.optim.AdamW8bit", {}, eight,
                    unavailable=why, state_dtype_text="8-bit (blocks of 256)",
                    note="plain BF16 round-to-nearest weights; dynamic-map 8-bit moments as "
                         "tensor subclasses, torch.compile per parameter shape"))
    # fusedamp
    fa, why = _try_import("fusedamp")
    stats = fusedamp_kw.get("skip_nonfinite", True)
    extra = [("grad_stats_ read of g (skip_nonfinite)", 2)] if stats else []
    for label, mw, own in FUSEDAMP_MODES:
        for sname, sdt in STATE_DTYPES:
            kw = dict(master_weights=mw, state_dtype=sdt)
            kw.update(fusedamp_kw)
            # FP32 masters adopt edits of the weight by default: the step reads it too.
            adopts = mw is True and kw.get("adopt_param_edits", True)
            reads = [("weight read to adopt edits (adopt_param_edits)", 2)] if adopts else []
            rows.append(Row(f"fusedamp {label} / {sname} state", "fusedamp",
                            "fusedamp.optim.AdamW", kw,
                            own + moment_state(sname, sdt),
                            extra_passes=list(extra) + reads, unavailable=why,
                            state_dtype_text=sname))
    return rows


def fp32_reference_row() -> Row:
    return Row("FP32 reference (torch AdamW fused, FP32 params)", "torch", "torch.optim.AdamW",
               dict(fused=True),
               [("exp_avg (fp32)", 4), ("exp_avg_sq (fp32)", 4)], param_dtype=FP32,
               state_dtype_text="fp32")


def build_row(row, params, hyper, seed=None):
    """Builds the optimizer; a stochastic-rounding fusedamp row also gets the seed, under the
    name its constructor uses (rounding_seed or seed). Returns (optimizer, {name: seed})."""
    extra = {}
    if seed is not None and row.family == "fusedamp" and row.kwargs.get(
            "master_weights") == "stochastic" and not row.unavailable:
        mod, _, name = row.factory.rpartition(".")
        try:
            names = inspect.signature(getattr(importlib.import_module(mod), name)).parameters
        except (TypeError, ValueError):
            names = {}
        for arg in ("rounding_seed", "seed"):
            if arg in names and arg not in row.kwargs:
                extra[arg] = seed
                break
    return row.build(params, hyper, extra), extra


def short_error(e: BaseException) -> str:
    """An exception as one line for a table cell."""
    s = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
    return s[:ERR_CHARS]


def library_versions() -> dict:
    out = {"torch": torch.__version__}
    for dist, mod in [("torch-optimi", "optimi"), ("torchao", "torchao"),
                      ("bitsandbytes", "bitsandbytes"),
                      ("fusedamp", "fusedamp"), ("triton", "triton")]:
        m, why = _try_import(mod)
        out[dist] = (_version(dist, m) or getattr(m, "__version__", "?")) if m else why
    return out
