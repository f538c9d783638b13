"""On CUDA: unscale_and_check_ -> sgd_step_ -> update_scale_ captured in a CUDA graph and
replayed equals the same steps run eagerly (test_cuda_launches.py does the same for the Adam
step); every op runs on the current stream when that is not the default one."""
import pytest
import torch

from cuda_helpers import capture, sync_forbidden
from op_helpers import assert_bitwise_equal, needs_cuda, randn_list
from op_inputs import op_inputs


def assert_all_tensors_equal(a, b):
    """Every tensor of OpInputs a bit-identical to the same tensor of b."""
    for (name, x), (_, y) in zip(a.named_tensors(), b.named_tensors()):
        assert torch.equal(x, y), name


def sgd_graph_state(pdtype, master):
    sizes = [(1000,), (33, 17), (32769,), (5,)]
    return op_inputs("cuda", param_dtype=pdtype, master_weights=master, moments=False,
                     momentum=True, weights=randn_list("cpu", sizes=sizes, seed=52),
                     grads=[torch.zeros(s, dtype=pdtype) for s in sizes], loss_scale=2.0 ** 10,
                     scalars=dict(found_inf=0.0, inv_scale=1.0, lr_tensor=1e-2))


def sgd_graph_step(s):
    """One step after backward, all on the device: unscale the grads in place, SGD with
    momentum on the unscaled grads (skipped on overflow), update the loss scale."""
    s.found_inf.zero_()
    torch.reciprocal(s.scale, out=s.inv_scale)
    s.call("unscale_and_check_")
    s.call("sgd_step_", inv_scale=None, lr=0.0, momentum=0.9, dampening=0.0, weight_decay=1e-4,
           nesterov=False)
    s.call("update_scale_", growth_factor=2.0, backoff_factor=0.5, growth_interval=3)


@needs_cuda
@pytest.mark.parametrize("pdtype,master", [(torch.float16, True), (torch.bfloat16, True),
                                           (torch.float32, False)],
                         ids=["fp16-master", "bf16-master", "fp32"])
def test_sgd_and_unscale_in_a_cuda_graph_equal_eager(pdtype, master):
    """unscale_and_check_ -> sgd_step_ -> update_scale_ captured once and replayed ten times
    with new grads, a new lr and two overflowing steps: every tensor bit-identical to the same
    steps run eagerly (the ops read their scalars on the device, so the replay sees them)."""
    eager = sgd_graph_state(pdtype, master)
    graphed = eager.map(lambda _, t: t.clone())
    graph = capture(sgd_graph_step, eager.map(lambda _, t: t.clone()), graphed)

    gen = torch.Generator().manual_seed(53)
    for it in range(10):
        grads = [(torch.randn(g.shape, generator=gen) * 2.0 ** 10).to(pdtype)
                 for g in eager.grads]
        if it in (3, 4):
            grads[2].view(-1)[7] = float("inf")
        for s in (eager, graphed):
            for dst, src in zip(s.grads, grads):
                dst.copy_(src)
            s.lr_tensor.fill_(1e-2 * 0.9 ** it)
        with sync_forbidden():
            sgd_graph_step(eager)
        graph.replay()
    torch.cuda.synchronize()
    assert_all_tensors_equal(eager, graphed)
    assert all(s.item() == 8.0 for s in eager.steps)  # 10 steps, 2 skipped


STREAM_CALLS = {
    "unscale_and_check_": {},
    "grad_stats_": {},
    "update_scale_": dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=1),
    "adam_step_": dict(max_grad_norm=1.0),
    "sgd_step_": dict(momentum=0.9, max_grad_norm=1.0),
}
SLEEP_CYCLES = 1 << 30  # ~0.5 s on a ~2 GHz GPU: far longer than the host needs below


