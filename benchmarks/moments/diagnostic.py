"""moment_formats.py's diagnostic: during the FP32 run of the first seed, at a few checkpoints,
the exact moments put through every format once and compared with the exact ones, with the
update direction the next step would take from them."""
from __future__ import annotations

from moments.formats import (BF16, BLOCKS, M_CODES, V_CODES, V_POWER, Storage, power,
                             pairs)
from moments.reference import BETAS, BOUND_MARGIN, adam_bound, adam_direction

# An error of half an Adam step in an element's update changes the step, not its last digits.
BAD_DIRECTION = 0.5


def _rel_rms(a, b):
    den = b.square().sum()
    return ((a - b).square().sum() / den).sqrt().item() if den > 0 else 0.0


FP16_MIN_NORMAL = 2.0 ** -14


def _subnormal_scales(y, block):
    """Share of the nonzero blocks of y >= 0 whose maximum is below FP16's smallest normal
    number: their FP16 scale has fewer than 11 significant bits, or is the smallest subnormal."""
    mx = y.view(-1, block).amax(1)
    nz = mx > 0
    return ((mx < FP16_MIN_NORMAL) & nz).sum().item() / max(1, nz.sum().item())


def _by_tensor(opt, mask, top=3):
    """The parameters holding the most elements of mask: [(name, count, share of the tensor)]."""
    counts = [(n, int(mask[o:o + k].sum().item()), k)
              for n, (o, k) in zip(opt.names, opt.segments)]
    counts = sorted((c for c in counts if c[1]), key=lambda c: -c[1])[:top]
    return [(n, c, c / k) for n, c, k in counts]


def diagnose(opt, storages):
    """Each storage applied to the exact stored moments of step t - 1, and the update direction
    of step t from them, against the exact one."""
    m, v, g, real, t = opt.m, opt.v, opt.g, opt.real, opt.t
    b1, b2 = BETAS
    d = adam_direction(b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g, t)
    n_real = real.sum().item()
    m_nz, v_nz = (m != 0) & real, (v > 0) & real
    g_zero = (g == 0) & real
    out = {"step": t - 1, "max_abs_direction_exact": d.abs().max().item(),
           "zero_gradient_share": g_zero.sum().item() / n_real}
    rows = {}
    for s in storages:
        mq, vq = s.store_m(m), s.store_v(v)
        dq = adam_direction(b1 * mq + (1 - b1) * g, b2 * vq + (1 - b2) * g * g, t)
        err = (dq - d).abs()
        bad = (err > BAD_DIRECTION) & real
        v_lost = (vq == 0) & v_nz
        n_bad = bad.sum().item()
        rows[s.key] = {
            # the blow-up's signature: v stored as 0, m not, and no gradient to refill v
            "bad_with_zero_gradient": (bad & g_zero).sum().item() / n_bad if n_bad else 0.0,
            "v_zeroed_by_tensor": _by_tensor(opt, v_lost),
            "bad_by_tensor": _by_tensor(opt, bad),
            "m_rel_rms": _rel_rms(mq, m), "v_rel_rms": _rel_rms(vq, v),
            "m_zeroed": ((mq == 0) & m_nz).sum().item() / max(1, m_nz.sum().item()),
            "v_zeroed": ((vq == 0) & v_nz).sum().item() / max(1, v_nz.sum().item()),
            "dir_rel_rms": _rel_rms(dq, d),
            "dir_bad": n_bad / n_real,
            "dir_out_of_bound": ((dq.abs() > BOUND_MARGIN * adam_bound(t)) & real).sum().item()
            / n_real,
            "max_abs_direction": dq.abs().max().item()}
        if s.block:
            if s.m in M_CODES and s.scale_of_m == "fp16":
                rows[s.key]["m_scale_subnormal"] = _subnormal_scales(m.abs(), s.block)
            if s.v in V_CODES and s.scale == "fp16":
                rows[s.key]["v_scale_subnormal"] = _subnormal_scales(
                    power(v, V_POWER[s.v]), s.block)
    out["formats"] = rows
    return out


def diagnostic_storages():
    out = [BF16]
    out += [Storage(c, "fp32", 32) for c in M_CODES]   # one moment quantized, the other exact:
    out += [Storage("fp32", c, 32) for c in V_CODES]   # whose error the direction error is
    for scale in ("bf16", "fp32"):  # and how much of it FP16's range for the scale causes
        out += [Storage(c, "fp32", 32, scale) for c in M_CODES]
        out += [Storage("fp32", c, 32, scale) for c in V_CODES]
    for b in BLOCKS:
        out += pairs(b)
    return out
