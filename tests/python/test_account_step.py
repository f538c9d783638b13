"""account_step_: what a master-weight optimizer records after a step (whether it was applied,
the skipped-step count, the loss scaler's flag, the gradient norm into a history ring), in one
op; and the optimizer's gradient-norm history that it writes, next to fusedamp.nonfinite_grads
(the parameters whose gradients are not finite) and the scaler's scale history."""
import math

import pytest
import torch

import fusedamp
import fusedamp.optim
from op_helpers import assert_bitwise_equal, ops, scalar, snapshot


def counters(device, skipped=5):
    return (torch.full((1,), -7.0, device=device),
            torch.full((1,), skipped, dtype=torch.int64, device=device))


@pytest.mark.parametrize("found", [0.0, 1.0, 2.0, float("nan"), -0.0])
def test_the_record_of_one_step_matches_torchs_ops(device, found):
    applied, skipped = counters(device)
    flag = scalar(found, device)
    flag_out = torch.full((), 3.0, device=device)  # 0-dim, as torch.amp's flags are
    sum_sq = scalar(12345.678, device)
    inv_scale = scalar(1.0 / 65536.0, device)
    norms = torch.full((4,), -1.0, device=device)
    ops.account_step_(applied, skipped, flag, flag_out, sum_sq, inv_scale, norms, 2)
    # The reference: the ATen ops the engine ran before this op existed.
    assert torch.equal(applied, torch.eq(flag, 0).float())
    assert torch.equal(skipped, 5 + torch.ne(flag, 0).long())
    assert torch.equal(flag_out.reshape(1), flag) or (found != found and flag_out.isnan())
    want = torch.sqrt(sum_sq) * inv_scale
    assert_bitwise_equal([want], [norms[2:3]])
    assert norms[[0, 1, 3]].eq(-1.0).all()  # the other slots are untouched


def test_an_unchecked_step_is_applied_and_not_counted(device):
    applied, skipped = counters(device)
    ops.account_step_(applied, skipped)
    assert applied.item() == 1.0 and skipped.item() == 5
    # Without inv_scale the norm is sqrt(sum_sq) itself.
    norms = torch.zeros(3, device=device)
    sum_sq = scalar(2.0, device)
    ops.account_step_(applied, skipped, grad_sum_sq=sum_sq, grad_norms=norms, grad_norm_slot=0)
    assert_bitwise_equal([torch.sqrt(sum_sq)], [norms[:1]])


def test_the_flag_may_be_its_own_output(device):
    applied, skipped = counters(device)
    flag = scalar(1.0, device)
    ops.account_step_(applied, skipped, flag, flag)
    assert flag.item() == 1.0 and applied.item() == 0.0 and skipped.item() == 6


def test_opcheck(device):
    applied, skipped = counters(device)
    args = (applied, skipped, scalar(1.0, device), torch.zeros((), device=device),
            scalar(9.0, device), scalar(0.5, device), torch.zeros(5, device=device), 4)
    torch.library.opcheck(ops.account_step_.default, args)
    torch.library.opcheck(ops.account_step_.default, counters(device))


def test_the_written_tensors_versions_are_bumped(device):
    applied, skipped = counters(device)
    flag_out, norms = torch.zeros((), device=device), torch.zeros(2, device=device)
    before = [t._version for t in (applied, skipped, flag_out, norms)]
    ops.account_step_(applied, skipped, scalar(0.0, device), flag_out, scalar(4.0, device),
                      None, norms, 1)
    after = [t._version for t in (applied, skipped, flag_out, norms)]
    assert all(a > b for a, b in zip(after, before)), (before, after)


def _bad_cases(device):
    """(what, keyword changes to a valid call, message fragment)."""
    return [
        ("int32 skipped_steps", dict(skipped_steps=torch.zeros(1, dtype=torch.int32,
                                                                device=device)),
         "skipped_steps"),
        ("float64 step_applied", dict(step_applied=torch.zeros(1, dtype=torch.float64,
                                                                device=device)),
         "step_applied"),
        ("two-element found_inf", dict(found_inf=torch.zeros(2, device=device)), "found_inf"),
        ("found_inf_out without found_inf", dict(found_inf=None),
         "found_inf_out is given without found_inf"),
        ("grad_norms without grad_sum_sq", dict(grad_sum_sq=None), "grad_norms needs grad_sum_sq"),
        ("grad_sum_sq without grad_norms", dict(grad_norms=None),
         "only make the norm written into grad_norms"),
        ("slot past the end", dict(grad_norm_slot=3), "grad_norm_slot 3 is outside grad_norms"),
        ("negative slot", dict(grad_norm_slot=-1), "grad_norm_slot -1 is outside"),
        ("2-D grad_norms", dict(grad_norms=torch.zeros(1, 3, device=device)),
         "contiguous 1-D tensor"),
        ("float16 grad_norms", dict(grad_norms=torch.zeros(3, dtype=torch.float16,
                                                            device=device)),
         "grad_norms must be float32"),
        ("found_inf on the meta device", dict(found_inf=torch.zeros(1, device="meta")),
         "found_inf"),
    ]


