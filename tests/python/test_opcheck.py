"""torch.library.opcheck on every operator: schema/mutation annotations, FakeTensor (Meta
kernels), functionalization and AOT dispatch."""
import pytest
import torch

from op_helpers import ops, randn_list, scalar


def _samples(device):
    p32 = randn_list(device, sizes=[(5,), (3, 4)], seed=30)
    p16 = [p.half() for p in p32]
    g16 = [torch.randn_like(p) for p in p16]

    def adam_state():
        return ([torch.zeros_like(p) for p in p32], [torch.zeros_like(p) for p in p32],
                [torch.zeros((), device=device) for _ in p32])

    m, v, st = adam_state()
    adam_kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                   decoupled_weight_decay=True, inv_scale=scalar(0.5, device),
                   found_inf=scalar(0.0, device), grad_sum_sq=scalar(4.0, device),
                   max_grad_norm=1.0, lr_tensor=scalar(1e-3, device))
    sgd_kw = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True)
    return {
        "unscale_and_check_": ((list(g16), scalar(0.0, device), scalar(0.5, device)), {}),
        "grad_stats_": ((list(g16), scalar(0.0, device), scalar(0.0, device)),
                        {"tensor_flags": torch.zeros(2, device=device)}),
        "update_scale_": ((scalar(8.0, device), torch.zeros(1, dtype=torch.int32, device=device),
                           torch.ones(1, dtype=torch.int32, device=device), scalar(1.0, device),
                           2.0, 0.5, 3), {"hysteresis": 1, "min_scale": 1.0}),
        "adam_step_": ((list(p16), [p.clone() for p in p32], list(g16), m, v, st), adam_kw),
        "sgd_step_": ((list(p16), [p.clone() for p in p32], list(g16),
                       [torch.zeros_like(p) for p in p32],
                       [torch.zeros((), device=device) for _ in p32]), sgd_kw),
    }


@pytest.mark.parametrize("name", ["unscale_and_check_", "grad_stats_", "update_scale_",
                                  "adam_step_", "sgd_step_"])
def test_opcheck(device, name):
    args, kwargs = _samples(device)[name]
    torch.library.opcheck(getattr(ops, name).default, args, kwargs)
