"""The comparison of test_quantized_moments_cuda.py (CUDA's 8-bit states against the CPU's,
within what one code of the state can move a step: quantized_spread.py), checked on the CPU
against runs that play the GPU's part: one whose stored codes are nudged by one before every
step must pass it, and moves its weights further than FP32 rounding (so a comparison without the
spread would fail on a correct GPU); one whose block scale is 5 % off must fail."""
import pytest
import torch

from quantized_spread import assert_within
from test_quantized_moments_cuda import BF16, F32, _weights, assert_matches_cpu, problem, run

SHAPES = [(1,), (33,), (1000,), (37, 29)]
CASES = [("adam_step_", "master", BF16), ("adam_step_", "none", F32),
         ("adam_step_", "split", BF16), ("sgd_step_", "master", BF16),
         ("sgd_step_", "none", F32)]


def nudged_codes(fraction, seed):
    """A between_steps for run(): about `fraction` of the codes one up or down (within their
    range)."""
    gen = torch.Generator().manual_seed(seed)

    def nudge(state, step):
        for key in ("exp_avgs", "exp_avg_sqs", "momentum_buffers"):
            for t in state.get(key, []):
                pick = (torch.rand(t.shape, generator=gen) < fraction).int()
                sign = torch.randint(0, 2, t.shape, generator=gen, dtype=torch.int32) * 2 - 1
                lo, hi = (-127, 127) if t.dtype == torch.int8 else (0, 255)
                t.copy_((t.int() + pick * sign).clamp(lo, hi).to(t.dtype))
    return nudge


def scaled_block(factor, step_at):
    """A between_steps for run(): before step `step_at`, the first block scale of the third
    tensor times factor."""
    def scale(state, step):
        if step == step_at:
            key = "moment_scales" if "moment_scales" in state else "momentum_scales"
            state[key][2][0].mul_(factor)
    return scale


def _problem(op, store, pdtype):
    return problem(store, pdtype, pdtype, SHAPES, seed=29, op=op)


@pytest.mark.parametrize("op,store,pdtype", CASES, ids=[f"{o[:-6]}-{s}" for o, s, _ in CASES])
def test_codes_one_apart_pass_and_need_the_spread(op, store, pdtype):
    state, grads, seeds = _problem(op, store, pdtype)
    reference = run("cpu", state, grads, seeds, 0, op=op)
    nudged = run("cpu", state, grads, seeds, 0, op=op, between_steps=nudged_codes(0.001, 7))
    assert_matches_cpu(nudged, reference, store, pdtype)
    a = torch.cat([t.reshape(-1) for t in _weights(nudged[0], store, pdtype)])
    b = torch.cat([t.reshape(-1) for t in _weights(reference[0], store, pdtype)])
    assert not torch.allclose(a, b, rtol=1e-5, atol=1e-6), "the nudges moved no weight"


@pytest.mark.parametrize("factor", [1.05, 0.95])
@pytest.mark.parametrize("op,store,pdtype", CASES, ids=[f"{o[:-6]}-{s}" for o, s, _ in CASES])
def test_a_wrong_block_scale_fails(op, store, pdtype, factor):
    """One block scale 5 % off before the last step: the comparison fails on the scales, and
    would on the weights alone (a 1-2 % error passes the weights and fails the scales)."""
    state, grads, seeds = _problem(op, store, pdtype)
    reference = run("cpu", state, grads, seeds, 0, op=op)
    wrong = run("cpu", state, grads, seeds, 0, op=op, between_steps=scaled_block(factor, 3))
    with pytest.raises(AssertionError, match="scales.*beyond one code's spread"):
        assert_matches_cpu(wrong, reference, store, pdtype)
    with pytest.raises(AssertionError, match="beyond one code's spread"):
        assert_within(_weights(wrong[0], store, pdtype)[2], _weights(reference[0], store,
                                                                     pdtype)[2],
                      reference[1].weights[2], rtol=1e-5, atol=1e-6, what="weights")
