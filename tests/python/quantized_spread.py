"""How far two runs of 8-bit-state steps may drift apart when their codes may round the other
way: the tolerance of test_quantized_moments_cuda.py (CUDA against the CPU), whose kernels
compute the same FP32 values but whose per-tensor coefficients come from each side's FP64 pow.

A moment one FP32 rounding apart may be coded one code apart. A code's step is not a fixed
fraction of its value: exp_avg's codes are square-root companded (stored value q|q| s / 127^2,
so one code more moves it by (2|q| + 1) s / 127^2: 300 % of a code 1, 1.6 % of a code 127) and
exp_avg_sq's are fourth roots (one code more moves v by ((q + 1)^4 - q^4) (s / 255)^4). The
next step's update m / (sqrt(v) + eps) moves with the stored values, and so do its new moments,
which may then be coded more than one code apart where their values are small (a one-code
difference at code 100, 201 units of s / 127^2, is 13 codes at a value near 0). So the spread
is followed in values, per element, through the steps:

  stored spread E (0 before the first step) -> new moments' spread beta1 E_m, beta2 E_v (SGD's
  buffer: momentum E) -> block scales' spread (the largest of |m|, v^(1/4), |buf| moves by at
  most the largest of its elements') -> next E: the new moments' spread plus one code step at
  each element's new code with its block scale widened by the scale's spread (each side rounds
  to its nearest code, each at most half a step away);

and each step's weight update moves by at most its extremes over the box of stored moments
+-E (m / (sqrt(v) + eps) is monotone in each), summed over the steps. The result is tight where
it must be: a block scale off by a few percent moves the moments and updates of the whole block
by that, beyond one code's spread (test_quantized_spread.py).
"""
import torch

from quantized_helpers import ref_dequantize as adam_values
from test_quantized_momentum import ref_dequantize as momentum_values

B = 32


def _further(codes):
    """Codes one step further from 0 (q + sign(q); 0 goes to 1): the farther neighbour of a
    code in exp_avg's format, and in exp_avg_sq's (unsigned)."""
    q = codes.reshape(-1).double()
    return q + torch.where(q < 0, -1.0, 1.0)


def block_largest(x):
    """The largest of each block of 32 elements."""
    return torch.nn.functional.pad(x, (0, (-x.numel()) % B)).view(-1, B).amax(1)


class StepSpread:
    """The spreads of one run of op steps (adam_step_ or sgd_step_ with an 8-bit state), kept
    per tensor in FP64: `weights` (summed over the steps), `scales` (of the last step, the
    scales' layout), and the stored state's."""

    def __init__(self, op, numels):
        self.adam = op == "adam_step_"
        self.stored = [[torch.zeros(n, dtype=torch.float64)] * (2 if self.adam else 1)
                       for n in numels]
        self.weights = [torch.zeros(n, dtype=torch.float64) for n in numels]
        self.scales = [None] * len(numels)
        self._new = [None] * len(numels)  # the new moments' spread, between before and after

    def before(self, i, codes, scales, grad, step_before, *, lr, **h):
        """Step i's tensor about to step from these codes and scales (on the CPU), grad as the
        update takes it (Adam: unscaled, maximize's sign and L2 decay applied; SGD: unused)."""
        if not self.adam:
            mom = h["momentum"]
            spread = mom * self.stored[i][0] if step_before else torch.zeros_like(
                self.weights[i])  # a first step sets the buffer to the gradient
            self.weights[i] += lr * spread * (mom if h["nesterov"] else 1.0)
            self._new[i] = [spread]
            return
        b1, b2, eps = h["beta1"], h["beta2"], h["eps"]
        m, v = adam_values(codes[0], codes[1], scales)
        dm, dv = b1 * self.stored[i][0], b2 * self.stored[i][1]
        g = grad.reshape(-1).double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        t = step_before + 1
        bias2 = (1 - b2 ** t) ** 0.5

        def update(m, v):
            return lr / (1 - b1 ** t) * m / (v.clamp(min=0).sqrt() / bias2 + eps)

        exact = update(m, v)
        self.weights[i] += torch.stack([(update(m + a * dm, v + c * dv) - exact).abs()
                                        for a in (-1, 1) for c in (-1, 1)]).amax(0)
        root = v.clamp(min=0) ** 0.25
        droot = torch.maximum((v + dv) ** 0.25 - root, root - (v - dv).clamp(min=0) ** 0.25)
        self._new[i] = [dm, dv, droot]

    def after(self, i, codes, scales):
        """Step i's tensor after the step, its new codes and scales (on the CPU)."""
        new = self._new[i]
        ds = torch.stack([block_largest(new[0])] + ([block_largest(new[2])] if self.adam
                                                    else []), 1)
        self.scales[i] = ds
        wide = scales.double().reshape(-1, ds.shape[1]) + ds
        if self.adam:
            far = adam_values(_further(codes[0]), codes[1].reshape(-1).double() + 1, wide)
            now = adam_values(codes[0], codes[1], scales)
            self.stored[i] = [new[0] + (far[0] - now[0]).abs(), new[1] + (far[1] - now[1])]
        else:
            far = momentum_values(_further(codes[0]), wide)
            self.stored[i] = [new[0] + (far - momentum_values(codes[0], scales)).abs()]


def assert_within(got, want, spread, rtol, atol, what):
    """|got - want| <= spread + rtol |want| + atol per element: the spread on top of the
    comparison's own rounding allowance."""
    got, want = got.double().reshape(-1), want.double().reshape(-1)
    allowed = spread.reshape(-1) + rtol * want.abs() + atol
    excess = (got - want).abs() - allowed
    if (excess > 0).any():
        worst = int(excess.argmax())
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} of {excess.numel()} elements beyond one "
            f"code's spread, e.g. element {worst}: {got[worst].item()} against "
            f"{want[worst].item()} (allowed {allowed[worst].item():.3g})")
