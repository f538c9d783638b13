"""The step benchmark's configurations: how each side of the comparison is built on one set of
parameter shapes, and the bytes each moves per parameter.

fusedamp's rows through the ops (``fusedamp_ops``: grad_stats_, then adam_step_ / sgd_step_ on
FP32 master weights, then update_scale_) and through its public classes (``fusedamp_api``:
``scaler.step(opt); scaler.update()``); torch's rows on FP32 parameters under GradScaler
(``torch_amp``) and on BF16 parameters with fused AdamW and no scaler (``torch_bf16_fused``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

import harness
from harness.model_shapes import split

# The op tests' input builder: the benchmark times the inputs the tests check.
harness.use_paths("tests")
from op_inputs import op_inputs  # noqa: E402

# Hyper-parameters shared by every configuration (torch's defaults where it has them).
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 1e-2
SGD_LR, MOMENTUM = 1e-2, 0.9
MAX_NORM = 1.0                 # the clipping configurations really clip (norms are >> 1)
LOSS_SCALE = 2.0 ** 16
GRAD_STD = 1e-3                # unscaled gradient magnitude; x 2**16 stays well inside FP16
GROWTH_INTERVAL = 2000


# ----------------------------------------------------------------------------- bytes
# Bytes moved per parameter by one step in steady state, counted pass by pass from the kernels
# that run (reads + writes of full tensors; scalars ignored). p = param, g = grad, m/v = Adam
# moments, w = FP32 master weight, b = momentum buffer; 2 = FP16/BF16, 4 = FP32.
BYTES_PER_PARAM = {
    # fusedamp, FP16/BF16 params + FP32 master, FP16/BF16 grads:
    #   grad_stats_ reads g (2); adam_step_ reads g,w,m,v (2+4+4+4) and writes p,w,m,v (2+4+4+4),
    #   and reads p (2) to adopt edits of the model into the masters (adopt_param_edits, on by
    #   default). Clipping costs nothing extra: the norm comes from grad_stats_, which runs anyway
    #   for found_inf.
    "fusedamp_adamw": 2 + 16 + 14,                              # 32
    #   Through fusedamp.optim: + the unscaled (and clipped) g written back (write_back_grads).
    "fusedamp_adamw_api": 2 + 16 + 16,                          # 34
    #   adopt_param_edits=False, write_back_grads=False: p is written, never read.
    "fusedamp_adamw_lean": 2 + 14 + 14,                         # 30
    #   sgd_step_ reads g,w,b,p (2+4+4+2), writes p,w,b (2+4+4); the same two options.
    "fusedamp_sgd": 2 + 12 + 10,                                # 24
    "fusedamp_sgd_api": 2 + 12 + 12,                            # 26
    "fusedamp_sgd_lean": 2 + 10 + 10,                           # 22
    # torch, FP32 params and grads.
    #   GradScaler.step → unscale_: _amp_foreach_non_finite_check_and_unscale_ reads and writes
    #   g (8). AdamW(foreach=True), torch 2.11 _multi_tensor_adam, one op per line:
    #   p *= 1-lr*wd (8); m.lerp_(g) (12); v *= b2 (8); v.addcmul_(g, g) (12);
    #   t = sqrt(v) (8); t /= bc2_sqrt (8); t += eps (8); p.addcdiv_(m, t) (16) → 80.
    "torch_adamw_foreach": 8 + 80,                              # 88
    #   + unscale_ (8, separate from step's check which is then skipped), clip_grad_norm_:
    #   norm pass reads g (4), scale pass g *= coef (8).
    "torch_adamw_foreach_clip": 8 + 4 + 8 + 80,                 # 100
    #   Fused optimizers: GradScaler.step only checks (_check_inf_per_device runs the unscale
    #   kernel with inv_scale 1: reads and writes g, 8); _fused_adamw_ reads p,g,m,v (16),
    #   writes p,m,v (12) and, because it unscales, writes g back (4).
    "torch_adamw_fused": 8 + 16 + 16,                           # 40
    #   After unscale_ + clipping, the fused kernel gets no grad_scale and does not write g.
    "torch_adamw_fused_clip": 8 + 4 + 8 + 28,                   # 48
    #   BF16 params, BF16 state (torch keeps moments in the parameter dtype), no scaler:
    #   reads p,g,m,v (8), writes p,m,v (6). Not the same algorithm: no FP32 master, BF16 m/v.
    "torch_adamw_fused_bf16": 8 + 6,                            # 14
    #   _fused_sgd_: reads p,g,b (12), writes p,b (8) and the unscaled g (4); + check (8).
    "torch_sgd_fused": 8 + 12 + 12,                             # 32
    "torch_sgd_fused_clip": 8 + 4 + 8 + 20,                     # 40
}


# ----------------------------------------------------------------------------- runners
@dataclass
class Runner:
    """One configuration, built: step() runs one optimizer step, restore() resets the grads."""
    step: Callable[[], None]
    grads: list
    pristine: list
    keep: list = field(default_factory=list)  # everything else that must stay alive
    probe: torch.Tensor | None = None  # a parameter: must change when a step is applied

    def restore(self):
        if self.grads:
            torch._foreach_copy_(self.grads, self.pristine)


def _params_with_grads(spec, w, g, device, dtype, grad_scale):
    """A model's parameters in `dtype` with their .grad (g × grad_scale, as backward leaves
    them), and a pristine copy of the grads."""
    params = [torch.nn.Parameter(t) for t in split(w, spec.shapes, dtype, device)]
    grads = split(g, spec.shapes, dtype, device, grad_scale)
    for p, gr in zip(params, grads):
        p.grad = gr
    return params, grads, [x.clone() for x in grads]


def fusedamp_ops(opt_name):
    """fusedamp through the ops: grad_stats_ → adam_step_ / sgd_step_ (FP32 master weights;
    SGD with momentum) → update_scale_."""
    b1, b2 = BETAS
    step_op, hyper = {
        "adamw": ("adam_step_", dict(lr=LR, beta1=b1, beta2=b2, eps=EPS, weight_decay=WD,
                                     decoupled_weight_decay=True)),
        "sgd": ("sgd_step_", dict(lr=SGD_LR, momentum=MOMENTUM, dampening=0.0, weight_decay=0.0,
                                  nesterov=False)),
    }[opt_name]

    def build(spec, w, g, device, dtype, clip):
        inp = op_inputs(device, param_dtype=dtype, master_weights=True,
                        moments=opt_name == "adamw", momentum=opt_name == "sgd",
                        weights=split(w, spec.shapes, torch.float32, device),
                        grads=split(g, spec.shapes, dtype, device, LOSS_SCALE),
                        loss_scale=LOSS_SCALE,
                        scalars=dict(inv_scale=1 / LOSS_SCALE, found_inf=0.0, grad_sum_sq=0.0))
        pristine = [x.clone() for x in inp.grads]
        grad_stats = inp.bind("grad_stats_")
        optimizer_step = inp.bind(step_op, **hyper, max_grad_norm=MAX_NORM if clip else None)
        update_scale = inp.bind("update_scale_", growth_factor=2.0, backoff_factor=0.5,
                                growth_interval=GROWTH_INTERVAL)

        def step():
            inp.found_inf.zero_()
            inp.grad_sum_sq.zero_()
            grad_stats()
            torch.reciprocal(inp.scale, out=inp.inv_scale)
            optimizer_step()
            update_scale()

        return Runner(step, inp.grads, pristine, [inp], inp.params[-1])
    return build


def fusedamp_api(opt_name, scaler_options=None, **modes):
    """fusedamp through its public classes (fusedamp.optim.*, fusedamp.GradScaler); modes:
    adopt_param_edits / write_back_grads (default: the optimizers' defaults, both on);
    scaler_options: GradScaler keywords (default: its defaults, telemetry on)."""
    def build(spec, w, g, device, dtype, clip):
        import fusedamp
        params, grads, pristine = _params_with_grads(spec, w, g, device, dtype, LOSS_SCALE)
        norm = MAX_NORM if clip else None
        if opt_name == "adamw":
            opt = fusedamp.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                       master_weights=True, max_grad_norm=norm, **modes)
        else:
            opt = fusedamp.optim.SGD(params, lr=SGD_LR, momentum=MOMENTUM, master_weights=True,
                                     max_grad_norm=norm, **modes)
        scaler = fusedamp.GradScaler(device, init_scale=LOSS_SCALE,
                                     growth_interval=GROWTH_INTERVAL, **(scaler_options or {}))
        scaler.scale(torch.ones((), device=device))  # what backward's scale(loss) initialises

        def step():
            scaler.step(opt)
            scaler.update()

        return Runner(step, grads, pristine, [params, opt, scaler], params[-1])
    return build


def torch_amp(opt_name, impl, clip):
    """torch.amp.GradScaler + torch.optim on FP32 params with loss-scaled FP32 grads."""
    def build(spec, w, g, device, dtype, _clip):
        params, grads, pristine = _params_with_grads(spec, w, g, device, torch.float32,
                                                     LOSS_SCALE)
        kw = {impl: True}
        if opt_name == "adamw":
            opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
        else:
            opt = torch.optim.SGD(params, lr=SGD_LR, momentum=MOMENTUM, **kw)
        scaler = torch.amp.GradScaler(device, init_scale=LOSS_SCALE,
                                      growth_interval=GROWTH_INTERVAL)
        scaler.scale(torch.ones((), device=device))  # what backward's scale(loss) initialises

        def step():
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            scaler.step(opt)
            scaler.update()

        return Runner(step, grads, pristine, [params, opt, scaler], params[-1])
    return build


def torch_bf16_fused(spec, w, g, device, dtype, clip):
    """BF16 params and grads, torch AdamW(fused=True), no scaler (and no master weights)."""
    # bf16 needs no loss scale
    params, grads, pristine = _params_with_grads(spec, w, g, device, torch.bfloat16, 1.0)
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    return Runner(opt.step, grads, pristine, [params, opt], params[-1])


@dataclass
class Config:
    key: str
    family: str          # "fusedamp" or "torch"
    opt: str             # "adamw" or "sgd"
    dtype: str           # param dtype: "fp16", "bf16", "fp32"
    clip: bool
    bytes_key: str
    build: Callable
    baseline_of: tuple = ()  # for fusedamp rows: the torch keys it is compared against


DT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def make_configs(with_api: bool) -> list[Config]:
    cfgs = []
    for opt in ["adamw", "sgd"]:
        for clip in [False, True]:
            c = "+clip" if clip else ""
            if opt == "adamw":
                base = (f"torch adamw foreach{c}", f"torch adamw fused{c}")
            else:
                base = (f"torch sgd fused{c}",)
            for dt in ["fp16", "bf16"]:
                extra = ("torch adamw fused bf16 (no scaler)",) if (
                    opt == "adamw" and dt == "bf16" and not clip) else ()
                cfgs.append(Config(f"fusedamp {opt} {dt}{c}", "fusedamp", opt, dt, clip,
                                   f"fusedamp_{opt}", fusedamp_ops(opt), base + extra))
                if with_api:
                    cfgs.append(Config(f"fusedamp-api {opt} {dt}{c}", "fusedamp", opt, dt, clip,
                                       f"fusedamp_{opt}_api", fusedamp_api(opt), base + extra))
                if with_api and dt == "fp16":
                    # The cost of the two defaults that keep torch's contract: edits of the
                    # model reach the masters, .grad is left unscaled.
                    cfgs.append(Config(
                        f"fusedamp-api {opt} {dt}{c} lean", "fusedamp", opt, dt, clip,
                        f"fusedamp_{opt}_lean",
                        fusedamp_api(opt, adopt_param_edits=False, write_back_grads=False),
                        base))
                    # The default's telemetry (GradScaler(telemetry=True)) against none: its
                    # own cost is the ratio of this row's time to the default row's.
                    cfgs.append(Config(
                        f"fusedamp-api {opt} {dt}{c} telemetry off", "fusedamp", opt, dt, clip,
                        f"fusedamp_{opt}_api", fusedamp_api(opt, dict(telemetry=False)), base))
    for clip in [False, True]:
        c = "+clip" if clip else ""
        s = "_clip" if clip else ""
        cfgs.append(Config(f"torch adamw foreach{c}", "torch", "adamw", "fp32", clip,
                           f"torch_adamw_foreach{s}", torch_amp("adamw", "foreach", clip)))
        cfgs.append(Config(f"torch adamw fused{c}", "torch", "adamw", "fp32", clip,
                           f"torch_adamw_fused{s}", torch_amp("adamw", "fused", clip)))
        cfgs.append(Config(f"torch sgd fused{c}", "torch", "sgd", "fp32", clip,
                           f"torch_sgd_fused{s}", torch_amp("sgd", "fused", clip)))
    cfgs.append(Config("torch adamw fused bf16 (no scaler)", "torch", "adamw", "bf16", False,
                       "torch_adamw_fused_bf16", torch_bf16_fused))
    return cfgs
