"""PyTorch's own GradScaler tests, run against fusedamp: what test_torch_grad_scaler.py (the
scaler's API) and test_torch_grad_scaler_training.py (training loops) share — the variants
every test runs as, the case ids and expected failures, torch's helpers, and the fixtures each
test file imports: torch's TestCase as ``tc``, and the seed every test starts from.

Ported from PyTorch (BSD-3-Clause, Copyright (c) PyTorch contributors); the test bodies and
their assertions are torch's, adapted only where stated below.

Sources (the installed torch is 2.11.0):
  * test/test_torch.py, class TestTorchDeviceType, as of pytorch/pytorch main in the fork
    bobrenjc93/pytorch@39b8f9df567e759baa65e43b54b492fc385c8fef (the stored copies of
    pytorch/pytorch's own test_torch.py predate the device-generic tests):
    test_grad_scaling_unscale, test_grad_scaling_update_scale, test_grad_scaling_unscale_sparse,
    test_grad_scaling_state_dict, _run_scaling_case, test_grad_scaling_autocast,
    test_grad_scaling_clipping, test_grad_scaling_clipping_separate_unscale,
    test_grad_scaling_penalty, test_grad_scaling_accumulation, test_grad_scaling_multiple,
    test_grad_scaler_pass_itself, test_pickle_gradscaler.
  * test/test_cuda.py, class TestCudaOptims,
    pytorch/pytorch@000e43cdff99f30291164c1f2e90133f19fa83fb:
    test_grad_scaling_autocast_fused_optimizers (@onlyNativeDeviceTypes, optim_db entries with
    a fused implementation: Adagrad, Adam, AdamW, SGD).
  * test/test_multigpu.py (earlier test/test_cuda.py), class TestCudaMultiGPU:
    test_grad_scaling_scale (a multi-GPU test there: it scales tensors on cuda:0 and cuda:1;
    here it uses two devices where there are two, else one).
  * torch/testing/_internal/common_cuda.py (torch 2.11.0): the helpers
    _create_scaling_models_optimizers and _create_scaling_case, copied below with the optimizer
    constructor chosen by the variant.

Each test runs three ways (the ``variant`` axis):
  torch            torch.amp.GradScaler with torch.optim (the control: must pass as in torch)
  fusedamp_scaler  fusedamp.GradScaler with torch.optim
  fusedamp_all     fusedamp.GradScaler with fusedamp.optim: torch.optim.Adam/AdamW/SGD are
                   replaced by fusedamp.optim.Adam/AdamW/SGD everywhere the test builds one
                   (FP32 parameters, as in torch's tests, so master weights do not apply).
                   Optimizers fusedamp does not have (Adagrad in the fused-optimizer test, the
                   placeholder optimizers of pass_itself) stay torch's, so for those cases
                   fusedamp_all runs exactly what fusedamp_scaler runs.
Raw ops: where torch's test calls torch's op directly (test_grad_scaling_unscale,
test_grad_scaling_update_scale), the fusedamp variants call fusedamp's op with the same
contract (torch.ops.fusedamp.unscale_and_check_, torch.ops.fusedamp.update_scale_ with
hysteresis 1 and no bounds). Tolerances are torch's everywhere.

Private attributes of torch's scaler, restated with public API:
  1. test_grad_scaling_scale: ``scaler._scale.device == t1.device`` (the scale is created on
     the device of the first tensor scaled) -> every scaled output is on its input's device.
  2. test_grad_scaling_unscale: ``scaler._unscale_grads_(opt, inv_scale, found_inf,
     allow_fp16=True)`` and the sum of its per-device found_inf -> a scaler built with
     init_scale=4 (inv_scale 0.25) whose iteration is begun by a dummy ``scale()`` (torch's
     public unscale_ asserts one ran), ``unscale_(opt)``, ``update()``; "found_inf == 1" is
     "the scale backed off" (get_scale() < 4), "found_inf == 0" is "it did not". torch's public
     ``unscale_`` refuses FP16 gradients (ValueError "Attempting to unscale FP16 gradients.",
     which is why torch's test used the private allow_fp16=True); fusedamp accepts them by
     design (DESIGN.md). So with FP16 gradients in the list the control asserts torch's
     ValueError, and the fusedamp variants run the full check.
  3. test_grad_scaling_unscale_sparse: the same restatement of ``_unscale_grads_(...)[device]``
     (FP32 sparse gradients for all variants; FP16 ones as in 2).
  4. test_grad_scaling_state_dict: ``s1._init_growth_tracker = 7`` -> ``s1.load_state_dict``
     of s1's own state with ``_growth_tracker`` 7; ``isinstance(s1._scale, FloatTensor)`` after
     the lazy-init scale() -> the scaled output is an FP32 tensor on the device;
     ``s1._init_growth_tracker == 0`` -> ``s1.state_dict()["_growth_tracker"] == 0``.
  5. test_pickle_gradscaler: ``a._scale.device.type == device.type`` -> the scaled output is on
     the device; ``b._init_growth_tracker == 0`` -> ``b.state_dict()["_growth_tracker"] == 0``;
     ``b._per_optimizer_states["fdsa"] == _refresh_per_optimizer_state()`` (an optimizer the
     unpickled scaler has not seen starts fresh) -> after a dummy ``b.scale()``, ``b.unscale_``
     on a new optimizer succeeds, and a second ``unscale_`` before ``update()`` raises torch's
     RuntimeError "unscale_() has already been called on this optimizer since the last update()".
Other adaptations: test_grad_scaler_pass_itself checks ``isinstance(grad_scaler, <the
variant's GradScaler class>)`` instead of ``torch.amp.GradScaler``; assertions use torch's
own ``TestCase.assertEqual`` (the ``tc`` fixture), so tolerances and comparisons are torch's.
The single-optimizer training loops share three helpers for what each of torch's loops spells
out (``_iterations``: zero_grad, forward, loss; ``_scaled_step``: the inf injected at
skip_iter, step, update; ``_control_step``: the control's matching skip); what each test does
between backward and step, and in which order, is torch's.

Failing cases are ``xfail(strict=True)`` with the cause (table XFAIL below); once fusedamp is
fixed the strict xfail fails and its entry must be removed.
"""
import contextlib
import fnmatch
import itertools
from functools import partial