@needs_cuda
@pytest.mark.parametrize("op", list(STREAM_CALLS))
def test_op_runs_on_the_current_side_stream_and_matches_the_default_stream(op):
    """Called under torch.cuda.stream(side), every kernel of the op (follow-up kernels and
    workspaces included) must be enqueued on `side`: with `side` held busy by a sleep, nothing
    has changed once the default stream has drained. After `side` runs, every tensor equals
    the same call made on the default stream, bit for bit."""
    inp = op_inputs("cuda", [(1 << 20,), (33, 3), (5,)], param_dtype=torch.float16,
                    master_weights=True, momentum=True, loss_scale=2.0 ** 10,
                    scalars=dict(found_inf=0.0, grad_sum_sq=100.0, inv_scale=1 / 1024.0,
                                 lr_tensor=1e-3, tensor_flags=0.0))
    default_run = inp.map(lambda _, t: t.clone())
    default_run.call(op, **STREAM_CALLS[op])  # also loads the kernels before the timed part
    torch.cuda._sleep(1)
    before = [t.clone() for _, t in inp.named_tensors()]
    torch.cuda.synchronize()

    side, slept = torch.cuda.Stream(), torch.cuda.Event()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        slept.record()
        with sync_forbidden():  # a host sync here would wait out the sleep
            inp.call(op, **STREAM_CALLS[op])
    torch.cuda.current_stream().synchronize()
    early = [t.clone() for _, t in inp.named_tensors()]  # on the default stream
    torch.cuda.current_stream().synchronize()
    assert not slept.query(), "the side stream's sleep ended before the check: inconclusive"
    assert_bitwise_equal(before, early)

    side.synchronize()
    changed = [not torch.equal(a, b) for a, (_, b) in zip(before, inp.named_tensors())]
    assert any(changed), "the op changed nothing: the comparison below would prove nothing"
    assert_all_tensors_equal(inp, default_run)


