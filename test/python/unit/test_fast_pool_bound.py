"""The forward's fast-pooling check (``fast_pool_bound``) on a CPU model of both pooling paths.

The model runs the exact path as the kernel does (fp32 ``exp``, sequential sums, correctly
rounded weights and products) and the fast path with every exponential and the reciprocal off
by the largest error the hardware documents, in the direction that hurts. Wherever the check
passes, the two bf16 results must be at most one step apart; on windows that cancel, the
unchecked fast result must not be (so the check is what keeps the contract).
"""
import math

import pytest
import torch

from csa_frontend.compressor.kernels.fast_pool_bound import (FAST_EXP_ULPS, MAX_SPREAD, ULP, bound_coefficients,
                                                              fast_result_is_safe)


def windows(n, width, cancel, seed):
    """``n`` windows: scores with a random spread, kv ~ N(0, 1); with ``cancel`` the last kv
    makes each weighted sum (nearly) zero, as ``gpu.packs.cancel_windows`` does."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.rand(n, 1, generator=g) * 12
    s = (torch.rand(n, width, generator=g) * spread).float()
    kv = torch.randn(n, width, generator=g).bfloat16().float()
    if cancel and width > 1:
        p = torch.softmax(s.double(), dim=1)
        rest = (kv[:, :-1].double() * p[:, :-1]).sum(1)
        kv[:, -1] = (-rest / p[:, -1]).clamp(-8, 8).bfloat16().float()
    return s, kv


def fp32(x):
    return x.float()


def exact_path(s, kv):
    m = s.max(dim=1, keepdim=True).values
    e = torch.exp(s - m)
    den = e[:, 0].clone()
    for k in range(1, s.shape[1]):
        den = fp32(den + e[:, k])
    acc = None
    for k in range(s.shape[1]):
        term = fp32(kv[:, k] * fp32(e[:, k] / den))
        acc = term if acc is None else fp32(acc + term)
    return acc


def fast_path(s, kv, sign):
    """Worst-case fast pooling: exponentials off by the documented MUFU error plus the argument
    rounding (not the doubled margin the bound assumes), all in direction ``sign`` (+-1) on
    positions whose kv is positive and the other way elsewhere; the reciprocal off by one ulp."""
    m = s.max(dim=1, keepdim=True).values
    x = fp32(s - m)
    alpha = (FAST_EXP_ULPS[0] / 2 + FAST_EXP_ULPS[1] / 2 * x.abs()) * ULP
    direction = torch.where(kv >= 0, sign, -sign)
    e = fp32(torch.exp(x.double()) * (1 + direction * alpha))
    den = e[:, 0].clone()
    acc = fp32(kv[:, 0].double() * e[:, 0])
    mag = fp32(kv[:, 0].abs().double() * e[:, 0])
    for k in range(1, s.shape[1]):
        den = fp32(den + e[:, k])
        acc = fp32(kv[:, k].double() * e[:, k] + acc.double())
        mag = fp32(kv[:, k].abs().double() * e[:, k] + mag.double())
    rcp = fp32((1.0 / den.double()) * (1 - sign * ULP))
    out = fp32(acc.double() * rcp)
    return out, fp32(mag.double() * rcp), fp32(m.squeeze(1) - s.min(dim=1).values)


def bf16_steps_apart(a, b):
    """How many bf16 values lie between the roundings of ``a`` and ``b`` (plus one), per element."""
    ia = a.bfloat16().view(torch.int16).int()
    ib = b.bfloat16().view(torch.int16).int()
    # map the sign-magnitude bit patterns onto a monotone integer line
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs()


@pytest.mark.L0
@pytest.mark.parametrize("width", [1, 2, 4, 6, 8, 16])
@pytest.mark.parametrize("cancel", [False, True])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_safe_columns_round_within_one_step(width, cancel, sign):
    s, kv = windows(20000, width, cancel, seed=width * 7 + int(cancel))
    exact = exact_path(s, kv)
    fast, mag, spread = fast_path(s, kv, sign)
    safe = torch.tensor([fast_result_is_safe(o, b, x, width)
                         for o, b, x in zip(fast.tolist(), mag.tolist(), spread.tolist())])
    apart = bf16_steps_apart(fast, exact)
    assert int(apart[safe].max()) <= 1 if safe.any() else True
    if not cancel:
        assert safe.float().mean() > 0.95, "the check refuses most ordinary columns: no speed left"
    elif width > 1:
        # the check must matter: unchecked, cancelling columns land several steps away
        assert int(apart[~safe].max()) > 1


@pytest.mark.L0
def test_bound_coefficients_are_small_and_grow_with_the_window():
    c0_8, c1 = bound_coefficients(8)
    c0_16, _ = bound_coefficients(16)
    assert 0 < c0_8 < c0_16 < 1e-5 and 0 < c1 < 1e-6


@pytest.mark.L0
def test_non_finite_and_extreme_columns_are_refused():
    assert not fast_result_is_safe(math.nan, 1.0, 1.0, 8)
    assert not fast_result_is_safe(1.0, math.inf, 1.0, 8)
    assert not fast_result_is_safe(1.0, 1.0, math.nan, 8)
    assert not fast_result_is_safe(1.0, 1.0, MAX_SPREAD * 1.01, 8)
    assert not fast_result_is_safe(2.0 ** 127, 2.0 ** 127, 1.0, 8)
    assert not fast_result_is_safe(0.0, 0.0, 0.0, 8)
    assert fast_result_is_safe(0.5, 1.0, 3.0, 8)
