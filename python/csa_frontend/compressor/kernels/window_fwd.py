"""Register-window forward: one thread pools one output row for ``vec`` columns.

The whole window (``coff * ratio`` positions x ``vec`` columns of score+ape and kv) lives in
registers, so each input element is read from DRAM exactly once (every (token, column) belongs
to one window) and nothing intermediate touches memory. Arithmetic follows the reference
order exactly (max, expf, left-to-right sum, correctly rounded weights ``e_k / den``,
left-to-right sum of pinned products), so ``out`` has the reference's bits. Dividing once,
``sum_k kv_k e_k / den``, was cheaper but moved outputs near zero (where the weighted sum
cancels) by several bf16 steps; the weights instead come from one reciprocal and a
two-FMA correction per position (``div_exact``).

Grid: x over groups of ``row_lanes`` output rows, y over column tiles of ``col_threads``
vectors. Padding rows (``row >= cu_seqlens_comp[-1]``) pool segment 0's first block.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from .common import (PoolingKernel, block_start, div_exact, enter_grid, load_window, mul_rn,
                     row_start, softmax_column)


class WindowForward(PoolingKernel):
    family = "window"

    @cute.jit
    def __call__(
        self,
        mKV: cute.Tensor,  # (T, coff*d) bf16
        mS: cute.Tensor,  # (T, coff*d) bf16
        mApe: cute.Tensor,  # (ratio, coff*d) fp32
        mCu: cute.Tensor,  # (B+1,) int32
        mCuC: cute.Tensor,  # (B+1,) int32
        mOut: cute.Tensor,  # (total_comp, d) bf16
        stream,
    ):
        n_rows = mOut.shape[0]
        lanes = self.sched.row_lanes
        self.kernel(mKV, mS, mApe, mCu, mCuC, mOut).launch(
            grid=((n_rows + lanes - 1) // lanes, self.sched.col_tiles, 1),
            block=(self.sched.threads, 1, 1),
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(self, mKV, mS, mApe, mCu, mCuC, mOut):
        enter_grid(self.pdl)
        vec, n_vec, width = self.vec, self.n_vec, self.width
        ct = self.sched.col_threads
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        cv = by * ct + tidx % ct
        row = bx * self.sched.row_lanes + tidx // ct
        n_seg = mCu.shape[0] - 1
        if row < mOut.shape[0]:  # warp-uniform when warp_rows: the lookup may vote
            t0, blk = row_start(mCu, mCuC, n_seg, row, self.warp_rows)
            if cv < n_vec:
                gA = cute.zipped_divide(mApe, (1, vec))
                rS = cute.make_rmem_tensor((width, vec), Float32)
                rX = cute.make_rmem_tensor((width, vec), Float32)
                own0, has_prev = block_start(t0, blk, self.ratio, mKV.shape[0])
                load_window(mKV, mS, gA, rS, rX, own0, has_prev, cv, self.ratio, self.coff, n_vec, vec)
                gO = cute.zipped_divide(mOut, (1, vec))
                pool_and_store(rS, rX, gO, row, cv, vec, width)


@cute.jit
def pool_and_store(rS: cute.Tensor, rX: cute.Tensor, gO: cute.Tensor, row: Int32, cv: Int32,
                   vec: cutlass.Constexpr, width: cutlass.Constexpr):
    """``out[row, cv*vec : cv*vec+vec]`` from a gathered window (``rS`` score + ape, ``rX`` kv):
    the reference's softmax and weighted sum, one bf16 rounding."""
    rO = cute.make_rmem_tensor((vec,), Float32)
    for v in cutlass.range_constexpr(vec):
        den = softmax_column(rS, v, width)
        rcp = Float32(1.0) / den
        acc = Float32(0.0)
        for k in cutlass.range_constexpr(width):
            term = mul_rn(rX[k, v], div_exact(rS[k, v], den, rcp))
            if cutlass.const_expr(k == 0):
                acc = term
            else:
                acc = acc + term
        rO[v] = acc
    gO[(0, None), (row, cv)].store(rO.load().to(BFloat16))
