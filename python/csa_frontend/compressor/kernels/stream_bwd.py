"""Stream-family backward: a CTA walks ``rows_per_cta`` rows, each row's window split in chunks.

Per row: every thread loads its chunk once; the window max, ``den`` and ``S = sum_k p_k dp_k``
come from chunk partials combined in chunk order (as the stream forward), and each thread
forms ``p = e / den`` (correctly rounded) and the gradients of its own positions with the
reference's operation order. A thread owns fixed window positions and columns across all
the CTA's rows, so its grad_ape partials stay in registers and go straight to this row
group's slab; ``ape_reduce`` sums the slabs in order. Zero-filling follows the
register-window backward.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32
from cutlass.memory import SmemAllocator

from .common import (BackwardKernel, can_stage, chunk_softmax, copy_async, load_chunk, mul_rn, reduce_chunks,
                     row_block, stage_buffers, stage_chunk, stage_slots, store_partial, weights_and_products,
                     zero_fill_cta, zero_tokens)


def partial_buffers(n_chunks: int, tile_cols: int, threads: int):
    """Shared buffers of ``reduce_chunks``: per-chunk partials, per-group partials, results."""
    smem = SmemAllocator()
    groups = max(1, threads // tile_cols)
    return tuple(
        smem.allocate_tensor(Float32, cute.make_layout((rows, tile_cols), stride=(tile_cols, 1)), 16)
        for rows in (n_chunks, groups, 1)
    )


class StreamBackward(BackwardKernel):
    family = "stream"

    @cute.kernel
    def kernel(self, mKV, mS, mApe, mCu, mCuC, mGO, mGKV, mGS, mSlab,
               rows_per_cta, row_groups, zero_ctas):
        ratio, coff, vec, n_vec, chunk = self.ratio, self.coff, self.vec, self.n_vec, self.sched.chunk
        width = coff * ratio
        ct, n_chunks = self.sched.col_threads, self.sched.row_lanes
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        col = tidx % ct
        c = tidx // ct
        cv = by * ct + col
        col_ok = cv < n_vec
        n_seg = mCu.shape[0] - 1
        k0 = c * chunk
        gKV = cute.zipped_divide(mKV, (1, vec))
        gS = cute.zipped_divide(mS, (1, vec))
        gA = cute.zipped_divide(mApe, (1, vec))
        gGKV = cute.zipped_divide(mGKV, (1, vec))
        gGS = cute.zipped_divide(mGS, (1, vec))
        gGO = cute.zipped_divide(mGO, (1, vec))
        if bx < row_groups:
            threads = self.sched.threads
            sPart, sGrp, sFin = partial_buffers(n_chunks, ct * vec, threads)
            rPart = cute.make_rmem_tensor((chunk, vec), Float32)
            rPart.fill(0.0)
            n_real = mCuC[n_seg]
            # Software pipeline over the CTA's rows, as the stream forward (grad_out slice too).
            staged = can_stage(vec)
            sBuf = stage_buffers(chunk, threads, vec, 1) if cutlass.const_expr(staged) else None
            row = bx * rows_per_cta
            seg, blk, own0, has_prev = row_block(mCu, mCuC, n_seg, row, ratio, mKV.shape[0], self.warp_rows)
            if cutlass.const_expr(staged):
                if row < n_real and col_ok:
                    self.stage_row(gKV, gS, gGO, stage_slots(sBuf, 0, tidx), row, own0, has_prev, cv, k0)
                cute.arch.cp_async_commit_group()
            for it in cutlass.range(rows_per_cta, unroll=1):
                nrow = row + 1
                nseg, nblk, nown0, nhas_prev = row_block(mCu, mCuC, n_seg, nrow, ratio, mKV.shape[0],
                                                         self.warp_rows)
                slots = None
                if cutlass.const_expr(staged):
                    if it + 1 < rows_per_cta and nrow < n_real and col_ok:
                        self.stage_row(gKV, gS, gGO, stage_slots(sBuf, (it + 1) % 2, tidx), nrow, nown0,
                                       nhas_prev, cv, k0)
                    cute.arch.cp_async_commit_group()
                    cute.arch.cp_async_wait_group(1)
                    slots = stage_slots(sBuf, it % 2, tidx)
                if row < n_real:
                    rS = cute.make_rmem_tensor((chunk, vec), Float32)
                    rX = cute.make_rmem_tensor((chunk, vec), Float32)
                    rG = cute.make_rmem_tensor((vec,), Float32)
                    rS.fill(-Float32.inf)
                    rX.fill(0.0)
                    rG.fill(0.0)
                    if col_ok:
                        load_chunk(gKV, gS, gA, rS, rX, own0, has_prev, cv, k0, chunk, ratio, coff, n_vec, vec,
                                   slots)
                        if cutlass.const_expr(staged):
                            rG.store(slots[2 * chunk, None].load().to(Float32))
                        else:
                            rG.store(gGO[(0, None), (row, cv)].load().to(Float32))
                    rDen = cute.make_rmem_tensor((vec,), Float32)
                    chunk_softmax(rS, sPart, sGrp, sFin[0, None], rDen, c, col, tidx, chunk, n_chunks, vec,
                                  threads)
                    for v in cutlass.range_constexpr(vec):
                        sPart[c, col * vec + v] = weights_and_products(rS, rX, v, chunk, rDen[v], rG[v])
                    cute.arch.sync_threads()
                    reduce_chunks(sPart, sGrp, sFin[0, None], tidx, n_chunks, ct * vec, threads, False)
                    rGKV = cute.make_rmem_tensor((chunk, vec), BFloat16)
                    rGS = cute.make_rmem_tensor((chunk, vec), BFloat16)
                    for v in cutlass.range_constexpr(vec):
                        ssum = sFin[0, col * vec + v]
                        g = rG[v]
                        for i in cutlass.range_constexpr(chunk):
                            gs = rX[i, v] - mul_rn(rS[i, v], ssum)
                            # an invalid position's gs is 0 - 0*S: NaN when S is; keep it out
                            if cutlass.const_expr(coff == 2):
                                if k0 + i >= ratio or has_prev:
                                    rPart[i, v] = rPart[i, v] + gs
                            else:
                                rPart[i, v] = rPart[i, v] + gs
                            rGS[i, v] = gs.to(BFloat16)
                            rGKV[i, v] = mul_rn(g, rS[i, v]).to(BFloat16)
                    if col_ok:
                        for i in cutlass.range_constexpr(chunk):
                            k = k0 + i
                            if k < width:
                                tok = own0 + k
                                colt = cv
                                ok = blk >= 0
                                if cutlass.const_expr(coff == 2):
                                    if k < ratio:
                                        tok = own0 - ratio + k
                                        ok = has_prev
                                    else:
                                        tok = own0 + k - ratio
                                        colt = cv + n_vec
                                if ok:
                                    gGKV[(0, None), (tok, colt)].store(rGKV[i, None].load())
                                    gGS[(0, None), (tok, colt)].store(rGS[i, None].load())
                        n_blk = mCuC[seg + 1] - mCuC[seg]
                        if blk == n_blk - 1:
                            if cutlass.const_expr(coff == 2):
                                # first-half columns of the last block's own tokens (coff=1: one half)
                                zero_tokens(gGKV, gGS, own0 + c, own0 + ratio, n_chunks, cv, 1, n_vec, vec)
                            zero_tokens(gGKV, gGS, own0 + ratio + c, mCu[seg + 1], n_chunks, cv, coff,
                                        n_vec, vec)
                row, seg, blk, own0, has_prev = nrow, nseg, nblk, nown0, nhas_prev
            if col_ok:
                for i in cutlass.range_constexpr(chunk):
                    k = k0 + i
                    if k < width:
                        arow = k
                        colt = cv
                        if cutlass.const_expr(coff == 2):
                            if k >= ratio:
                                arow = k - ratio
                                colt = cv + n_vec
                        for v in cutlass.range_constexpr(vec):
                            store_partial(mSlab, bx, arow, colt * vec + v, rPart[i, v], self.atomic)
        else:
            zb = bx - row_groups
            if col_ok:
                zero_fill_cta(gGKV, gGS, mCu, mCuC, zb, c, n_chunks, zero_ctas, cv, mKV.shape[0], coff, n_vec, vec)

    @cute.jit
    def stage_row(self, gKV, gS, gGO, slots, row, own0, has_prev, cv, k0):
        """Start the copies of this thread's chunk of one row and its grad_out slice."""
        chunk = self.sched.chunk
        stage_chunk(gKV, gS, slots, own0, has_prev, cv, k0, chunk, self.ratio, self.coff, self.n_vec, self.vec)
        copy_async(gGO[(0, None), (row, cv)], slots[2 * chunk, None], self.vec)