@needs_cuda
def test_a_captured_scaler_step_writes_one_telemetry_row_per_replay():
    """scaler.step(opt) + scaler.update() captured once and replayed: each replay records the
    next telemetry row (the ring's position lives on the device), and the record, the scale and
    the weights equal the same iterations run eagerly, an overflowing one included."""
    import fusedamp

    def make():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(1000, device="cuda").to(torch.float16))
        opt = fusedamp.optim.SGD([p], lr=0.1)
        return p, opt, fusedamp.GradScaler("cuda", init_scale=2.0 ** 10, growth_interval=2)

    def iteration(scaler, opt):
        scaler.scale(torch.ones((), device="cuda"))  # an iteration starts with scale()
        scaler.step(opt)
        scaler.update()

    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(1000, generator=gen).to("cuda", torch.float16) for _ in range(8)]
    grads[4][17] = float("inf")
    p_eager, opt_eager, eager = make()
    p_graph, opt_graph, graphed = make()
    p_graph.grad = grads[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up iteration, off the capture stream
        iteration(graphed, opt_graph)
    torch.cuda.current_stream().wait_stream(side)
    p_eager.grad = grads[0].clone()
    iteration(eager, opt_eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        iteration(graphed, opt_graph)
    for g in grads[1:]:
        p_graph.grad.copy_(g)
        graph.replay()
        p_eager.grad = g.clone()
        iteration(eager, opt_eager)
    torch.cuda.synchronize()
    want, got = eager.telemetry(), graphed.telemetry()
    assert got["step"] == want["step"] == list(range(8))
    for key in ("scale", "found_inf", "amax", "underflow_fraction"):
        assert got[key] == want[key], key
    assert want["found_inf"][4] and graphed.get_scale() == eager.get_scale()
    assert torch.equal(p_graph, p_eager)


@needs_cuda
def test_a_captured_step_with_a_skip_aware_schedule_equals_eager():
    """opt.step() + sched.step() (fusedamp.lr_scheduler) captured once and replayed under a
    scaler: the schedule moves with the applied steps on the device, equal to eager, the
    overflowing iteration included."""
    import fusedamp

    def make():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(1000, device="cuda").to(torch.float16))
        opt = fusedamp.optim.AdamW([p], lr=1e-2)
        sched = fusedamp.lr_scheduler.WarmupCosine(opt, warmup_steps=2, total_steps=8)
        return p, opt, sched, fusedamp.GradScaler("cuda", init_scale=2.0 ** 10)

    def iteration(scaler, opt, sched):
        scaler.scale(torch.ones((), device="cuda"))
        scaler.step(opt)
        scaler.update()
        sched.step()

    gen = torch.Generator().manual_seed(9)
    grads = [torch.randn(1000, generator=gen).to("cuda", torch.float16) for _ in range(8)]
    grads[3][5] = float("inf")
    p_eager, opt_eager, sched_eager, eager = make()
    p_graph, opt_graph, sched_graph, graphed = make()
    p_graph.grad = grads[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        iteration(graphed, opt_graph, sched_graph)
    torch.cuda.current_stream().wait_stream(side)
    p_eager.grad = grads[0].clone()
    iteration(eager, opt_eager, sched_eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        iteration(graphed, opt_graph, sched_graph)
    for g in grads[1:]:
        p_graph.grad.copy_(g)
        graph.replay()
        p_eager.grad = g.clone()
        iteration(eager, opt_eager, sched_eager)
    torch.cuda.synchronize()
    assert float(sched_graph.applied_steps) == float(sched_eager.applied_steps) == 7.0
    assert torch.equal(opt_graph.param_groups[0]["lr"], opt_eager.param_groups[0]["lr"])
    assert torch.equal(p_graph, p_eager)


@needs_cuda
def test_a_captured_whole_training_step_equals_eager():
    """A whole training step -- forward, scaler.scale(loss).backward(), scaler.step, update and
    a skip-aware schedule -- captured once (torch's whole-network recipe: warm-up iterations on
    a side stream, gradients set to None so that the captured backward allocates them, static
    inputs refilled before each replay) and replayed over batches that include an overflowing
    one: weights, lr, applied steps and scale equal to the same iterations run eagerly."""
    import fusedamp

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                    torch.nn.Linear(64, 8)).to("cuda", torch.float16)
        opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3)
        sched = fusedamp.lr_scheduler.WarmupCosine(opt, warmup_steps=2, total_steps=12)
        return model, opt, sched, fusedamp.GradScaler("cuda", init_scale=2.0 ** 10)

    def iteration(run, x, y):
        model, opt, sched, scaler = run
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()

    gen = torch.Generator().manual_seed(4)
    batches = [(torch.randn(16, 32, generator=gen).to("cuda", torch.float16),
                torch.randn(16, 8, generator=gen).to("cuda")) for _ in range(10)]
    batches[6][1][0, 0] = 1e30  # the loss overflows: the step is skipped, the scale backs off
    eager, graphed = make(), make()
    for x, y in batches[:3]:
        eager[1].zero_grad(set_to_none=True)
        iteration(eager, x, y)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in batches[:3]:
            graphed[1].zero_grad(set_to_none=True)
            iteration(graphed, x, y)
    torch.cuda.current_stream().wait_stream(side)
    static_x, static_y = batches[3][0].clone(), batches[3][1].clone()
    graphed[1].zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), sync_forbidden():
        iteration(graphed, static_x, static_y)
    for x, y in batches[3:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        eager[1].zero_grad(set_to_none=True)
        iteration(eager, x, y)
    torch.cuda.synchronize()
    assert float(graphed[2].applied_steps) == float(eager[2].applied_steps) == 9.0
    assert graphed[3].get_scale() == eager[3].get_scale()
    assert torch.equal(graphed[1].param_groups[0]["lr"], eager[1].param_groups[0]["lr"])
    for a, b in zip(graphed[0].parameters(), eager[0].parameters(), strict=True):
        assert torch.equal(a, b)
