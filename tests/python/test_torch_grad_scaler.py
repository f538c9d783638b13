"""PyTorch's own GradScaler tests, run against fusedamp.

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

Failing cases are ``xfail(strict=True)`` with the cause (table XFAIL below); once fusedamp is
fixed the strict xfail fails and its entry must be removed.
"""
import contextlib
import fnmatch
import itertools
import pickle
from copy import deepcopy
from functools import partial
from itertools import chain

import pytest
import torch
from torch.testing._internal.common_optimizers import TensorTracker, optim_db
from torch.testing._internal.common_utils import TestCase

import fusedamp


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


@pytest.fixture
def tc():
    """torch's TestCase, for its assertEqual (tolerances by dtype) and assertRaises/Warns."""
    return TestCase()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


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


# ---- test/test_multigpu.py ------------------------------------------------------------------
@pytest.mark.parametrize("variant", cases("test_grad_scaling_scale"))
def test_grad_scaling_scale(tc, variant, device):
    scaler = variant.GradScaler(device, init_scale=2.)
    dev0 = dev1 = device
    if device == "cuda" and torch.cuda.device_count() >= 2:
        dev0, dev1 = "cuda:0", "cuda:1"
    t0 = torch.full((1,), 4.0, dtype=torch.float32, device=dev0)
    t1 = torch.full((1,), 4.0, dtype=torch.float32, device=dev1)
    # Create some nested iterables of tensors on different devices.
    outputs = (t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), (t1.clone(), t0.clone())])
    outputs = scaler.scale(outputs)
    tc.assertTrue(outputs[0] == 8.0 and outputs[1][0] == 8.0 and outputs[1][1] == 8.0 and
                  outputs[2][0] == 8.0 and outputs[2][1][0] == 8.0 and outputs[2][1][1] == 8.0)
    # restatement 1 of scaler._scale.device == t1.device
    tc.assertTrue(outputs[0].device == t1.device and outputs[1][0].device == t0.device and
                  outputs[1][1].device == t1.device and outputs[2][0].device == t0.device and
                  outputs[2][1][0].device == t1.device and outputs[2][1][1].device == t0.device)


# ---- test/test_torch.py ---------------------------------------------------------------------
@pytest.mark.parametrize("variant,dtype", cases(
    "test_grad_scaling_unscale", dtype=[("float32", torch.float), ("float64", torch.double)]))
