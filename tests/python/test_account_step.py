"""account_step_: what a master-weight optimizer records after a step (whether it was applied,
the skipped-step count, the loss scaler's flag, the step's unscaled gradient norm), in one op;
and the norm the optimizer keeps of its last step, next to fusedamp.nonfinite_grads (the
parameters whose gradients are not finite) and the scaler's telemetry, the record of a run."""
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
    norm = torch.full((1,), -1.0, device=device)
    ops.account_step_(applied, skipped, flag, flag_out, sum_sq, inv_scale, norm)
    # The reference: the ATen ops the engine ran before this op existed.
    assert torch.equal(applied, torch.eq(flag, 0).float())
    assert torch.equal(skipped, 5 + torch.ne(flag, 0).long())
    assert torch.equal(flag_out.reshape(1), flag) or (found != found and flag_out.isnan())
    want = torch.sqrt(sum_sq) * inv_scale
    assert_bitwise_equal([want], [norm])


def test_an_unchecked_step_is_applied_and_not_counted(device):
    applied, skipped = counters(device)
    ops.account_step_(applied, skipped)
    assert applied.item() == 1.0 and skipped.item() == 5
    # Without inv_scale the norm is sqrt(sum_sq) itself; a 0-dim output takes it as well.
    norm = torch.zeros((), device=device)
    sum_sq = scalar(2.0, device)
    ops.account_step_(applied, skipped, grad_sum_sq=sum_sq, grad_norm=norm)
    assert_bitwise_equal([torch.sqrt(sum_sq)], [norm.reshape(1)])


def test_the_flag_may_be_its_own_output(device):
    applied, skipped = counters(device)
    flag = scalar(1.0, device)
    ops.account_step_(applied, skipped, flag, flag)
    assert flag.item() == 1.0 and applied.item() == 0.0 and skipped.item() == 6


def test_opcheck(device):
    applied, skipped = counters(device)
    args = (applied, skipped, scalar(1.0, device), torch.zeros((), device=device),
            scalar(9.0, device), scalar(0.5, device), torch.zeros(1, device=device))
    torch.library.opcheck(ops.account_step_.default, args)
    torch.library.opcheck(ops.account_step_.default, counters(device))


def test_the_written_tensors_versions_are_bumped(device):
    applied, skipped = counters(device)
    flag_out, norm = torch.zeros((), device=device), torch.zeros(1, device=device)
    before = [t._version for t in (applied, skipped, flag_out, norm)]
    ops.account_step_(applied, skipped, scalar(0.0, device), flag_out, scalar(4.0, device),
                      None, norm)
    after = [t._version for t in (applied, skipped, flag_out, norm)]
    assert all(a > b for a, b in zip(after, before)), (before, after)


def _bad_cases(device):
    """(what, keyword changes to a valid call, message fragment)."""
    def zeros(n, dtype=torch.float32, on=device):
        return torch.zeros(n, dtype=dtype, device=on)

    wrong_dtypes = [("skipped_steps", torch.int32, "skipped_steps"),
                    ("step_applied", torch.float64, "step_applied"),
                    ("grad_norm", torch.float16, "grad_norm must be Float, got Half"),
                    ("grad_norm", torch.float64, "grad_norm must be Float, got Double")]
    cases = [(f"{dtype} {name}", {name: zeros(1, dtype)}, message)
             for name, dtype, message in wrong_dtypes]
    return cases + [
        ("two-element found_inf", dict(found_inf=zeros(2)), "found_inf"),
        ("found_inf_out without found_inf", dict(found_inf=None),
         "found_inf_out is given without found_inf"),
        ("grad_norm without grad_sum_sq", dict(grad_sum_sq=None),
         r"grad_norm needs grad_sum_sq \(the sum of squares from grad_stats_\)"),
        ("grad_sum_sq without grad_norm", dict(grad_norm=None),
         "grad_sum_sq and inv_scale only make the norm written into grad_norm, which is not "
         "given"),
        ("inv_scale without grad_norm", dict(grad_norm=None, grad_sum_sq=None),
         "only make the norm written into grad_norm"),
        ("three-element grad_norm", dict(grad_norm=zeros(3)),
         "grad_norm must have exactly one element, got 3"),
        ("empty grad_norm", dict(grad_norm=zeros(0)),
         "grad_norm must have exactly one element, got 0"),
        ("grad_norm on the meta device", dict(grad_norm=zeros(1, on="meta")),
         "grad_norm is on meta but the other tensors are on"),
        ("found_inf on the meta device", dict(found_inf=zeros(1, on="meta")), "found_inf"),
    ]


