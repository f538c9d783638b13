"""fusedamp.debug.precision_audit: per-module error of a low precision (alone and accumulated)
and time, worst first, with the modules to keep in FP32 as fusedamp.initialize takes them."""
import math
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import fusedamp  # noqa: E402
from debug_models import BasicBlock, tiny_gpt2  # noqa: E402


class Cancel(nn.Module):
    """(x + 4096) - 4096: exact in FP32 for |x| ~ 1, FP16 keeps multiples of 4 near 4096."""

    def forward(self, x):
        return (x + 4096.0) - 4096.0


class NaiveSoftmax(nn.Module):
    """exp(20 x) / sum(exp(20 x)) without subtracting the max: in FP16, exp overflows for
    x > 0.55 and the ratio is inf / inf = NaN; its output (in [0, 1]) is fine in FP32."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        e = torch.exp(20 * self.proj(x))
        return e / e.sum(-1, keepdim=True)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), NaiveSoftmax(),
                         nn.LayerNorm(16), Cancel(), nn.Linear(16, 4))


def test_overflow_and_cancellation_ranked_first():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    audit = fusedamp.debug.precision_audit(model, torch.randn(4, 8), dtype=torch.float16,
                                           repeats=2)
    names = [r["module"] for r in audit]
    assert sorted(names) == ["0", "1", "2", "2.proj", "3", "4", "5"]
    assert names[:2] == ["2", "4"]
    assert math.isinf(audit[0]["local_error"])
    assert 0.05 < audit[1]["local_error"] < math.inf
    assert audit.keep_fp32 == ["2", "4"]
    by_name = {r["module"]: r for r in audit}
    assert by_name["0"]["local_error"] < 2e-3   # a Linear in FP16: its own rounding only
    assert math.isinf(by_name["3"]["accumulated_error"])   # after the overflow, in a full run
    assert by_name["3"]["local_error"] < 1e-2
    assert all(r["time_fp32_ms"] > 0 and r["time_dtype_ms"] > 0 for r in audit)
    # the model is untouched, and initialize takes the suggestion
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.training
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = fusedamp.initialize(model, opt, dtype=torch.float16,
                                        keep_fp32=audit.keep_fp32)
    assert model[2].proj.weight.dtype == torch.float32
    assert model[0].weight.dtype == torch.float16


def test_bfloat16_has_no_overflow_and_norm_statistics_stay():
    model = nn.Sequential(BasicBlock(4), nn.Flatten(), nn.Linear(4 * 5 * 5, 3))
    stats = model[0].bn1.running_mean.clone()
    audit = fusedamp.debug.precision_audit(model, (torch.randn(2, 4, 5, 5),),
                                           dtype=torch.bfloat16, repeats=1)
    assert all(math.isfinite(r["local_error"]) for r in audit)
    assert [r["local_error"] for r in audit] == sorted((r["local_error"] for r in audit),
                                                       reverse=True)
    assert torch.equal(model[0].bn1.running_mean, stats)


def test_gpt2_keyword_inputs():
    model = tiny_gpt2()
    ids = torch.randint(0, 64, (2, 12))
    audit = fusedamp.debug.precision_audit(model, {"input_ids": ids, "use_cache": False},
                                           repeats=1)
    audited = {r["module"] for r in audit}
    # every module with code of its own that the forward called (the SDPA path skips
    # attn_dropout)
    assert audited <= {n for n, m in model.named_modules()
                       if n and not isinstance(m, (nn.ModuleList, nn.Sequential))}
    assert {"lm_head", "transformer.h.0.attn", "transformer.h.1.mlp.c_fc"} <= audited
    assert audit.keep_fp32 == [n for n in audit.keep_fp32
                               if not any(k.startswith(n + ".") for k in audit.keep_fp32)]
    assert all(r["accumulated_error"] >= 0 for r in audit)


def test_bad_input():
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        fusedamp.debug.precision_audit(_model(), torch.randn(2, 8), dtype=torch.float32)
    with pytest.raises(TypeError, match="nn.Module"):
        fusedamp.debug.precision_audit(lambda x: x, torch.randn(2, 8))
    with pytest.raises(ValueError, match="tolerance"):
        fusedamp.debug.precision_audit(_model(), torch.randn(2, 8), tolerance=0)