@pytest.mark.parametrize("case", range(11))
def test_bad_input_raises_and_changes_nothing(device, case):
    what, changes, message = _bad_cases(device)[case]
    applied, skipped = counters(device)
    call = dict(step_applied=applied, skipped_steps=skipped, found_inf=scalar(1.0, device),
                found_inf_out=torch.zeros(1, device=device), grad_sum_sq=scalar(4.0, device),
                inv_scale=scalar(0.5, device), grad_norms=torch.zeros(3, device=device),
                grad_norm_slot=1)
    written = [call[k] for k in ("step_applied", "skipped_steps", "found_inf_out", "grad_norms")]
    before = snapshot(written)
    call.update(changes)
    with pytest.raises(RuntimeError, match=message):
        ops.account_step_(**call)
    assert_bitwise_equal(before, snapshot(written)), what


def test_written_tensors_that_require_grad_are_refused_in_grad_mode(device):
    applied, skipped = counters(device)
    norms = torch.zeros(2, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="account_step_"):
        ops.account_step_(applied, skipped, grad_sum_sq=scalar(1.0, device), grad_norms=norms)
    assert applied.item() == -7.0


def test_the_history_keeps_the_last_norms_in_order_past_its_capacity(device):
    """More steps than the ring holds: the oldest are dropped, the rest come back oldest
    first, each the norm of its own step's gradient (the ring's wrap-around is where an
    off-by-one would show)."""
    capacity = fusedamp.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])._engine \
        .grad_norm_history_capacity()
    p = torch.nn.Parameter(torch.zeros(1, device=device))
    opt = fusedamp.optim.SGD([p], lr=0.0, max_grad_norm=1e30)  # clipping: a norm every step
    p.grad = torch.zeros(1, device=device)
    steps = capacity + 3
    values = torch.arange(steps, dtype=torch.float32, device=device)
    for i in range(steps):
        p.grad.copy_(values[i:i + 1])
        opt.step()
    history = opt.grad_norm_history()
    assert len(history) == capacity
    assert history[:3] == [3.0, 4.0, 5.0] and history[-1] == float(steps - 1)
    assert history == values[3:].tolist()
    assert opt._engine.grad_norm().item() == float(steps - 1)


def test_the_history_survives_a_param_group_added(device):
    """add_param_group rebuilds the engine; the norms recorded before are kept, as the
    skipped-step count is."""
    p = torch.nn.Parameter(torch.ones(3, device=device))
    q = torch.nn.Parameter(torch.ones(4, device=device))
    opt = fusedamp.optim.SGD([p], lr=0.0, max_grad_norm=1e30)
    p.grad = torch.full((3,), 2.0, device=device)
    opt.step()
    opt.add_param_group({"params": [q]})
    q.grad = torch.full((4,), 3.0, device=device)
    opt.step()
    assert opt.grad_norm_history() == pytest.approx([math.sqrt(12.0), math.sqrt(12.0 + 36.0)])
    assert opt._engine.grad_norm().item() == pytest.approx(math.sqrt(48.0))


def test_a_step_without_a_norm_pass_records_nothing(device):
    p = torch.nn.Parameter(torch.ones(3, device=device))
    # No clipping, no check, no scaler: no statistics pass, an unchecked step.
    opt = fusedamp.optim.AdamW([p], lr=1e-3, skip_nonfinite=False)
    p.grad = torch.ones(3, device=device)
    opt.step()
    assert opt.grad_norm_history() == []
    assert opt._engine.grad_norm() is None
    assert opt.last_step_applied.item() == 1.0 and opt.skipped_steps.item() == 0
    # A checked step after it records its norm and its flag.
    opt.param_groups[0]["skip_nonfinite"] = True
    p.grad = torch.tensor([3.0, 4.0, float("inf")], device=device)
    opt.step()
    assert opt.last_step_applied.item() == 0.0 and opt.skipped_steps.item() == 1
    assert opt.grad_norm_history() == [float("inf")]


def test_diagnostics_grad_norm_history_and_nonfinite_names(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = model.to(device)
    model, opt, scaler = fusedamp.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.float16, max_grad_norm=1.0)
    if not scaler.is_enabled():  # CUDA scaler asked for on a CPU-only machine: use the CPU one
        scaler = fusedamp.GradScaler(device)
    expected_norms, scales = [], []
    for step in range(6):
        x = torch.randn(32, 8, device=device)
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        s = scaler.get_scale()
        grads = [p.grad.float() / s for p in model.parameters()]
        expected_norms.append(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads])).item())
        if step == 4:
            model[2].weight.grad[1, 3] = float("nan")
            assert fusedamp.nonfinite_grads(model) == ["2.weight"]
        else:
            assert fusedamp.nonfinite_grads(model) == []
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    history = opt.grad_norm_history()
    assert len(history) == 6
    for i, (got, want) in enumerate(zip(history, expected_norms)):
        if i != 4:
            assert abs(got - want) <= 1e-3 * want, (i, got, want)
    assert history[4] != history[4]  # the NaN step's norm is NaN: visible in the history
    assert scaler.scale_history() == scales
    assert opt.skipped_steps.item() == 1


def test_a_history_records_values_not_their_autograd_graphs(device):
    """fusedamp.History (the scaler's scale history) detaches a value that requires grad and
    stores a plain one as it is: its ring never joins an autograd graph."""
    history = fusedamp.History(capacity=2)
    leaf = torch.tensor(3.0, device=device, requires_grad=True)
    history.record(leaf * 2)
    history.record(torch.tensor(5.0, device=device))
    history.record(torch.tensor(7.0, device=device))
    assert history.values() == [5.0, 7.0] and len(history) == 2
    assert not history._buf.requires_grad and history._buf.grad_fn is None