@pytest.mark.parametrize("case", range(13))
def test_bad_input_raises_and_changes_nothing(device, case):
    what, changes, message = _bad_cases(device)[case]
    applied, skipped = counters(device)
    call = dict(step_applied=applied, skipped_steps=skipped, found_inf=scalar(1.0, device),
                found_inf_out=torch.zeros(1, device=device), grad_sum_sq=scalar(4.0, device),
                inv_scale=scalar(0.5, device), grad_norm=torch.full((1,), -1.0, device=device))
    written = [call[k] for k in ("step_applied", "skipped_steps", "found_inf_out", "grad_norm")]
    before = snapshot(written)
    call.update(changes)
    with pytest.raises(RuntimeError, match=message):
        ops.account_step_(**call)
    assert_bitwise_equal(before, snapshot(written)), what


def test_written_tensors_that_require_grad_are_refused_in_grad_mode(device):
    applied, skipped = counters(device)
    norm = torch.zeros(1, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="account_step_"):
        ops.account_step_(applied, skipped, grad_sum_sq=scalar(1.0, device), grad_norm=norm)
    assert applied.item() == -7.0


def test_each_step_writes_its_own_norm(device):
    """The optimizer keeps the norm of its last step (account_step_'s grad_norm), each step
    its own gradient's, as a tensor of its own: the next step does not write into a norm
    already handed out."""
    p = torch.nn.Parameter(torch.zeros(1, device=device))
    opt = fusedamp.optim.SGD([p], lr=0.0, max_grad_norm=1e30)  # clipping: a norm every step
    p.grad = torch.zeros(1, device=device)
    values = torch.arange(7, dtype=torch.float32, device=device)
    handed_out = []
    for i in range(len(values)):
        p.grad.copy_(values[i:i + 1])
        opt.step()
        handed_out.append(opt._engine.grad_norm())
        assert handed_out[-1].item() == values[i].item()
    assert torch.cat(handed_out).tolist() == values.tolist()


def test_a_rebuilt_engine_goes_on_with_the_telemetry(device):
    """add_param_group rebuilds the engine; the run's record is the scaler's telemetry, which
    a rebuild does not touch: the norms of the steps before it are kept, as the skipped-step
    count is."""
    p = torch.nn.Parameter(torch.ones(3, device=device))
    q = torch.nn.Parameter(torch.ones(4, device=device))
    opt = fusedamp.optim.SGD([p], lr=0.0, max_grad_norm=1e30)
    scaler = fusedamp.GradScaler(device, init_scale=4.0)
    scaler.scale(torch.ones((), device=device))
    p.grad = torch.full((3,), 4.0 * 2.0, device=device)
    scaler.step(opt)
    scaler.update()
    opt.add_param_group({"params": [q]})
    scaler.scale(torch.ones((), device=device))
    p.grad = torch.full((3,), 4.0 * 2.0, device=device)  # the step left it unscaled
    q.grad = torch.full((4,), 4.0 * 3.0, device=device)
    scaler.step(opt)
    scaler.update()
    assert scaler.telemetry()["grad_norm"] == pytest.approx(
        [math.sqrt(12.0), math.sqrt(12.0 + 36.0)])
    assert opt._engine.grad_norm().item() == pytest.approx(math.sqrt(48.0))


def test_a_step_without_a_norm_pass_has_no_norm(device):
    p = torch.nn.Parameter(torch.ones(3, device=device))
    # No clipping, no check, no scaler: no statistics pass, an unchecked step.
    opt = fusedamp.optim.AdamW([p], lr=1e-3, skip_nonfinite=False)
    p.grad = torch.ones(3, device=device)
    opt.step()
    assert opt._engine.grad_norm() is None
    assert opt.last_step_applied.item() == 1.0 and opt.skipped_steps.item() == 0
    # A checked step after it has its norm and its flag.
    opt.param_groups[0]["skip_nonfinite"] = True
    p.grad = torch.tensor([3.0, 4.0, float("inf")], device=device)
    opt.step()
    assert opt.last_step_applied.item() == 0.0 and opt.skipped_steps.item() == 1
    assert opt._engine.grad_norm().item() == float("inf")


def test_diagnostics_telemetry_norms_and_nonfinite_names(device):
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
        step_norm = opt._engine.grad_norm().item()
        if step != 4:
            assert abs(step_norm - expected_norms[-1]) <= 1e-3 * expected_norms[-1], step
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    telemetry = scaler.telemetry(model)
    norms = telemetry["grad_norm"]
    assert len(norms) == 6
    for i, (got, want) in enumerate(zip(norms, expected_norms)):
        if i != 4:
            assert abs(got - want) <= 1e-3 * want, (i, got, want)
    assert norms[4] != norms[4]  # the NaN step's norm is NaN: visible in the record
    assert telemetry["first_nonfinite"][4] == "2.weight"
    # Each iteration carried the scale the update before it left.
    assert telemetry["scale"][1:] == scales[:-1] and scaler.get_scale() == scales[-1]
    assert opt.skipped_steps.item() == 1
