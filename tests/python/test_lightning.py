"""fusedamp.lightning.FusedAmpPrecision with pytorch-lightning's Trainer (and Fabric) on the CPU.

A tiny regression model trained for a few epochs: the plugin converts it (FP16/BF16, LayerNorm
FP32), rebuilds the torch.optim.AdamW that configure_optimizers returns as fusedamp's (with
its LR scheduler moved over), scales the loss, clips through max_grad_norm and checkpoints
the scaler; a resumed run continues bit for bit. The same training written by hand with
fusedamp.initialize is the reference for the Trainer's steps.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pl = pytest.importorskip("pytorch_lightning")

import fusedamp  # noqa: E402
from fusedamp.lightning import FusedAmpPrecision  # noqa: E402

N, BATCH, LR = 64, 16, 3e-2
INIT_SCALE = 2.0 ** 18  # overflows the FP16 gradients of the first steps: the scale backs off
STEPS_PER_EPOCH = N // BATCH


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.5
    return x, y


class Regressor(pl.LightningModule):
    """configure_optimizers returns plain torch.optim objects: the plugin does the rest."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))
        self.losses = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.losses.append(loss.detach().float())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=STEPS_PER_EPOCH, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()),
                                           batch_size=BATCH, shuffle=False)


def trainer(plugin, epochs, **kw):
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, plugins=[plugin],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, **kw)


def fit(epochs=6, plugin=None, **kw):
    plugin = plugin or FusedAmpPrecision("16-mixed", init_scale=INIT_SCALE, growth_interval=3)
    model = Regressor()
    t = trainer(plugin, epochs, **kw)
    t.fit(model)
    return model, t, plugin


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def run16():
    return fit()


def test_trains_with_fused_optimizer_and_scaler(run16):
    model, t, plugin = run16
    # The README's recipe ran: the model is converted, the optimizer is fusedamp's.
    assert model.net[0].weight.dtype == torch.float16
    assert model.net[1].weight.dtype == torch.float32  # LayerNorm stays FP32
    opt = t.optimizers[0]
    assert type(opt) is fusedamp.optim.AdamW
    g = opt.param_groups[0]
    assert (g["betas"], g["weight_decay"], g["initial_lr"]) == ((0.9, 0.99), 0.01, LR)
    state = opt.state[model.net[0].weight]
    assert state["master_param"].dtype == torch.float32  # FP32 master of the FP16 weight
    assert torch.equal(state["master_param"].half(), model.net[0].weight)
    # Loss scaling happened: INIT_SCALE overflows FP16 gradients, the scale backs off, then grows.
    telemetry = plugin.scaler.telemetry()
    carried = telemetry["scale"]  # each step's scale, before its update
    assert len(carried) == 6 * STEPS_PER_EPOCH and carried[0] == INIT_SCALE
    scales = carried[1:] + [plugin.scaler.get_scale()]  # the scale after each update
    assert scales[0] < INIT_SCALE and max(scales[1:]) > min(scales)
    skipped = int(opt.skipped_steps)
    assert skipped >= 1 and skipped == sum(s2 < s1 for s1, s2 in zip([INIT_SCALE] + scales, scales))
    assert skipped == sum(telemetry["skipped"])
    # It trained: the last epoch's loss is far below the first's.
    losses = torch.stack(model.losses).view(6, STEPS_PER_EPOCH).mean(1)
    assert losses[-1] < 0.25 * losses[0], losses


def test_lr_scheduler_drives_fused_optimizer(run16):
    model, t, _ = run16
    opt = t.optimizers[0]
    sched = t.lr_scheduler_configs[0].scheduler
    assert sched.optimizer is opt
    assert math.isclose(opt.param_groups[0]["lr"], LR * 0.7 ** 6, rel_tol=1e-12)


def test_matches_hand_written_fusedamp_loop(run16, record_diff):
    """The Trainer's step is the one fusedamp.initialize gives by hand: same scale sequence,
    same skipped steps, same weights."""
    model, t, plugin = run16
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.01)
    ref, opt, scaler = fusedamp.initialize(ref, opt, torch.float16, init_scale=INIT_SCALE,
                                           growth_interval=3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=STEPS_PER_EPOCH, gamma=0.7)
    x, y = data()
    for _ in range(6):
        for i in range(0, N, BATCH):
            loss = F.mse_loss(ref(x[i:i + BATCH]), y[i:i + BATCH])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            sched.step()
    assert scaler.telemetry()["scale"] == plugin.scaler.telemetry()["scale"]
    assert scaler.get_scale() == plugin.scaler.get_scale()
    diff = max((a.float() - b.float()).abs().max().item()
               for a, b in zip(model.net.parameters(), ref.parameters()))
    record_diff("lightning: Trainer vs hand-written fusedamp loop (params)", diff)
    assert diff == 0.0


def test_gradient_clip_val_maps_to_max_grad_norm():
    clipped, t, clipped_plugin = fit(epochs=2, gradient_clip_val=0.05)
    assert all(g["max_grad_norm"] == 0.05 for g in t.optimizers[0].param_groups)
    by_plugin, t2, _ = fit(epochs=2, plugin=FusedAmpPrecision(
        "16-mixed", max_grad_norm=0.05, init_scale=INIT_SCALE, growth_interval=3))
    free, _, _ = fit(epochs=2)
    for a, b in zip(params_of(clipped), params_of(by_plugin)):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(params_of(clipped), params_of(free)))
    # The norm the step clipped by is the unscaled global one.
    norms = clipped_plugin.scaler.telemetry()["grad_norm"]
    assert len(norms) == 2 * STEPS_PER_EPOCH and all(n > 0.05 for n in norms if math.isfinite(n))