def test_grad_scaling_unscale(tc, variant, device, dtype):
    device = torch.device(device)
    device0 = "cuda:0" if device.type == "cuda" else "cpu"
    inv_scale = torch.full((1,), 0.25, dtype=torch.float, device=device0)
    found_inf = torch.full((1,), 0.0, dtype=torch.float, device=device0)

    size = 20
    g = torch.full((size, size), 4.0, dtype=dtype, device=device0)
    ginf = g.clone()
    ginf[2, 2] = float('inf')
    gnan = g.clone()
    gnan[2, 2] = float('nan')

    # Tries selected combinations of
    #  - contiguous grads
    #  - g.clone().t() which is not contiguous but still non overlapping and dense
    #  - variants of g.clone()[:, :5] which are not non overlapping and dense
    # Non overlapping and dense grads route into a multi tensor apply kernel,
    # others use a fallback per-tensor kernel, so we should try both.
    cases_ = (
        ([g.clone(), g.clone()], False),
        ([g.clone(), g.clone().t()], False),
        ([g.clone(), g.clone()[:, :5]], False),
        ([g.clone()[:, :5], g.clone()[:, :5]], False),
        ([g.clone(), ginf.clone()], True),
        ([g.clone(), gnan.clone()], True),
        ([g.clone(), ginf.clone()[:, :5]], True),
        ([g.clone(), gnan.clone()[:, :5]], True),
        ([ginf.clone(), g.clone()[:, :5]], True),
        ([ginf.clone()[:, :5], g.clone()[:, :5]], True),
    )

    for grads, has_inf in cases_:
        found_inf.zero_()
        variant.unscale_op(grads, found_inf, inv_scale)
        if has_inf:
            tc.assertEqual(found_inf, 1.0)
        else:
            tc.assertEqual(found_inf, 0.0)
            for grad in grads:
                tc.assertEqual(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)

    # When passing lists with mismatched dtypes to a raw
    # _amp_foreach_non_finite_check_and_unscale_ call on CUDA,
    # it's expected to fall back to single-tensor TensorIterator kernel.
    grads = [g.clone(), g.to(dtype=torch.float16)]
    variant.unscale_op(grads, found_inf, inv_scale)
    for grad in grads:
        tc.assertEqual(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)

    TEST_MULTIGPU = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    # Passing lists with mismatched devices to a raw
    # _amp_foreach_non_finite_check_and_unscale_ call should raise errors.
    if device.type == "cuda" and TEST_MULTIGPU:
        with tc.assertRaisesRegex(RuntimeError, r"Expected all tensors to be on the same device"):
            variant.unscale_op([g.clone(), g.to(device="cuda:1")], found_inf, inv_scale)

    # Creates a list of grads with mismatched dtypes and devices, to ensure
    # scaler._unscale_grads_ organizes grads by dtype and device before calling
    # _amp_foreach_non_finite_check_and_unscale_ on each set.
    # If inject_inf >= 0, writes an inf into one grad for _unscale_grads_ to find.
    def perfect_storm_grads(inject_inf):
        grads = [g.clone(), g.clone()[:, :5], g.to(dtype=torch.float16), g.to(dtype=torch.float16)]
        if device.type == "cuda" and TEST_MULTIGPU:
            grads += [g.to(device="cuda:1"),
                      g.to(device="cuda:1")[:, :5],
                      g.to(device="cuda:1", dtype=torch.float16),
                      g.to(device="cuda:1", dtype=torch.float16)]
        if inject_inf >= 0:
            grads[inject_inf][2, 2] = float('inf')
        return grads

    GradScaler = partial(variant.GradScaler, device.type)
    dummy_params = [torch.empty_like(g) for g in perfect_storm_grads(-1)]
    dummy_opt = variant.optim(torch.optim.SGD)(dummy_params, lr=1.)

    # Ensures the inf/nan checking can find an inf injected onto any grad in the perfect storm.
    for inject_inf in range(-1, len(dummy_params)):
        grads = perfect_storm_grads(inject_inf)
        for i, p in enumerate(dummy_params):
            p.grad = grads[i]
        # restatement 2 of scaler._unscale_grads_(dummy_opt, inv_scale, found_inf, True)
        scaler = _scaler_for_unscale(GradScaler, device)
        if not variant.unscales_fp16_grads:
            with tc.assertRaisesRegex(ValueError, "Attempting to unscale FP16 gradients"):
                scaler.unscale_(dummy_opt)
            continue
        scaler.unscale_(dummy_opt)
        found_inf = _found_inf_after_update(scaler, 4.0)
        if inject_inf < 0:
            # No inf was injected, ensures unscaling worked normally.
            tc.assertTrue(found_inf == 0)
            for grad in grads:
                tc.assertEqual(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)
        else:
            # inf was injected, ensures inf was found.
            tc.assertTrue(found_inf == 1)


@pytest.mark.parametrize("variant", cases("test_grad_scaling_update_scale"))
def test_grad_scaling_update_scale(tc, variant, device):
    dtype = torch.float
    growth = 2.0
    backoff = 0.25
    growth_interval = 2
    scale = torch.full((1,), 4.0, dtype=dtype, device=device)
    growth_tracker = torch.full((1,), 0.0, dtype=torch.int32, device=device)
    found_inf = torch.full((1,), 0.0, dtype=torch.float, device=device)

    # Simulates 2 consecutive unskipped iterations
    variant.update_scale_op(scale, growth_tracker, found_inf, growth, backoff, growth_interval)
    tc.assertEqual(growth_tracker, 1)
    tc.assertEqual(scale, 4.0)
    variant.update_scale_op(scale, growth_tracker, found_inf, growth, backoff, growth_interval)
    tc.assertEqual(growth_tracker, 0)
    tc.assertEqual(scale, 8.0)

    # Simulates a skipped iteration
    found_inf.fill_(1.0)
    variant.update_scale_op(scale, growth_tracker, found_inf, growth, backoff, growth_interval)
    tc.assertEqual(growth_tracker, 0)
    tc.assertEqual(scale, 2.0)


