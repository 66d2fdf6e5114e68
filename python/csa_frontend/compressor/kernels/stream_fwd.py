"""Stream-family forward: a CTA pools rows one at a time, each row's window split in chunks.

For windows too wide for one thread's registers (large ratio). Thread ``(c, col)`` loads
window positions ``[c*chunk, (c+1)*chunk)`` of column slice ``col`` once (every input element
is read from DRAM exactly once). The arithmetic follows the reference's structure: the
window max (exact), ``e = exp(s - max)``, ``den`` as chunk sums combined in chunk order,
weights ``e / den`` correctly rounded, and the weighted sum as chunk sums combined in chunk
order. It differs from the reference only by re-association at chunk boundaries, and is
bitwise reproducible (fixed orders, no atomics).

Grid: x over groups of ``rows_per_cta`` rows, y over column tiles of ``col_threads`` slices.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.memory import SmemAllocator

from .common import (PoolingKernel, block_start, can_stage, chunk_softmax, div_exact, load_chunk, mul_rn,
                     reduce_chunks, row_start, stage_buffers, stage_chunk, stage_slots)


def partial_buffers(n_chunks: int, tile_cols: int, threads: int):
    """Shared buffers of ``reduce_chunks``: per-chunk partials, per-group partials, results."""
    smem = SmemAllocator()
    groups = max(1, threads // tile_cols)
    return tuple(
        smem.allocate_tensor(Float32, cute.make_layout((rows, tile_cols), stride=(tile_cols, 1)), 16)
        for rows in (n_chunks, groups, 1)
    )


class StreamForward(PoolingKernel):
    family = "stream"

    @cute.jit
    def __call__(
        self,
        mKV: cute.Tensor,  # (T, coff*d) bf16
        mS: cute.Tensor,  # (T, coff*d) bf16
        mApe: cute.Tensor,  # (ratio, coff*d) fp32
        mCu: cute.Tensor,  # (B+1,) int32
        mCuC: cute.Tensor,  # (B+1,) int32
        mOut: cute.Tensor,  # (total_comp, d) bf16
        rows_per_cta: Int32,
        stream,
    ):
        self.kernel(mKV, mS, mApe, mCu, mCuC, mOut, rows_per_cta).launch(
            grid=((mOut.shape[0] + rows_per_cta - 1) // rows_per_cta, self.sched.col_tiles, 1),
            block=(self.sched.threads, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mKV, mS, mApe, mCu, mCuC, mOut, rows_per_cta):
        vec, n_vec, chunk = self.vec, self.n_vec, self.sched.chunk
        ct, n_chunks = self.sched.col_threads, self.sched.row_lanes
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        col = tidx % ct
        c = tidx // ct
        cv = by * ct + col
        n_seg = mCu.shape[0] - 1
        threads = self.sched.threads
        sPart, sGrp, sFin = partial_buffers(n_chunks, ct * vec, threads)
        gKV = cute.zipped_divide(mKV, (1, vec))
        gS = cute.zipped_divide(mS, (1, vec))
        gA = cute.zipped_divide(mApe, (1, vec))
        gO = cute.zipped_divide(mOut, (1, vec))
        # Software pipeline over the CTA's rows (as the window backward): the next row's chunk
        # is in flight into the other shared-memory stage while this row is reduced; each
        # thread reads only the slots it copied.
        # coff 1 windows are not staged: measured on the H200, staging made them slower (r128 c1
        # d128 30.3 -> 33.6 us, r64 c1 d512 54.1 -> 57.5 us) while coff 2 gained 10-22%
        staged = can_stage(vec) and self.coff == 2
        sBuf = stage_buffers(chunk, threads, vec) if cutlass.const_expr(staged) else None
        row = bx * rows_per_cta
        t0, blk = row_start(mCu, mCuC, n_seg, row, self.warp_rows)
        own0, has_prev = block_start(t0, blk, self.ratio, mKV.shape[0])
        if cutlass.const_expr(staged):
            if row < mOut.shape[0] and cv < n_vec:
                stage_chunk(gKV, gS, stage_slots(sBuf, 0, tidx), own0, has_prev, cv, c * chunk, chunk,
                            self.ratio, self.coff, n_vec, vec)
            cute.arch.cp_async_commit_group()
        for it in cutlass.range(rows_per_cta, unroll=1):
            nrow = row + 1
            nt0, nblk = row_start(mCu, mCuC, n_seg, nrow, self.warp_rows)
            nown0, nhas_prev = block_start(nt0, nblk, self.ratio, mKV.shape[0])
            slots = None
            if cutlass.const_expr(staged):
                if it + 1 < rows_per_cta and nrow < mOut.shape[0] and cv < n_vec:
                    stage_chunk(gKV, gS, stage_slots(sBuf, (it + 1) % 2, tidx), nown0, nhas_prev, cv,
                                c * chunk, chunk, self.ratio, self.coff, n_vec, vec)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(1)
                slots = stage_slots(sBuf, it % 2, tidx)
            if row < mOut.shape[0]:
                rS = cute.make_rmem_tensor((chunk, vec), Float32)
                rX = cute.make_rmem_tensor((chunk, vec), Float32)
                rS.fill(-Float32.inf)
                rX.fill(0.0)
                if cv < n_vec:
                    load_chunk(gKV, gS, gA, rS, rX, own0, has_prev, cv, c * chunk, chunk, self.ratio,
                               self.coff, n_vec, vec, slots)
                rDen = cute.make_rmem_tensor((vec,), Float32)
                chunk_softmax(rS, sPart, sGrp, sFin[0, None], rDen, c, col, tidx, chunk, n_chunks, vec, threads)
                for v in cutlass.range_constexpr(vec):
                    den = rDen[v]
                    rcp = Float32(1.0) / den
                    acc = Float32(0.0)
                    for i in cutlass.range_constexpr(chunk):
                        term = mul_rn(rX[i, v], div_exact(rS[i, v], den, rcp))
                        if cutlass.const_expr(i == 0):
                            acc = term
                        else:
                            acc = acc + term
                    sPart[c, col * vec + v] = acc
                cute.arch.sync_threads()
                reduce_chunks(sPart, sGrp, sFin[0, None], tidx, n_chunks, ct * vec, threads, False)
                if c == 0 and cv < n_vec:
                    rO = cute.make_rmem_tensor((vec,), Float32)
                    for v in cutlass.range_constexpr(vec):
                        rO[v] = sFin[0, col * vec + v]
                    gO[(0, None), (row, cv)].store(rO.load().to(BFloat16))
            row, own0, has_prev = nrow, nown0, nhas_prev
