"""Checkpoints: an optimizer's and a scaler's state_dict saved, loaded into fresh objects and
trained on gives the uninterrupted run bit for bit; loaded state is laid out as a first step
lays it out."""
import io

import pytest
import torch

import fusedamp
from op_helpers import _grads, _model_params


def _train(params, opt, scaler, steps, start, dtype):
    one = torch.ones((), device=params[0].device)
    for step in range(start, start + steps):
        scale = scaler.scale(one)  # what scaling a unit loss gives: the current scale
        for p, g in zip(params, _grads(params[0].device, dtype, step, scale=8.0)):
            p.grad = (g * scale).to(dtype)
        if step % 7 == 3:
            params[0].grad[0] = float("nan")
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("cls", ["AdamW", "SGD"])
def test_save_load_continue_is_bit_exact(device, cls):
    dtype = torch.float16
    kw = dict(momentum=0.9) if cls == "SGD" else {}

    def make(seed):
        ps = _model_params(device, dtype, seed=seed)
        opt = getattr(fusedamp.optim, cls)(ps, lr=1e-2, max_grad_norm=2.0, **kw)
        return ps, opt, fusedamp.GradScaler(device, init_scale=2.0 ** 8, growth_interval=4)

    p1, o1, s1 = make(6)
    _train(p1, o1, s1, 20, 0, dtype)
    p2, o2, s2 = make(6)
    _train(p2, o2, s2, 10, 0, dtype)
    buf = io.BytesIO()
    torch.save({"model": [p.detach() for p in p2], "opt": o2.state_dict(),
                "scaler": s2.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    p3, o3, s3 = make(123)  # different initial values: everything must come from the checkpoint
    with torch.no_grad():
        for p, q in zip(p3, ck["model"]):
            p.copy_(q)
    o3.load_state_dict(ck["opt"])
    s3.load_state_dict(ck["scaler"])
    _train(p3, o3, s3, 10, 10, dtype)
    for a, b in zip(p1, p3):
        assert torch.equal(a, b)
    for a, b in zip(p1, p3):
        sa, sb = o1._engine.param_state(a), o3._engine.param_state(b)
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    assert s1.get_scale() == s3.get_scale()
    assert s1.state_dict() == s3.state_dict()


def test_a_resumed_run_packs_small_state_and_continues_bit_exactly(device):
    """State loaded from a state dict (copied into the store) is packed as a first step's is: a
    resumed run walks the layout an uninterrupted one does, its state tensors each their own
    memory, and its steps are the uninterrupted run's, bit for bit."""
    def run(params, opt, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(device, torch.float16)
            opt.step()

    torch.manual_seed(3)
    first = [torch.nn.Parameter(torch.randn(n, device=device).half()) for n in (3, 5000)]
    opt = fusedamp.optim.AdamW(first, lr=1e-2)
    run(first, opt, 2, seed=1)
    saved = opt.state_dict()
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = fusedamp.optim.AdamW(resumed, lr=1e-2)
    opt2.load_state_dict(saved)
    small, large = resumed

    def storages(p):
        return {t.untyped_storage().data_ptr() for t in opt2.state[p].values()}
    assert len(storages(small)) == 1 and len(storages(large)) == 4
    # Each loaded tensor is its own memory: an edit of one moment changes no other state (on a
    # third optimizer loaded from the same dict, so that the runs below stay equal).
    spare = torch.nn.Parameter(first[0].detach().clone())
    opt3 = fusedamp.optim.AdamW([spare, torch.nn.Parameter(first[1].detach().clone())], lr=1e-2)
    opt3.load_state_dict(saved)
    before = {k: v.clone() for k, v in opt3.state[spare].items()}
    opt3.state[spare]["exp_avg"].fill_(7.0)
    for name in ("step", "master_param", "exp_avg_sq"):
        assert torch.equal(opt3.state[spare][name], before[name]), name
    run(first, opt, 3, seed=2)
    run(resumed, opt2, 3, seed=2)
    for a, b in zip(first, resumed):
        assert torch.equal(a, b)
    for a, b in zip(first, resumed):
        for name, t in opt.state[a].items():
            assert torch.equal(t, opt2.state[b][name]), name


def test_state_dict_names_the_state_dtype_and_the_name_is_taken_back(device):
    """A state dict's param groups hold state_dtype by name ("torch.bfloat16"):
    torch.distributed.checkpoint refuses torch.dtype values in them. An optimizer built from
    a saved group's options, or given the name, keeps the dtype; an unknown name is refused."""
    p = torch.nn.Parameter(torch.randn(4, device=device).bfloat16())
    opt = fusedamp.optim.AdamW([p], lr=1e-3, state_dtype=torch.bfloat16)
    saved = opt.state_dict()["param_groups"][0]
    assert saved["state_dtype"] == "torch.bfloat16"
    assert opt.param_groups[0]["state_dtype"] is torch.bfloat16  # the live group keeps the dtype
    options = {k: v for k, v in saved.items()
               if k not in ("params", "decoupled_weight_decay")}
    rebuilt = fusedamp.optim.AdamW([p], **options)
    assert rebuilt.param_groups[0]["state_dtype"] is torch.bfloat16
    assert fusedamp.optim.SGD([p], state_dtype="float32").param_groups[0]["state_dtype"] \
        is torch.float32
    with pytest.raises(ValueError, match="names no torch dtype"):
        fusedamp.optim.AdamW([p], state_dtype="torch.bfloat17")


# The consolidated checkpoint (consolidated_state_dict()) of fusedamp.distributed.
# ShardedOptimizer(params, "adamw", lr=1e-2) over nn.Linear(4, 2) in BF16 after two steps, and
# the weights it left: per-parameter state by index in fusedamp.optim's format, with the param
# groups of that class (fewer options than fusedamp.optim.AdamW's).
SHARDED_WEIGHTS = [
    torch.tensor([[-0.0228271484375, 0.27734375, -0.396484375, -0.38671875],
                  [-0.1728515625, 0.1513671875, -0.014404296875, 0.376953125]],
                 dtype=torch.bfloat16),
    torch.tensor([-0.0245361328125, 0.1513671875], dtype=torch.bfloat16)]
SHARDED_CHECKPOINT = {
    "state": {
        0: {"master_param": torch.tensor(
                [[-0.022828806191682816, 0.2774503231048584, -0.3955417573451996,
                  -0.3871261775493622],
                 [-0.17330174148082733, 0.1512928009033203, -0.01441001333296299,
                  0.37722957134246826]]),
            "exp_avg": torch.tensor(
                [[0.2045312523841858, 0.00039062544237822294, -0.18929199874401093,
                  0.11343750357627869],
                 [-0.1428515613079071, -0.14246094226837158, -0.11595703661441803,
                  0.11367187649011612]]),
            "exp_avg_sq": torch.tensor(
                [[0.0028021512553095818, 0.00015734291810076684, 0.0047161392867565155,
                  0.0007106885896064341],
                 [0.0013816370628774166, 0.001981233013793826, 0.0024841544218361378,
                  0.0008496860973536968]]),
            "step": torch.tensor(2.0)},
        1: {"master_param": torch.tensor([-0.024489767849445343, 0.1517615169286728]),
            "exp_avg": torch.tensor([-0.1678124964237213, -0.09263671934604645]),
            "exp_avg_sq": torch.tensor([0.0015795616200193763, 0.00047969879233278334]),
            "step": torch.tensor(2.0)}},
    "param_groups": [{"lr": 0.01, "weight_decay": 0.01, "maximize": False,
                      "master_weights": True, "state_dtype": torch.float32, "rounding_seed": 0,
                      "max_grad_norm": None, "betas": (0.9, 0.999), "eps": 1e-08,
                      "params": [0, 1]}]}


@pytest.mark.parametrize("kind", ["fusedamp.optim", "ZeroRedundancyOptimizer"])
def test_a_sharded_optimizer_checkpoint_loads(kind, request):
    """The sharded optimizer's consolidated checkpoints load into fusedamp.optim.AdamW and, on
    a process group, into fusedamp.distributed.ZeroRedundancyOptimizer (docs/distributed.md):
    the state is the checkpoint's bit for bit, its hyper-parameters replace the defaults, the
    options it does not name keep theirs, and the next step runs from it."""
    model = torch.nn.Linear(4, 2).bfloat16()
    with torch.no_grad():
        for p, w in zip(model.parameters(), SHARDED_WEIGHTS):
            p.copy_(w)
    if kind == "fusedamp.optim":
        opt = local = fusedamp.optim.AdamW(model.parameters(), lr=5.0)
    else:
        request.getfixturevalue("one_rank_process_group")
        opt = fusedamp.distributed.ZeroRedundancyOptimizer(model.parameters(), lr=5.0)
        local = opt.optim
    opt.load_state_dict(SHARDED_CHECKPOINT)
    params = list(model.parameters())
    for i, saved in SHARDED_CHECKPOINT["state"].items():
        state = local.state[params[i]]
        assert state.keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(state[name], value), (i, name)
    group = local.param_groups[0]
    assert group["lr"] == 0.01 and group["amsgrad"] is False
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert all(local.state[p]["step"].item() == 3.0 for p in params)
    assert not any(torch.equal(p, b) for p, b in zip(params, before))