@pytest.mark.parametrize("variant", cases("test_grad_scaling_unscale_sparse"))
def test_grad_scaling_unscale_sparse(tc, variant, device):
    dtype = torch.float
    device = torch.device(device)
    # restatement 3: a scaler with init_scale=4 (inv_scale 0.25) per check, public unscale_
    GradScaler = partial(_scaler_for_unscale, partial(variant.GradScaler, device.type), device)

    i = torch.tensor([[0, 1, 1],
                      [2, 0, 2]], device=device, dtype=torch.int64)
    v = torch.tensor([16., 32., 64.], device=device, dtype=torch.float)
    s = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=dtype)

    p = s.clone()
    if not p.is_sparse:
        raise AssertionError("expected p to be sparse")
    opt = variant.optim(torch.optim.SGD)([p], lr=1.)

    p.grad = s.clone()
    scaler = GradScaler()
    scaler.unscale_(opt)
    found_inf = _found_inf_after_update(scaler, 4.0)
    tc.assertEqual(found_inf, 0.0)
    tc.assertEqual(p.grad.to_dense(), (s / 4).to_dense())

    v = torch.FloatTensor([16., 32., float('inf')])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=dtype)
    scaler = GradScaler()
    scaler.unscale_(opt)
    found_inf = _found_inf_after_update(scaler, 4.0)
    tc.assertEqual(found_inf, 1.0)

    v = torch.FloatTensor([16., 32., float('nan')])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=dtype)
    scaler = GradScaler()
    scaler.unscale_(opt)
    found_inf = _found_inf_after_update(scaler, 4.0)
    tc.assertEqual(found_inf, 1.0)

    p = s.clone().half()
    if not p.is_sparse:
        raise AssertionError("expected p to be sparse")
    opt = variant.optim(torch.optim.SGD)([p], lr=1.)

    p.grad = s.clone().half()
    scaler = GradScaler()
    if not variant.unscales_fp16_grads:  # restatement 2: torch's public unscale_ refuses FP16
        with tc.assertRaisesRegex(ValueError, "Attempting to unscale FP16 gradients"):
            scaler.unscale_(opt)
        return
    scaler.unscale_(opt)
    found_inf = _found_inf_after_update(scaler, 4.0)
    tc.assertEqual(found_inf, 0.0)
    tc.assertEqual(p.grad.to_dense(), (s.half() / 4).to_dense())

    # Creates fp16 sparse tensor with duplicated indices (uncoalesced).  The uncoalesced representation
    # does not overflow in fp16, but the coalesced representation would, because 64000 + 64000 > fp16 max.
    # _amp_non_finite_check_and_unscale_ should report an overflow here.
    i = torch.LongTensor([[0, 1, 0],
                          [2, 0, 2]])
    v = torch.FloatTensor([64000., 32., 64000.])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device=device, dtype=torch.float16)
    scaler = GradScaler()
    scaler.unscale_(opt)
    found_inf = _found_inf_after_update(scaler, 4.0)
    tc.assertEqual(found_inf, 1.0)


@pytest.mark.parametrize("variant", cases("test_grad_scaling_state_dict"))
def test_grad_scaling_state_dict(tc, variant, device):
    device = torch.device(device)
    GradScaler = partial(variant.GradScaler, device.type)
    for lazy_init_scale in True, False:
        s0 = GradScaler(init_scale=3., growth_factor=4., backoff_factor=.5, growth_interval=2)
        s1 = GradScaler(init_scale=6., growth_factor=7., backoff_factor=.8, growth_interval=1)

        # sets a random value for load_state_dict to overwrite
        # (restatement 4 of s1._init_growth_tracker = 7)
        s1.load_state_dict({**s1.state_dict(), "_growth_tracker": 7})

        if lazy_init_scale:
            # Dummy scale() call to ensure the scale tensor is lazily initialized.
            out = s1.scale(torch.full((1,), 4.0, dtype=torch.float32, device=device))
            # restatement 4 of isinstance(s1._scale, torch.(cuda.)FloatTensor)
            tc.assertTrue(out.dtype == torch.float32 and out.device.type == device.type)

        s1.load_state_dict(s0.state_dict())

        tc.assertEqual(s1.get_scale(), 3.)
        tc.assertEqual(s1.get_growth_factor(), 4.)
        tc.assertEqual(s1.get_backoff_factor(), .5)
        tc.assertEqual(s1.get_growth_interval(), 2)
        # restatement 4 of s1._init_growth_tracker == 0
        tc.assertEqual(s1.state_dict()["_growth_tracker"], 0)


_AUTOCAST_OPTIMS = [(o.optim_cls.__name__, o.optim_cls) for o in optim_db
                    if o.optim_cls in [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD]]
_FOREACH_FUSED = [("default", (None, None)), ("foreach", (True, None)), ("fused", (None, True))]


@pytest.mark.parametrize("variant,optimizer_ctor,foreach_fused", cases(
    "test_grad_scaling_autocast", optim=_AUTOCAST_OPTIMS, impl=_FOREACH_FUSED))
