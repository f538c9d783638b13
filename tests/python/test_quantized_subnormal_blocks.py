"""What 8-bit first moments keep of FP32-subnormal blocks, as
docs/master_weights.md#fp32-subnormal-blocks states it: the stored m of one AdamW step from zero
state (m = (1 - beta1) g), decoded by the engine, against FP64's m. A block's step max|m| / 127^2
is FP32, subnormal for these blocks: they keep fewer bits than the format, the smallest none."""
import pytest
import torch

import fusedamp
from fusedamp import _C

# sigma of the gradients: the relative L2 error of the stored m that the docs give (for m's
# sigma, a tenth of it).
DOCUMENTED = {1.0: 0.0059, 1e-30: 0.0059, 1e-38: 0.0065, 1e-39: 0.029, 1e-40: 0.17,
              1e-41: 1.0}


def _stored_m(device, sigma):
    torch.manual_seed(0)
    g = (torch.randn(32 * 256, dtype=torch.float64) * sigma).float().to(device)
    p = torch.nn.Parameter(torch.zeros_like(g))
    opt = fusedamp.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), state_dtype=torch.int8)
    p.grad = g.clone()
    opt.step()
    state = {k: v.clone() for k, v in opt.state[p].items()}
    _, fp32 = _C.convert_param_state(p.detach().clone(), state, False, torch.float32)
    return g.double().cpu() * 0.1, fp32["exp_avg"].double().cpu(), fp32["exp_avg_sq"].cpu()


@pytest.mark.parametrize("sigma", DOCUMENTED)
def test_subnormal_blocks_keep_what_the_docs_say(device, sigma):
    want, got, v = _stored_m(device, sigma)
    error = ((got - want).norm() / want.norm()).item()
    assert abs(error - DOCUMENTED[sigma]) <= 0.1 * DOCUMENTED[sigma], error
    if sigma == 1e-41:  # every block's step rounds to 0
        assert (got == 0).all()
    if sigma <= 1e-30:  # (1 - beta2) g^2 underflows FP32: the update is lr m_hat / eps
        assert (v == 0).all()