def test_value_clipping_is_refused():
    with pytest.raises(ValueError, match="gradient_clip_algorithm='value' is not supported"):
        fit(epochs=1, gradient_clip_val=0.5, gradient_clip_algorithm="value")


def test_bf16_mixed_trains_without_loss_scaling():
    model, t, plugin = fit(epochs=4, plugin=FusedAmpPrecision("bf16-mixed"))
    assert model.net[0].weight.dtype == torch.bfloat16
    assert not plugin.scaler.is_enabled() and plugin.state_dict() == {}
    assert int(t.optimizers[0].skipped_steps) == 0
    losses = torch.stack(model.losses).view(4, STEPS_PER_EPOCH).mean(1)
    assert losses[-1] < 0.5 * losses[0], losses


def test_checkpoint_resume_is_bit_exact(tmp_path):
    """4 epochs in one go, and 2 epochs + Lightning checkpoint + 2 more in a fresh Trainer,
    model and plugin: identical weights, optimizer state (master weights, moments, skipped
    steps), LR and loss scale."""
    def plugin():
        return FusedAmpPrecision("16-mixed", init_scale=INIT_SCALE, growth_interval=3)

    full_model, full_t, full_plugin = fit(epochs=4, plugin=plugin(), gradient_clip_val=1.0)
    half_model, half_t, _ = fit(epochs=2, plugin=plugin(), gradient_clip_val=1.0)
    ckpt = str(tmp_path / "half.ckpt")
    half_t.save_checkpoint(ckpt)
    resumed_plugin = plugin()
    resumed = Regressor(seed=1)  # other weights: the checkpoint must bring them all
    t = trainer(resumed_plugin, 4, gradient_clip_val=1.0)
    t.fit(resumed, ckpt_path=ckpt)
    for a, b in zip(params_of(full_model), params_of(resumed)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    sa, sb = full_t.optimizers[0].state_dict(), t.optimizers[0].state_dict()
    for i, s in sa["state"].items():
        for name, v in s.items():
            assert torch.equal(v, sb["state"][i][name]), (i, name)
    assert torch.equal(sa["skipped_steps"], sb["skipped_steps"])
    assert sa["param_groups"][0]["lr"] == sb["param_groups"][0]["lr"]
    assert full_plugin.state_dict() == resumed_plugin.state_dict()
    assert full_plugin.scaler.telemetry()["scale"][2 * STEPS_PER_EPOCH:] == \
        resumed_plugin.scaler.telemetry()["scale"]


def test_unsupported_optimizer_is_named():
    class WithRMSprop(Regressor):
        def configure_optimizers(self):
            return torch.optim.RMSprop(self.parameters())

    with pytest.raises(TypeError, match="unsupported optimizer RMSprop"):
        trainer(FusedAmpPrecision("16-mixed"), 1).fit(WithRMSprop())


def test_fabric():
    """Fabric: the plugin converts the module and scales/steps; the optimizer is fusedamp's,
    created by the user (Fabric has no hook to replace it)."""
    from lightning_fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1,
                    plugins=[FusedAmpPrecision("16-mixed", init_scale=INIT_SCALE,
                                               growth_interval=3)])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))
    opt = fusedamp.optim.AdamW(model.parameters(), lr=LR, max_grad_norm=1.0)
    model, opt = fabric.setup(model, opt)
    x, y = data()
    losses = []
    for _ in range(6):
        for i in range(0, N, BATCH):
            loss = F.mse_loss(model(x[i:i + BATCH]), y[i:i + BATCH])
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert model.module[0].weight.dtype == torch.float16
    assert int(opt.optimizer.skipped_steps) >= 1
    assert sum(losses[-4:]) < 0.25 * sum(losses[:4])


def test_bf16_mixed_with_split_master_weights_and_bf16_moments():
    """The 16-bit weight stores through the plugin: the Trainer's optimizer keeps int16
    remainders and BF16 moments and trains; a mode that needs BF16 weights is refused with
    '16-mixed' before anything is built."""
    plugin = FusedAmpPrecision("bf16-mixed", master_weights="split", state_dtype=torch.bfloat16)
    model, t, _ = fit(epochs=4, plugin=plugin)
    state = t.optimizers[0].state[model.net[0].weight]
    assert state["param_remainder"].dtype == torch.int16 and "master_param" not in state
    assert state["exp_avg"].dtype == torch.bfloat16
    losses = torch.stack(model.losses).view(4, STEPS_PER_EPOCH).mean(1)
    assert losses[-1] < 0.5 * losses[0], losses
    for mode in ("split", "stochastic"):
        with pytest.raises(ValueError, match="keeps bfloat16 weights; use precision='bf16-mixed'"):
            FusedAmpPrecision("16-mixed", master_weights=mode)


def test_skip_aware_lr_counts_only_the_applied_steps():
    """FusedAmpPrecision(skip_aware_lr=True): configure_optimizers' StepLR becomes fusedamp's,
    which moves with the applied steps only (INIT_SCALE makes the first steps overflow)."""
    plugin = FusedAmpPrecision("16-mixed", init_scale=INIT_SCALE, growth_interval=3,
                               skip_aware_lr=True)
    model, t, plugin = fit(epochs=2, plugin=plugin)
    opt = t.optimizers[0]
    sched = t.lr_scheduler_configs[0].scheduler
    assert isinstance(sched, fusedamp.lr_scheduler.StepLR) and sched.optimizer is opt
    skipped = int(opt.skipped_steps)
    applied = 2 * STEPS_PER_EPOCH - skipped
    assert skipped >= 1 and float(sched.applied_steps) == applied
    want = LR * 0.7 ** (applied // STEPS_PER_EPOCH)
    assert math.isclose(float(opt.param_groups[0]["lr"]), want, rel_tol=1e-6)