def test_grad_scaling_autocast(tc, variant, device, optimizer_ctor, foreach_fused):
    foreach, fused = foreach_fused
    try_pickle = False

    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast(device_type=device, dtype=torch.half, enabled=try_scaling_api):
                output = model(input)
                loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    with torch.no_grad():
                        model[1].weight.grad.fill_(float('inf'))
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()
        return scaler

    # Compares no scaling + no autocasting against scaling + autocasting.
    # NOTE(mkozuki): With current way of testing, `torch.optim.Adam` is failing in spite of `foreach` and `fused`.
    #   Giving some flexibility to this test might help.
    context = contextlib.nullcontext
    if optimizer_ctor in (torch.optim.Adam, torch.optim.AdamW):
        context = partial(tc.assertRaises, AssertionError)
    with context():
        # sets atol=1e-3 because we're comparing pure fp32 arithmetic vs a mixture of fp16 and fp32
        _run_scaling_case(
            tc, variant, device, run, unskipped=3, skipped=1, atol=1e-3,
            optimizer_ctor=optimizer_ctor, optimizer_kwargs={"foreach": foreach, "fused": fused},
        )
        # this will be picked up by try_pickle within run():
        try_pickle = True
        _run_scaling_case(
            tc, variant, device, run, unskipped=3, skipped=1, atol=1e-3,
            optimizer_ctor=optimizer_ctor, optimizer_kwargs={"foreach": foreach, "fused": fused},
        )


@pytest.mark.parametrize("variant", cases("test_grad_scaling_clipping"))
def test_grad_scaling_clipping(tc, variant, device):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2  # A reasonable value that actually has an effect, based on printouts of grads
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float('inf'))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(tc, variant, device, run, unskipped=3, skipped=1, atol=1e-5)


@pytest.mark.parametrize("variant", cases("test_grad_scaling_clipping_separate_unscale"))
def test_grad_scaling_clipping_separate_unscale(tc, variant, device):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2  # A reasonable value that actually has an effect, based on printouts of grads
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float('inf'))
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(tc, variant, device, run, unskipped=3, skipped=1)


@pytest.mark.parametrize("variant", cases("test_grad_scaling_penalty"))
def test_grad_scaling_penalty(tc, variant, device):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)

            if try_scaling_api:
                grad_params = torch.autograd.grad(scaler.scale(loss),
                                                  model.parameters(), create_graph=True)
                inv_scale = 1. / scaler.get_scale()
                grad_params = [p * inv_scale for p in grad_params]
            else:
                grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)

            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            grad_norm = grad_norm.sqrt()
            loss = loss + grad_norm

            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    model[1].weight.grad.data.fill_(float('inf'))
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(tc, variant, device, run, unskipped=3, skipped=1)


