"""Online stream forward: one thread pools one output row for ``vec`` columns, walking the
window in chunks.

For stream-family windows short enough (``STREAM_FWD_ONLINE_WINDOW``) that one thread can walk
them whole. The thread reads each chunk of the schedule's ``chunk`` positions straight from
global memory (kv and score from DRAM, ape from L1), takes the chunk's max, and folds ``sum e``
and ``sum kv e`` into its running partials, rescaled by ``exp(m_old - m_new)`` only where the
max moved.
No shared memory, no barriers and no per-CTA pipeline: latency is hidden by resident warps, as
in a copy, where the CTA-per-rows pipeline (``stream_fwd``) waits on its staging and on one
barrier per row. Each half of a coff-2 window is one run of consecutive tokens of one column
slice (one validity test, one base address; positions are compile-time offsets).

Exponentials as the pipelined stream forward's (``exp_shifted``, ``STREAM_FAST_EXP``); results
differ from the reference by re-association and those exponentials only: the stream family's
tolerance contract (docs/csa_compressor.md), bitwise reproducible.

Grid: x over groups of the schedule's ``row_lanes`` output rows, y over column tiles
(``schedule._online_schedule``), as the register-window forward.
Padding rows (``row >= cu_seqlens_comp[-1]``) pool segment 0's first block.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from .common import (RowsForward, block_start, enter_grid, kv_and_score, padding_bound, padding_row, padding_row_exact,
                     row_start)
from .schedule import STREAM_FAST_EXP
from .stream_fwd import relative_sums, rescale_factor


class OnlineForward(RowsForward):
    family = "stream"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        assert self.sched.online

    @cute.kernel
    def kernel(self, mKV, mS, mApe, mCu, mCuC, mOut):
        enter_grid(self.pdl)
        vec, n_vec, ratio, coff = self.vec, self.n_vec, self.ratio, self.coff
        row, cv = self.row_and_slice()
        n_seg = mCu.shape[0] - 1
        if row < mOut.shape[0]:  # warp-uniform when warp_rows: the lookup may vote
            t0, blk = row_start(mCu, mCuC, n_seg, row, self.warp_rows, self.one_round_loads("fwd"))
            if cv < n_vec:
                rO = cute.make_rmem_tensor((vec,), Float32)
                padding = padding_row(padding_bound(mCuC, n_seg), row)
                if cutlass.const_expr(padding is not None):
                    if padding:
                        # a padding row: the reference's steps (every padding row pools the
                        # same window, so one column off would be off on all of them)
                        for v in cutlass.range_constexpr(vec):
                            rO[v] = padding_row_exact(mKV, mS, mApe, cv * vec + v, ratio, coff, self.head_dim)
                    else:
                        self.pool_online(mKV, mS, mApe, rO, t0, blk, cv)
                else:
                    self.pool_online(mKV, mS, mApe, rO, t0, blk, cv)
                gO = cute.zipped_divide(mOut, (1, vec))
                gO[(0, None), (row, cv)].store(rO.load().to(BFloat16))

    @cute.jit
    def pool_online(self, mKV, mS, mApe, rO, t0, blk, cv):
        """``rO`` <- block ``blk`` (first token ``t0``) of column slice ``cv``, walked online."""
        vec, n_vec, ratio, coff = self.vec, self.n_vec, self.ratio, self.coff
        own0, has_prev = block_start(t0, blk, ratio, mKV.shape[0])
        rM = cute.make_rmem_tensor((vec,), Float32)
        rD = cute.make_rmem_tensor((vec,), Float32)
        rA = cute.make_rmem_tensor((vec,), Float32)
        rM.fill(-Float32.inf)
        rD.fill(0.0)
        rA.fill(0.0)
        if cutlass.const_expr(coff == 2):
            # previous block, first-half columns (invalid for a segment's first block)
            if has_prev:
                online_run(mKV, mS, mApe, rM, rD, rA, own0 - ratio, cv, ratio, self.sched.chunk, vec, True)
            online_run(mKV, mS, mApe, rM, rD, rA, own0, cv + n_vec, ratio, self.sched.chunk, vec, False)
        else:
            online_run(mKV, mS, mApe, rM, rD, rA, own0, cv, ratio, self.sched.chunk, vec, True)
        for v in cutlass.range_constexpr(vec):
            rO[v] = rA[v] / rD[v]


@cute.jit
def online_run(mKV: cute.Tensor, mS: cute.Tensor, mApe: cute.Tensor, rM: cute.Tensor, rD: cute.Tensor,
               rA: cute.Tensor, tok: Int32, colt: Int32, run: cutlass.Constexpr, chunk: cutlass.Constexpr,
               vec: cutlass.Constexpr, first: cutlass.Constexpr):
    """Fold ``run`` window positions, tokens ``tok + i`` with ape rows ``i``, column slice
    ``colt``, into the running partials ``(rM, rD, rA)`` = (max, sum e, sum kv e), ``chunk``
    positions at a time. ``first``: the partials are still empty (no rescaling needed)."""
    gKV = cute.zipped_divide(cute.domain_offset((tok, 0), mKV), (1, vec))
    gS = cute.zipped_divide(cute.domain_offset((tok, 0), mS), (1, vec))
    gA = cute.zipped_divide(mApe, (1, vec))
    for c0 in cutlass.range_constexpr(0, run, chunk):
        n = min(chunk, run - c0)
        rS = cute.make_rmem_tensor((chunk, vec), Float32)
        rX = cute.make_rmem_tensor((chunk, vec), Float32)
        for i in cutlass.range_constexpr(n):
            kvv, scv = kv_and_score(gKV, gS, None, 0, 0, c0 + i, colt, vec)
            apv = gA[(0, None), (c0 + i, colt)].load()
            for v in cutlass.range_constexpr(vec):
                rS[i, v] = scv[v] + apv[v]
                rX[i, v] = kvv[v]
        for v in cutlass.range_constexpr(vec):
            mc = rS[0, v]
            for i in cutlass.range_constexpr(1, n):
                mc = cute.arch.fmax(mc, rS[i, v])
            m_new = cute.arch.fmax(rM[v], mc)
            d, a, ms_scaled = relative_sums(rS, rX, v, n, m_new, STREAM_FAST_EXP)
            if cutlass.const_expr(first and c0 == 0):
                rD[v] = d
                rA[v] = a
            else:
                f = rescale_factor(rM[v], m_new, ms_scaled, STREAM_FAST_EXP)
                rD[v] = rD[v] * f + d
                rA[v] = rA[v] * f + a
            rM[v] = m_new