import pytest
import torch
from torch.testing._internal.common_utils import TestCase

import fusedamp


@pytest.fixture
def tc():
    """torch's TestCase, for its assertEqual (tolerances by dtype) and assertRaises/Warns."""
    return TestCase()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---- the three variants -------------------------------------------------------------------
_FUSEDAMP_OPTIM = {
    torch.optim.Adam: fusedamp.optim.Adam,
    torch.optim.AdamW: fusedamp.optim.AdamW,
    torch.optim.SGD: fusedamp.optim.SGD,
}


def _fusedamp_update_scale(scale, growth_tracker, found_inf, growth, backoff, growth_interval):
    # torch._amp_update_scale_'s arguments; hysteresis 1 makes fusedamp's state machine torch's.
    # The hysteresis tracker is a state tensor of its own, kept on the scale it belongs to.
    if not hasattr(scale, "_hysteresis_tracker"):
        scale._hysteresis_tracker = torch.ones(1, dtype=torch.int32, device=scale.device)
    torch.ops.fusedamp.update_scale_(scale, growth_tracker, scale._hysteresis_tracker, found_inf,
                                     growth, backoff, growth_interval)


class Variant:
    def __init__(self, name, scaler_cls, fusedamp_optim, unscale_op, update_scale_op):
        self.name = name
        self.scaler_cls = scaler_cls
        self.fusedamp_optim = fusedamp_optim
        self.unscale_op = unscale_op
        self.update_scale_op = update_scale_op
        # torch.amp.GradScaler.unscale_ refuses FP16 gradients; fusedamp's accepts them.
        self.unscales_fp16_grads = scaler_cls is not torch.amp.GradScaler

    def GradScaler(self, device, **kwargs):
        return self.scaler_cls(device, **kwargs)

    def optim(self, cls):
        return _FUSEDAMP_OPTIM.get(cls, cls) if self.fusedamp_optim else cls

    def __repr__(self):
        return self.name


VARIANTS = [
    Variant("torch", torch.amp.GradScaler, False,
            torch._amp_foreach_non_finite_check_and_unscale_, torch._amp_update_scale_),
    Variant("fusedamp_scaler", fusedamp.GradScaler, False,
            torch.ops.fusedamp.unscale_and_check_, _fusedamp_update_scale),
    Variant("fusedamp_all", fusedamp.GradScaler, True,
            torch.ops.fusedamp.unscale_and_check_, _fusedamp_update_scale),
]


# ---- expected failures: (test, glob over the case id, precise cause) -----------------------
# Case ids are "<variant>" or "<variant>-<other axes>". Test names and ids as in pytest's ids.
XFAIL = []


def cases(test, **axes):
    """pytest params over variant x axes, each marked xfail(strict) where XFAIL says so."""
    names = list(axes)
    out = []
    for variant in VARIANTS:
        for combo in itertools.product(*(axes[n] for n in names)):
            ident = "-".join([variant.name] + [i for i, _ in combo])
            reasons = [r for t, pat, r in XFAIL if t == test and fnmatch.fnmatchcase(ident, pat)]
            marks = [pytest.mark.xfail(strict=True, reason=" | ".join(reasons))] if reasons else []
            out.append(pytest.param(variant, *(v for _, v in combo), id=ident, marks=marks))
    return out


# ---- helpers from torch/testing/_internal/common_cuda.py (torch 2.11.0) -------------------
def _create_scaling_models_optimizers(device="cuda", optimizer_ctor=torch.optim.SGD,
                                      optimizer_kwargs=None):
    # Create a module+optimizer that will use scaling, and a control module+optimizer
    # that will not use scaling, against which the scaling-enabled module+optimizer can be compared.
    mod_control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device=device)
    mod_scaling = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device=device)
    with torch.no_grad():
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters(), strict=True):
            s.copy_(c)

    kwargs = {"lr": 1.0}
    if optimizer_kwargs is not None:
        kwargs.update(optimizer_kwargs)
    opt_control = optimizer_ctor(mod_control.parameters(), **kwargs)
    opt_scaling = optimizer_ctor(mod_scaling.parameters(), **kwargs)

    return mod_control, mod_scaling, opt_control, opt_scaling


