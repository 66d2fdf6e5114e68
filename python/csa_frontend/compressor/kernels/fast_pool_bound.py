"""When the register-window forward may keep its fast pooling: the error bound, pure Python.

Why a fast path at all: the exact pooling reproduces the reference's bits with libdevice
``expf`` (8 instructions per window value) and correctly rounded weights (3 more), and the
forward is bound by its issue rate (``benchmark/NOTES.md`` rows 55, 78). The fast path pools a
column as ``sum_k kv_k e_k / sum_k e_k`` with ``e_k = ex2.approx.ftz((s_k - max) * log2 e)``,
fused multiply-adds and one approximate reciprocal (about 9 instructions per value). Where the
weighted sum cancels, that moves ``out`` by several bf16 steps (NOTES row 2), so every column
also accumulates ``sum_k |kv_k| e_k`` and checks, from the bound below, that its fp32 result
lies closer to the exact path's than the bf16 spacing there. A column that cannot show it is
pooled again exactly (the same code as before, same bits); on random inputs that is a few
tenths of a percent of the columns.

The bound (``Q`` = the true softmax-weighted mean with exact ``e^x``, ``B / D`` =
``sum |kv_k| e^{x_k} / sum e^{x_k}``, ``u = 2**-24``, ``W`` positions, ``X`` = the spread
``max - min`` of the column's valid scores):

- fast: each ``e_k`` within ``alpha = (4 + 1.5 X)`` ulp of ``e^{x_k}`` (the MUFU's 2 ulp plus
  the rounding of ``x * log2 e``, ``0.61 |x|`` ulp, doubled for margin); the two sums of at most
  ``W`` roundings each (``gamma_W``); the reciprocal (1 ulp) and the product (``u``):
  ``|o_fast - Q| <= (B / D) (2 alpha + 2 gamma_W + ulp + u)``;
- exact: libdevice ``expf`` within ``beta = 4`` ulp (2 documented, doubled), the weights and
  products rounded once each, two sums: ``|o_exact - Q| <= (B / D) (2 beta + 2 gamma_W + 2u)``.

Their sum is ``K (B / D)`` with ``K = c0 + c1 X`` (``bound_coefficients``), inflated by
``1 + 2**-8`` for the second-order terms and for estimating ``B / D`` by the fast path's own
sums. If ``|o_fast - o_exact| < |o_fast| 2**-9 (1 - 2**-8)`` the two lie within the smallest
bf16 spacing between them, so their roundings are at most one step apart. Guards: ``X <= 80``
(every fast exponential of a valid position is then a normal number, so ``.ftz`` loses
nothing), ``|o_fast| < 2**127`` (no rounding to infinity), an absolute floor for products in the
subnormal range, and every comparison false on NaN, so non-finite columns take the exact path.
"""
from __future__ import annotations

#: fp32 ulp relative to the value it belongs to (upper bound) and the unit roundoff.
ULP = 2.0 ** -23
UNIT = 2.0 ** -24
#: ``ex2.approx.ftz(RN(x * log2 e))`` against ``e^x``: ``FAST_EXP_ULPS[0] + FAST_EXP_ULPS[1] * |x|``
#: ulp (twice what the MUFU's documented 2 ulp and the argument's rounding give).
FAST_EXP_ULPS = (4.0, 1.5)
#: libdevice ``expf`` against ``e^x`` (documented 2 ulp, doubled).
EXACT_EXP_ULPS = 4.0
#: Widest score spread a fast column accepts: ``e^-80 > 2**-126``, no flushed exponential.
MAX_SPREAD = 80.0
#: ``|o_fast|`` times this must exceed the error bound (the smallest bf16 spacing at
#: ``|o_fast| - bound`` is at least ``(|o_fast| - bound) 2**-9``).
SAFE_SCALE = 2.0 ** -9 * (1.0 - 2.0 ** -8)
#: Absolute term of the bound: products and sums in the subnormal range round absolutely.
ABS_FLOOR = 2.0 ** -120
#: Largest ``|o_fast|`` accepted: nothing near bf16's overflow threshold.
OUT_LIMIT = 2.0 ** 127
#: Inflation of the first-order bound (second-order terms, ``B / D`` estimated from fast sums).
SECOND_ORDER = 1.0 + 2.0 ** -8


def gamma(n: int) -> float:
    """Relative error bound of ``n`` chained fp32 roundings."""
    return n * UNIT / (1.0 - n * UNIT)


def bound_coefficients(width: int):
    """``(c0, c1)``: ``|o_fast - o_exact| <= (c0 + c1 * spread) * sum|kv| e / sum e`` for a
    window of ``width`` positions."""
    alpha0, alpha1 = FAST_EXP_ULPS
    c0 = (2 * alpha0 * ULP + 2 * EXACT_EXP_ULPS * ULP + 4 * gamma(width) + ULP + 3 * UNIT) * SECOND_ORDER
    c1 = 2 * alpha1 * ULP * SECOND_ORDER
    return c0, c1


def fast_result_is_safe(out_fast: float, magnitude: float, spread: float, width: int) -> bool:
    """The kernel's test in plain Python: ``magnitude`` is ``sum|kv| e / sum e`` of the fast
    path. False on any NaN (every comparison is)."""
    c0, c1 = bound_coefficients(width)
    bound = magnitude * (c0 + c1 * spread) + ABS_FLOOR
    a = abs(out_fast)
    return spread <= MAX_SPREAD and a * SAFE_SCALE > bound and a < OUT_LIMIT
