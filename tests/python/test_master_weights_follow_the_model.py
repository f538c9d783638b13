"""The model's weights are the truth: weights loaded or edited between steps (a snapshot, a
clamp, a pruning mask) reach the FP32 masters, unless adopt_param_edits=False asks the step to
keep its masters; after a scaled step .grad holds what the update used. Every test runs on
every device present."""
import copy

import pytest
import torch
from torch import nn

import fusedamp


# ---- the model's weights are the truth -------------------------------------------------------
def _fp16_model_and_grads(device, seed=0, steps=6):
    """An FP16 model with its grads for `steps` steps (fixed, so two runs see the same)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(device).half()
    grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(steps)]
    return model, grads


def _step_with(opt, model, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    opt.step()


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_loaded_snapshot_reaches_the_masters_bit_exactly(device, kind):
    """load_state_dict(snapshot) mid-training, then one step: the weights equal one step from
    the snapshot (the same optimizer state, masters set to the snapshot by hand)."""
    make = {"AdamW": lambda ps: fusedamp.optim.AdamW(ps, lr=0.05),
            "SGD": lambda ps: fusedamp.optim.SGD(ps, lr=0.05, momentum=0.9)}[kind]
    model, grads = _fp16_model_and_grads(device)
    opt = make(model.parameters())
    _step_with(opt, model, grads[0])
    snapshot = copy.deepcopy(model.state_dict())
    for g in grads[1:5]:
        _step_with(opt, model, g)
    reference_model = copy.deepcopy(model)
    reference_opt = make(reference_model.parameters())
    reference_opt.load_state_dict(opt.state_dict())
    for name, p in reference_model.named_parameters():  # a step from the snapshot starts here
        p.data.copy_(snapshot[name])
        reference_opt.state[p]["master_param"].copy_(snapshot[name].float())
    model.load_state_dict(snapshot)
    for name, p in model.named_parameters():  # the case the test is about: every weight edited
        rounded = opt.state[p]["master_param"].half()
        assert (rounded != p.detach()).float().mean() > 0.99, name
    _step_with(opt, model, grads[5])
    _step_with(reference_opt, reference_model, grads[5])
    for p, r in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(p.detach(), r.detach())
        assert torch.equal(opt.state[p]["master_param"], reference_opt.state[r]["master_param"])


def test_clamp_and_zero_edits_reach_the_masters(device):
    """WGAN-style clipping and a pruning mask applied to the FP16 weights between steps bound
    the masters (they once ran away from the clamp: |w| reached 1.53 with a 0.01 clamp)."""
    model, grads = _fp16_model_and_grads(device, steps=20)
    opt = fusedamp.optim.AdamW(model.parameters(), lr=0.05)
    first = next(model.parameters())
    pruned = torch.rand(first.shape, device=device) < 0.5
    lr, clip = 0.05, 0.01
    for g in grads:
        _step_with(opt, model, g)
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-clip, clip)
            first.masked_fill_(pruned, 0.0)
    for p in model.parameters():
        master = opt.state[p]["master_param"]
        # One AdamW step moves a weight by at most about lr (plus the decay).
        assert master.abs().max().item() <= clip + 1.01 * lr, master.abs().max().item()
    assert opt.state[first]["master_param"][pruned].abs().max().item() <= 1.01 * lr


def test_edit_adoption_off_keeps_the_masters(device):
    """adopt_param_edits=False: the step ignores the model's weights (the old behaviour, for
    those who write the weights only through the optimizer and want the 2 B/param back): zeroing
    the weights between steps changes nothing, bit for bit, against a run without the edit."""
    runs = []
    for edit in (True, False):
        model, grads = _fp16_model_and_grads(device, steps=3)
        opt = fusedamp.optim.AdamW(model.parameters(), lr=0.05, adopt_param_edits=False)
        _step_with(opt, model, grads[0])
        if edit:
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
        _step_with(opt, model, grads[1])
        runs.append([opt.state[p]["master_param"].clone() for p in model.parameters()] +
                    [p.detach().clone() for p in model.parameters()])
    for edited, untouched in zip(*runs):
        assert torch.equal(edited, untouched)


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("write_back", [True, False])
def test_scaled_step_leaves_unscaled_clipped_grads(device, clip, write_back):
    """After scaler.step(opt), .grad holds what the update used (grad / scale, clipped), as
    with torch's fused optimizers — or, with write_back_grads=False, the scaled grads."""
    model, grads = _fp16_model_and_grads(device, steps=1)
    opt = fusedamp.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=clip,
                               write_back_grads=write_back)
    scaler = fusedamp.GradScaler(device, init_scale=256.0)
    scaler.scale(torch.ones((), device=device))
    scaled = [g * 256 for g in grads[0]]
    for p, g in zip(model.parameters(), scaled):
        p.grad = g.clone()
    scaler.step(opt)
    unscaled = [g.float() / 256 for g in scaled]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in unscaled]))
    coef = min(1.0, clip / (norm.item() + 1e-6)) if clip else 1.0
    for p, g_scaled, g in zip(model.parameters(), scaled, unscaled):
        if write_back:
            torch.testing.assert_close(p.grad, (g * coef).half(), rtol=1e-3, atol=1e-6)
        else:
            assert torch.equal(p.grad, g_scaled)