def _create_scaling_case(device="cuda", dtype=torch.float, optimizer_ctor=torch.optim.SGD,
                         optimizer_kwargs=None):
    data = [(torch.randn((8, 8), dtype=dtype, device=device), torch.randn((8, 8), dtype=dtype, device=device)),
            (torch.randn((8, 8), dtype=dtype, device=device), torch.randn((8, 8), dtype=dtype, device=device)),
            (torch.randn((8, 8), dtype=dtype, device=device), torch.randn((8, 8), dtype=dtype, device=device)),
            (torch.randn((8, 8), dtype=dtype, device=device), torch.randn((8, 8), dtype=dtype, device=device))]

    loss_fn = torch.nn.MSELoss().to(device)

    skip_iter = 2

    return _create_scaling_models_optimizers(
        device=device, optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs,
    ) + (data, loss_fn, skip_iter)


# _run_scaling_case generalizes some single-optimizer test logic to avoid too much copy-pasting below.
def _run_scaling_case(tc, variant, device, run, unskipped, skipped, atol=1e-7,
                      optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    # Ensure scaling can be disabled without changing user control flow.
    for enabled in True, False:
        (
            mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, skip_iter,
        ) = _create_scaling_case(device=device, optimizer_ctor=variant.optim(optimizer_ctor),
                                 optimizer_kwargs=optimizer_kwargs)

        # For functionality, test with a modest initial scale, and an unrealistically-large growth factor
        # so any potential errors with the growth factor handling will be magnified.
        GradScaler = partial(variant.GradScaler, device)
        scaler = GradScaler(init_scale=128., growth_factor=2.0, enabled=enabled, growth_interval=1)

        _ = run(device, data, mod_control, opt_control, scaler, loss_fn, skip_iter, False)
        ret = run(device, data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True)

        # Allows run() to optionally return a different scaler instance.
        scaler = ret if ret else scaler

        # If scaling was enabled, the scale factor should have been multiplied by the growth factor
        # len(data) - skipped times and the backoff factor "skipped" times.
        if enabled:
            net_growth = scaler.get_growth_factor()**unskipped if unskipped > 0 else 1.0
            net_backoff = scaler.get_backoff_factor()**skipped if skipped > 0 else 1.0
            tc.assertTrue(scaler.get_scale() == (128. * net_growth * net_backoff))
        else:
            tc.assertTrue(scaler.get_scale() == 1.0)

        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            tc.assertEqual(c.grad, s.grad, atol=atol, rtol=1e-05)

            c_state, s_state = opt_control.state[c], opt_scaling.state[s]
            for k in c_state:
                tc.assertEqual(c_state[k], s_state[k], atol=atol, rtol=1e-05, msg=k)

            tc.assertEqual(c, s, atol=atol, rtol=1e-05)


# ---- the iteration every single-optimizer training loop of torch's tests writes out ---------
# torch's tests spell these steps out in each loop; they are written once here, each test's
# loop keeping what it does to the gradients between backward and step.
def _iterations(data, model, optimizer, loss_fn, forward_context=None):
    """Each (i, loss) of a loop over ``data``, the gradients zeroed first; the forward pass runs
    inside ``forward_context()`` where one is given (autocast)."""
    for i, (input, target) in enumerate(data):
        optimizer.zero_grad()
        with forward_context() if forward_context else contextlib.nullcontext():
            output = model(input)
            loss = loss_fn(output, target)
        yield i, loss


def _scaled_step(scaler, optimizer, model, i, skip_iter, before_step=None):
    """The scaling run's step: iteration ``skip_iter`` gets an inf in one gradient, so an enabled
    scaler must skip it (and back off); ``before_step`` is what the test does with the
    gradients after that (unscale_ and clip), then step and update."""
    if i == skip_iter and scaler.is_enabled():
        with torch.no_grad():
            model[1].weight.grad.fill_(float('inf'))
    if before_step is not None:
        before_step()
    scaler.step(optimizer)
    scaler.update()


def _control_step(scaler, optimizer, i, skip_iter):
    """The control run's step: it leaves out the step the scaling run is made to skip, so the two
    runs' parameters and states can be compared."""
    if (not scaler.is_enabled()) or (i != skip_iter):
        optimizer.step()


def _scaler_for_unscale(GradScaler, device):
    """Restatement of the inv_scale 0.25 handed to a private _unscale_grads_: a scaler at
    scale 4 whose iteration has begun (torch's public unscale_ asserts that scale() ran)."""
    scaler = GradScaler(init_scale=4.0)
    scaler.scale(torch.ones((), device=device))
    return scaler


def _found_inf_after_update(scaler, init_scale):
    """Restatement of the found_inf a private _unscale_grads_ returned: after unscale_ and
    update(), the scale backed off iff an inf/NaN was found (growth_interval is 2000)."""
    scaler.update()
    return 1.0 if scaler.get_scale() < init_scale else 0.0