@pytest.mark.parametrize("variant", cases("test_grad_scaling_accumulation"))
def test_grad_scaling_accumulation(tc, variant, device):
    def run(device, data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        iters_to_accumulate = 2
        for i, (input, target) in enumerate(data):
            output = model(input)
            loss = loss_fn(output, target)
            loss = loss / iters_to_accumulate
            if try_scaling_api:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()
                else:
                    optimizer.step()
                    optimizer.zero_grad()

    _run_scaling_case(tc, variant, device, run, unskipped=2, skipped=0)


@pytest.mark.parametrize("variant", cases("test_grad_scaling_multiple"))
def test_grad_scaling_multiple(tc, variant, device):
    device = torch.device(device)
    SGD = variant.optim(torch.optim.SGD)
    # Tests gradient scaling with 2 models and 2 optimizers that both receive gradients from 2 losses.
    # Some of the logic here cannot reuse the generic helper functions created for the 1-optimizer cases.
    for enabled in True, False:
        mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = \
            _create_scaling_case(device.type, optimizer_ctor=SGD)
        mod_control1, mod_scaling1, opt_control1, opt_scaling1 = \
            _create_scaling_models_optimizers(device.type, optimizer_ctor=SGD)

        GradScaler = partial(variant.GradScaler, device.type)
        scaler = GradScaler(init_scale=128., growth_factor=2.0, enabled=enabled, growth_interval=1)

        def run(model0, model1, optimizer0, optimizer1, try_scaling_api):
            for i, (input, target) in enumerate(data):
                optimizer0.zero_grad()
                optimizer1.zero_grad()
                output0 = model0(input)
                output1 = model1(input)
                loss0 = loss_fn(0.3 * output0 + 0.7 * output1, target)
                loss1 = loss_fn(0.6 * output0 - 0.4 * output1, target)

                if try_scaling_api:
                    scaler.scale(loss0).backward(retain_graph=True)
                    scaler.scale(loss1).backward()
                    if i == skip_iter and scaler.is_enabled():
                        model1[1].weight.grad.data.fill_(float('inf'))

                    # As an additional stress test, separately unscale for one of the optimizers.
                    scaler.unscale_(optimizer0)

                    scaler.step(optimizer0)
                    scaler.step(optimizer1)
                    scaler.update()
                else:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    optimizer0.step()
                    if (not scaler.is_enabled()) or (i != skip_iter):
                        optimizer1.step()

        run(mod_control0, mod_control1, opt_control0, opt_control1, False)
        run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, True)

        # The loss scale should have been multiplied by the growth factor 3 times and the backoff factor once.
        tc.assertTrue(scaler.get_scale() == (128. * scaler.get_growth_factor()**3 *
                                             scaler.get_backoff_factor()**1) if enabled else 1.0)

        for c, s in zip(chain(mod_control0.parameters(), mod_control1.parameters()),
                        chain(mod_scaling0.parameters(), mod_scaling1.parameters())):
            tc.assertEqual(c, s, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("variant", cases("test_grad_scaler_pass_itself"))
def test_grad_scaler_pass_itself(tc, variant, device):
    device = torch.device(device)
    GradScaler = partial(variant.GradScaler, device.type)
    scaler_cls = variant.scaler_cls

    class _PlaceHolderOptimizer(torch.optim.Optimizer):
        tester = tc

        def __init__(self, params, defaults=None):
            if defaults is None:
                defaults = {}
            super().__init__(params, defaults)
            self._step_supports_amp_scaling = True

    class Optimizer1(_PlaceHolderOptimizer):
        def step(self, closure=None, *, grad_scaler=None):
            self.tester.assertTrue(isinstance(grad_scaler, scaler_cls))
            self.tester.assertFalse(hasattr(self, "grad_scale"))
            self.tester.assertFalse(hasattr(self, "found_inf"))

    class Optimizer2(_PlaceHolderOptimizer):
        def step(self, closure=None):
            self.tester.assertTrue(isinstance(self.grad_scale, torch.Tensor))
            self.tester.assertTrue(isinstance(self.found_inf, torch.Tensor))

    x = torch.randn(4, 4).to(device)
    m = torch.nn.Linear(4, 1).to(device)
    o1 = Optimizer1(m.parameters())
    o2 = Optimizer2(m.parameters())
    scaler = GradScaler(init_scale=2.0)

    with torch.autocast(device_type=device.type, dtype=torch.half):
        y = m(x)
        loss = y.mean()
    scaler.scale(loss).backward()
    with tc.assertWarns(FutureWarning):
        scaler.step(o1)
    scaler.step(o2)
    scaler.update()


@pytest.mark.parametrize("variant", cases("test_pickle_gradscaler"))
def test_pickle_gradscaler(tc, variant, device):
    # This test should pass in 3 cases for cuda:
    #  1. cuda is not available.
    #  2. cuda is available but device is not cuda.
    #  3. cuda is available and device is cuda.
    # In case 1, a and b disable themselves on construction and shouldn't try to pickle workhorse attributes.
    # In case 2, a and b are enabled.  Workhorse attributes participate in pickling, but none are lazy-inited
    # to cuda Tensors, because I don't want to do cuda things if device is not cuda.
    # In case 3, a and b are enabled and we may also try lazy-initing _scale to a cuda tensor.
    device = torch.device(device)
    try_lazy_inits = (True, False)
    GradScaler = partial(variant.GradScaler, device.type)
    for lazy_init_scale in try_lazy_inits:
        a = GradScaler(init_scale=3., growth_factor=4., backoff_factor=.5, growth_interval=2)
        if device.type == "cuda":
            tc.assertTrue(not a.is_enabled() if torch.cuda.amp.common.amp_definitely_not_available() else a.is_enabled())
        else:
            tc.assertTrue(a.is_enabled())
        if lazy_init_scale:
            # Dummy a.scale() call lazy-inits a._scale Tensor.
            out = a.scale(torch.tensor([4.0], dtype=torch.float32, device=device))
            # restatement 5 of a._scale.device.type == device.type
            tc.assertTrue(out.device.type == device.type)
        # The following three lines should work whether or not cuda is available.
        serialized = pickle.dumps(a)
        b = pickle.loads(serialized)
        tc.assertEqual(b.is_enabled(), a.is_enabled())
        if a.is_enabled():
            tc.assertEqual(b.get_scale(), 3.)
            tc.assertEqual(b.get_growth_factor(), 4.)
            tc.assertEqual(b.get_backoff_factor(), .5)
            tc.assertEqual(b.get_growth_interval(), 2)
            # restatement 5 of b._init_growth_tracker == 0
            tc.assertEqual(b.state_dict()["_growth_tracker"], 0)
            # supplies a dummy key to test the defaultdict's default_factory
            # (restatement 5: an optimizer b has not seen starts fresh)
            p = torch.zeros(2, device=device, requires_grad=True)
            p.grad = torch.ones(2, device=device)
            fresh = variant.optim(torch.optim.SGD)([p], lr=1.)
            b.scale(torch.ones((), device=device))  # torch's unscale_ asserts that scale() ran
            b.unscale_(fresh)
            with tc.assertRaisesRegex(RuntimeError, "unscale_\\(\\) has already been called"):
                b.unscale_(fresh)
            if lazy_init_scale:
                tc.assertEqual(b.scale(torch.tensor([4.0], dtype=torch.float32, device=device)), 12.0)


# ---- test/test_cuda.py (TestCudaOptims) -----------------------------------------------------
_FUSED_OPTIMS = [(o.optim_cls.__name__, o) for o in optim_db if "fused" in o.supported_impls]


@pytest.mark.parametrize("variant,optim_info", cases(
    "test_grad_scaling_autocast_fused_optimizers", optim=_FUSED_OPTIMS))
def test_grad_scaling_autocast_fused_optimizers(tc, variant, device, optim_info):
    device = device.split(":")[0]
    if device not in optim_info.supports_fused_on:
        pytest.skip(f"{device} is not supported for fused on {optim_info.optim_cls.__name__}")
    optim_inputs = optim_info.optim_inputs_func(device=device)
    optim_cls = variant.optim(optim_info.optim_cls)
    for optim_input in optim_inputs:
        for _separate_unscale in (True, False):
            kwargs = optim_input.kwargs
            kwargs["fused"] = True
            torch.manual_seed(20)
            (
                mod_control,
                mod_scaling,
                opt_control,
                opt_scaling,
                data,
                loss_fn,
                _,
            ) = _create_scaling_case(
                optimizer_ctor=optim_cls, optimizer_kwargs=kwargs, device=device
            )
            optimizer_kwargs = deepcopy(kwargs)
            optimizer_kwargs["fused"] = False
            if "lr" not in kwargs:
                # _create_scaling_case will set lr = 1.0 if optimizer_kwargs do not set lr
                optimizer_kwargs["lr"] = 1.0
            opt_control = optim_cls(mod_control.parameters(), **optimizer_kwargs)
            scaler_scaling = variant.GradScaler(device, init_scale=128.0)
            scaler_control = variant.GradScaler(device, init_scale=128.0)
            tracker = TensorTracker()
            for input, target in data:
                opt_control.zero_grad()
                with torch.autocast(device_type=device, dtype=torch.half):
                    output_control = mod_control(input)
                    loss_control = loss_fn(output_control, target)
                scaler_control.scale(loss_control).backward()
                scaler_control.step(opt_control)
                scaler_control.update()

                opt_scaling.zero_grad()
                with torch.autocast(device_type=device, dtype=torch.half):
                    output_scaling = mod_scaling(input)
                    loss_scaling = loss_fn(output_scaling, target)
                scaler_scaling.scale(loss_scaling).backward()
                if _separate_unscale:
                    scaler_scaling.unscale_(opt_scaling)
                scaler_scaling.step(opt_scaling)
                scaler_scaling.update()

                tracker.add(loss_control)
                tracker.pop_check_set(loss_scaling, tc)
                for param_control, param_scaling in zip(
                    mod_control.parameters(), mod_scaling.parameters()
                ):
                    tracker.add(param_control.grad)
                    tracker.pop_check_set(param_scaling.grad, tc)
                    tracker.add(param_control)
                    tracker.pop_check_set(param_scaling, tc)

                    state_control, state_scaling = (
                        opt_control.state[param_control],
                        opt_scaling.state[param_scaling],
                    )

                    for k in state_control:
                        actual = state_scaling[k]
                        if k == "step":
                            actual = actual.squeeze()
                        tracker.add(state_control[k])
                        tracker.pop_check_set(actual, tc)
