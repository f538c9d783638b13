"""Where and how the CUDA kernels launch: more tensors than one launch's metadata holds (every op
spans several launches and still matches the CPU), on the tensors' device rather than the
current one, on the current stream, and a whole step (grad_stats_ -> adam_step_ ->
update_scale_) captured in a CUDA graph and replayed, bit-identical to the same step run
eagerly. Every op runs with host synchronisation forbidden."""
import pytest
import torch

from cuda_helpers import LOW, assert_same, capture, cuda_call, dtype_id, rand, sync_forbidden
from op_helpers import needs_cuda, ops
from op_inputs import op_inputs

pytestmark = needs_cuda


# ------------------------------------------------------------ many tensors
def test_more_tensors_than_one_launch_holds():
    # 5000 tensors exceed every kernel's per-launch metadata (the largest holds ~1100 tensors,
    # the step-count kernel ~4000), so each op spans several launches.
    gen = torch.Generator().manual_seed(41)
    n = 5000
    sizes = [(1 + (i * 7) % 13,) for i in range(n)]
    p32 = [rand(s, torch.float32, gen) for s in sizes]
    grads = [rand(s, torch.float16, gen, scale=100.0) for s in sizes]
    grads[4321][0] = float("inf")
    cpu = op_inputs("cpu", param_dtype=torch.float16, master_weights=True, momentum=True,
                    weights=p32, grads=grads, scalars=dict(found_inf=0.0, grad_sum_sq=0.0,
                                                           tensor_flags=0.0, inv_scale=1 / 128.0))
    cuda = cpu.map(lambda _, t: t.cuda())

    cpu.call("grad_stats_")
    cuda_call(cuda.call, "grad_stats_")
    assert cuda.found_inf.item() == 1.0
    assert torch.nonzero(cuda.tensor_flags).flatten().tolist() == [4321]
    assert torch.equal(cuda.tensor_flags.cpu(), cpu.tensor_flags)

    grads[4321][0] = 1.0
    cpu.grads, cuda.grads = [g.clone() for g in grads], [g.cuda() for g in grads]
    cpu.found_inf.zero_()
    cuda.found_inf.zero_()
    cpu.call("unscale_and_check_")
    cuda_call(cuda.call, "unscale_and_check_")
    assert cuda.found_inf.item() == cpu.found_inf.item() == 0.0
    assert_same(cuda.grads, cpu.grads, exact=True)

    for _ in range(2):  # the grads are unscaled already: found_inf only
        cpu.call("adam_step_", inv_scale=None)
        cuda_call(cuda.call, "adam_step_", inv_scale=None)
    assert_same(cuda.master_params, cpu.master_params, rtol=1e-5, atol=1e-6)
    assert_same(cuda.exp_avgs, cpu.exp_avgs, rtol=1e-5, atol=1e-7)
    assert_same(cuda.params, cpu.params)
    assert torch.stack(cuda.steps).eq(2).all()

    sgd_kw = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
                  inv_scale=None, found_inf=None)
    cpu.call("sgd_step_", **sgd_kw)
    cuda_call(cuda.call, "sgd_step_", **sgd_kw)
    assert_same(cuda.momentum_buffers, cpu.momentum_buffers, rtol=1e-5, atol=1e-6)
    assert_same(cuda.master_params, cpu.master_params, rtol=1e-5, atol=1e-6)
    assert torch.stack(cuda.steps).eq(3).all()


# ------------------------------------------------------------ devices and streams
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_runs_on_the_tensors_device():
    inp = op_inputs("cuda:1", [(1000,)], moments=False)
    ref = inp.params[0].cpu()
    with torch.cuda.device(0):
        cuda_call(inp.call, "sgd_step_", lr=0.5, momentum=0.0, dampening=0.0, weight_decay=0.0,
                  nesterov=False)
    torch.testing.assert_close(inp.params[0].cpu(), ref - 0.5 * inp.grads[0].cpu())


def test_runs_on_the_current_stream():
    s = torch.cuda.Stream()
    g = torch.randn(1 << 20, device="cuda")
    expected = g * 0.25
    found, inv = torch.zeros(1, device="cuda"), torch.full((1,), 0.25, device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cuda_call(ops.unscale_and_check_, [g], found, inv)
        done = torch.cuda.Event()
        done.record(s)
    torch.cuda.current_stream().wait_event(done)
    assert torch.equal(g, expected)


# ------------------------------------------------------------ CUDA graphs
def _make_state(gen, pdtype):
    sizes = [(1000,), (33, 17), (32769,), (5,)]
    return op_inputs("cuda", param_dtype=pdtype, master_weights=True,
                     weights=[rand(s, torch.float32, gen) for s in sizes],
                     grads=[torch.zeros(s, dtype=pdtype) for s in sizes], loss_scale=2.0 ** 10,
                     scalars=dict(found_inf=0.0, grad_sum_sq=0.0, inv_scale=1.0, lr_tensor=1e-3,
                                  tensor_flags=0.0))


def _step(s):
    """One whole training step after backward, all on the device."""
    s.found_inf.zero_()
    s.grad_sum_sq.zero_()
    torch.reciprocal(s.scale, out=s.inv_scale)
    s.call("grad_stats_")
    s.call("adam_step_", lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
           decoupled_weight_decay=True, max_grad_norm=5.0)
    s.call("update_scale_", growth_factor=2.0, backoff_factor=0.5, growth_interval=3)


@pytest.mark.parametrize("pdtype", LOW, ids=dtype_id)
def test_whole_step_in_a_cuda_graph_equals_eager(pdtype):
    gen = torch.Generator().manual_seed(51)
    eager = _make_state(gen, pdtype)
    graphed = eager.map(lambda _, t: t.clone())

    graph = capture(_step, eager.map(lambda _, t: t.clone()), graphed)

    for it in range(12):
        grads = [rand(t.shape, torch.float32, gen, scale=2.0 ** 10).to(pdtype).cuda()
                 for t in eager.grads]
        if it in (4, 5):
            grads[2].view(-1)[7] = float("inf")  # skipped steps: scale backs off
        lr = 1e-3 * (0.9 ** it)
        for s in (eager, graphed):
            for dst, src in zip(s.grads, grads):
                dst.copy_(src)
            s.lr_tensor.fill_(lr)
        with sync_forbidden():
            _step(eager)
        graph.replay()
    torch.cuda.synchronize()

    for (name, x), (_, y) in zip(eager.named_tensors(), graphed.named_tensors()):
        assert torch.equal(x, y), name  # deterministic kernels: bit-identical
    # growth every 3 clean steps, backoff on steps 4 and 5: 1024 -> 2048 -> 1024 -> 512 ->
    # 1024 -> 2048
    assert eager.scale.item() == 2048.0
    assert eager.tensor_flags.tolist() == [0.0, 0.0, 1.0, 0.0]
    assert all(s.item() == 10.0 for s in eager.steps)  # 12 steps, 2 skipped
