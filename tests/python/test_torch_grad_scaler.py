"""PyTorch's own GradScaler tests of the scaler's API, run against fusedamp: scale (onto each
tensor's device), unscale_ of dense and sparse gradients, update, state_dict and pickling.

Ported from PyTorch (BSD-3-Clause, Copyright (c) PyTorch contributors); torch_grad_scaler_port.py
names the sources, the three variants every test runs as, and each adaptation.
"""
import pickle
from functools import partial

import pytest
import torch

from torch_grad_scaler_port import (  # noqa: F401 (tc, _seed: fixtures)
    _found_inf_after_update, _scaler_for_unscale, _seed, cases, tc)


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

    for bad in (float('inf'), float('nan')):  # torch's test: the same block for each
        v = torch.FloatTensor([16., 32., bad])
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
