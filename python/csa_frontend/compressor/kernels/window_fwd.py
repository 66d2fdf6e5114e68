"""Register-window forward: one thread pools one output row for ``vec`` columns.

The whole window (``coff * ratio`` positions x ``vec`` columns of score+ape and kv) lives in
registers, so each input element is read from DRAM exactly once (every (token, column) belongs
to one window) and nothing intermediate touches memory.

Arithmetic, per column: first the checked fast pooling (``pool_fast``: MUFU exponentials, one
division ``sum_k kv_k e_k / sum_k e_k``, and an error bound, ``fast_pool_bound``), kept where the
bound shows it within one bf16 step of the exact result; elsewhere, and always with
``WINDOW_FWD_CHECKED`` off, the exact pooling (``pool_exact``: the reference's order, libdevice
``expf``, correctly rounded weights from one reciprocal and a two-FMA correction, pinned
products), which has the reference's bits. The fast result alone moved outputs near zero (where
the weighted sum cancels) by several bf16 steps (NOTES row 2); the check hands exactly those
columns to the exact path.

Grid: x over groups of ``row_lanes`` output rows, y over column tiles of ``col_threads``
vectors. Padding rows (``row >= cu_seqlens_comp[-1]``) pool segment 0's first block.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from .common import (LOG2E, RowsForward, add_in_order, block_start, div_exact, enter_grid, exp2_ftz, fma_rn,
                     load_window, mul_rn, padding_bound, padding_row, row_start, softmax_column)
from .fast_pool_bound import ABS_FLOOR, MAX_SPREAD, OUT_LIMIT, SAFE_SCALE, bound_coefficients
from .schedule import WINDOW_FWD_CHECKED


class WindowForward(RowsForward):
    family = "window"

    @cute.kernel
    def kernel(self, mKV, mS, mApe, mCu, mCuC, mOut):
        enter_grid(self.pdl)
        vec, n_vec, width = self.vec, self.n_vec, self.width
        row, cv = self.row_and_slice()
        n_seg = mCu.shape[0] - 1
        if row < mOut.shape[0]:  # warp-uniform when warp_rows: the lookup may vote
            t0, blk = row_start(mCu, mCuC, n_seg, row, self.warp_rows, self.one_round_loads("fwd"))
            if cv < n_vec:
                gA = cute.zipped_divide(mApe, (1, vec))
                rS = cute.make_rmem_tensor((width, vec), Float32)
                rX = cute.make_rmem_tensor((width, vec), Float32)
                own0, has_prev = block_start(t0, blk, self.ratio, mKV.shape[0])
                load_window(mKV, mS, gA, rS, rX, own0, has_prev, cv, self.ratio, self.coff, n_vec, vec)
                gO = cute.zipped_divide(mOut, (1, vec))
                pool_and_store(rS, rX, gO, row, cv, vec, width, self.ratio, self.coff, has_prev,
                               padding_row(padding_bound(mCuC, n_seg), row))


@cute.jit
def pool_and_store(rS: cute.Tensor, rX: cute.Tensor, gO: cute.Tensor, row: Int32, cv: Int32,
                   vec: cutlass.Constexpr, width: cutlass.Constexpr, ratio: cutlass.Constexpr,
                   coff: cutlass.Constexpr, has_prev: cutlass.Boolean, padding=None):
    """``out[row, cv*vec : cv*vec+vec]`` from a gathered window (``rS`` score + ape, ``rX`` kv),
    one bf16 rounding. Each column is pooled by the checked fast path (``pool_fast``) and,
    where it cannot prove its result within one bf16 step of the exact one, again exactly
    (``pool_exact``: the reference's order and bits). A ``padding`` row (``padding_row``) is
    pooled exactly: every padding row pools the same window, so one fast column one step off
    would be off on all of them (``EXACT_PADDING_ROWS``)."""
    rO = cute.make_rmem_tensor((vec,), Float32)
    for v in cutlass.range_constexpr(vec):
        if cutlass.const_expr(WINDOW_FWD_CHECKED):
            o, safe = pool_fast(rS, rX, v, width, ratio, coff, has_prev)
            if cutlass.const_expr(padding is not None):
                safe = safe and not padding
            if safe:
                rO[v] = o
            else:
                rO[v] = pool_exact(rS, rX, v, width)
        else:
            rO[v] = pool_exact(rS, rX, v, width)
    gO[(0, None), (row, cv)].store(rO.load().to(BFloat16))


@cute.jit
def pool_exact(rS: cute.Tensor, rX: cute.Tensor, v: cutlass.Constexpr, width: cutlass.Constexpr) -> Float32:
    """Column ``v``: the reference's softmax and left-to-right sum of pinned products
    (``rS`` is overwritten with the exponentials)."""
    den = softmax_column(rS, v, width)
    # div.rn, not rcp_of_den: its slow-path call keeps this rarely taken fallback a real branch;
    # without it ptxas predicated the whole exact path into every thread (r4 forwards 12-16%
    # slower on the H200, NOTES row 95)
    rcp = Float32(1.0) / den
    acc = Float32(0.0)
    for k in cutlass.range_constexpr(width):
        acc = add_in_order(acc, mul_rn(rX[k, v], div_exact(rS[k, v], den, rcp)), k == 0)
    return acc


@cute.jit
def pool_fast(rS: cute.Tensor, rX: cute.Tensor, v: cutlass.Constexpr, width: cutlass.Constexpr,
              ratio: cutlass.Constexpr, coff: cutlass.Constexpr, has_prev: cutlass.Boolean):
    """Column ``v`` as ``sum kv e / sum e`` with MUFU exponentials, and whether that result is
    provably within one bf16 step of ``pool_exact``'s (``fast_pool_bound``; the test is
    ``fast_result_is_safe``'s, which the CPU tests exercise on a model of both paths). Leaves ``rS`` and
    ``rX`` as they were. Invalid positions (coff 2 without a previous block: score -inf, kv 0)
    contribute exact zeros and stay out of the score spread."""
    c0, c1 = bound_coefficients(width)
    first_own = ratio if cutlass.const_expr(coff == 2) else 0
    m = rS[0, v]
    for k in cutlass.range_constexpr(1, width):
        m = cute.arch.fmax(m, rS[k, v])
    lo = rS[first_own, v]
    for k in cutlass.range_constexpr(first_own + 1, width):
        lo = cute.arch.fmin(lo, rS[k, v])
    if cutlass.const_expr(coff == 2):
        if has_prev:
            for k in cutlass.range_constexpr(ratio):
                lo = cute.arch.fmin(lo, rS[k, v])
    den = Float32(0.0)
    acc = Float32(0.0)
    mag = Float32(0.0)
    for k in cutlass.range_constexpr(width):
        e = exp2_ftz((rS[k, v] - m) * Float32(LOG2E))
        den = add_in_order(den, e, k == 0)
        acc = fma_rn(rX[k, v], e, acc)  # from 0: the first is a product rounded once
        mag = fma_rn(cute.math.absf(rX[k, v]), e, mag)
    rcp = cute.arch.rcp_approx(den)
    o = mul_rn(acc, rcp)
    spread = m - lo
    bound = mul_rn(mag, rcp) * (Float32(c0) + Float32(c1) * spread) + Float32(ABS_FLOOR)
    size = cute.math.absf(o)
    safe = (spread <= Float32(MAX_SPREAD)) & (size * Float32(SAFE_SCALE) > bound) & (size < Float32(OUT_LIMIT))
    return o, safe
