"""Stream-family backward: a CTA walks ``rows_per_cta`` rows, each row's window split in chunks.

Per row, two barriers: (1) the window max, as shuffle maxima over a warp's chunks then over
the warps through shared memory (exact, so every thread holds the same max and
``e = exp(s - max)`` is the reference's); (2) ``den = sum e`` and ``T = sum e * g * kv``, summed
down each warp in chunk order and over the warps in warp order. Then ``S = T / den`` and each
thread forms ``p = e / den`` (correctly rounded) and the gradients of its own positions in the
reference's operation order. A thread owns fixed window positions and columns across all the
CTA's rows, so its ape slice and its grad_ape partials stay in registers; the partials go to
this row group's slab, which ``ape_reduce`` sums in order. Zero-filling follows the
register-window backward.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32
from cutlass.memory import SmemAllocator

from .common import (BackwardKernel, block_start, can_stage, copy_async, div_exact, mul_rn, row_span, safe_max,
                     stage_buffers, stage_slots, store_partial, zero_fill_cta, zero_tokens)
from .stream_chunks import (ape_slice, gather_scores, invalid_position, stage_any_chunk, warp_chunks_max,
                            warp_chunks_sum)


def warp_group_buffers(groups: int, tile_cols: int):
    """Shared per-warp partials (max, den, T): warp groups x the tile's columns."""
    smem = SmemAllocator()
    layout = cute.make_layout((groups, tile_cols), stride=(tile_cols, 1))
    return tuple(smem.allocate_tensor(Float32, layout, 16) for _ in range(3))


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
        gGKV = cute.zipped_divide(mGKV, (1, vec))
        gGS = cute.zipped_divide(mGS, (1, vec))
        gGO = cute.zipped_divide(mGO, (1, vec))
        if bx < row_groups:
            threads = self.sched.threads
            per_warp = max(1, 32 // ct)  # chunks sharing a warp (reduced by shuffles)
            groups = n_chunks // per_warp
            tile_cols = ct * vec
            sMax, sDen, sT = warp_group_buffers(groups, tile_cols)
            rA = ape_slice(mApe, col_ok, cv, k0, chunk, ratio, coff, n_vec, vec)
            rPart = cute.make_rmem_tensor((chunk, vec), Float32)
            rPart.fill(0.0)
            n_real = mCuC[n_seg]
            # Software pipeline over the CTA's rows, as the stream forward (grad_out slice too);
            # rows are looked up incrementally (``row_span``).
            staged = can_stage(vec)
            sBuf = stage_buffers(chunk, threads, vec, 1) if cutlass.const_expr(staged) else None
            row = bx * rows_per_cta
            t0, lo, hi, t1 = row_span(mCu, mCuC, n_seg, row)
            own0, has_prev = block_start(t0, row - lo, ratio, mKV.shape[0])
            if cutlass.const_expr(staged):
                if row < n_real and col_ok:
                    self.stage_row(mKV, mS, gGO, stage_slots(sBuf, 0, tidx), row, own0, has_prev, cv, k0)
                cute.arch.cp_async_commit_group()
            for it in cutlass.range(rows_per_cta, unroll=1):
                nrow = row + 1
                blk = row - lo  # this row's block, block count and segment end, before the cursor moves
                n_blk = hi - lo
                seg_end = t1
                if nrow >= hi:
                    t0, lo, hi, t1 = row_span(mCu, mCuC, n_seg, nrow)
                nown0, nhas_prev = block_start(t0, nrow - lo, ratio, mKV.shape[0])
                slots = None
                if cutlass.const_expr(staged):
                    if it + 1 < rows_per_cta and nrow < n_real and col_ok:
                        self.stage_row(mKV, mS, gGO, stage_slots(sBuf, (it + 1) % 2, tidx), nrow, nown0,
                                       nhas_prev, cv, k0)
                    cute.arch.cp_async_commit_group()
                    cute.arch.cp_async_wait_group(1)
                    slots = stage_slots(sBuf, it % 2, tidx)
                if row < n_real:
                    rS = cute.make_rmem_tensor((chunk, vec), Float32)
                    rX = cute.make_rmem_tensor((chunk, vec), Float32)
                    rG = cute.make_rmem_tensor((vec,), Float32)
                    rG.fill(0.0)
                    if col_ok:
                        gather_scores(mKV, mS, rA, rS, rX, own0, has_prev, cv, k0, chunk, ratio, coff, n_vec, vec,
                                      slots)
                        if cutlass.const_expr(staged):
                            rG.store(slots[2 * chunk, None].load().to(Float32))
                        else:
                            rG.store(gGO[(0, None), (row, cv)].load().to(Float32))
                    else:
                        for i in cutlass.range_constexpr(chunk):
                            invalid_position(rS, rX, i, vec)
                    lead = c % per_warp == 0
                    g_idx = c // per_warp
                    # (1) window max
                    for v in cutlass.range_constexpr(vec):
                        m = warp_chunks_max(rS, v, chunk, ct)
                        if lead:
                            sMax[g_idx, col * vec + v] = m
                    cute.arch.sync_threads()
                    # (2) e, den and T = sum e * (g * kv)
                    for v in cutlass.range_constexpr(vec):
                        m = sMax[0, col * vec + v]
                        for q in cutlass.range_constexpr(1, groups):
                            m = cute.arch.fmax(m, sMax[q, col * vec + v])
                        ms = safe_max(m)
                        d = Float32(0.0)
                        t = Float32(0.0)
                        for i in cutlass.range_constexpr(chunk):
                            e = cute.math.exp(rS[i, v] - ms)
                            rS[i, v] = e
                            d = d + e
                            t = t + mul_rn(e, mul_rn(rG[v], rX[i, v]))
                        d, t = warp_chunks_sum(d, t, ct)
                        if lead:
                            sDen[g_idx, col * vec + v] = d
                            sT[g_idx, col * vec + v] = t
                    cute.arch.sync_threads()
                    rGKV = cute.make_rmem_tensor((chunk, vec), BFloat16)
                    rGS = cute.make_rmem_tensor((chunk, vec), BFloat16)
                    for v in cutlass.range_constexpr(vec):
                        den = sDen[0, col * vec + v]
                        tsum = sT[0, col * vec + v]
                        for q in cutlass.range_constexpr(1, groups):
                            den = den + sDen[q, col * vec + v]
                            tsum = tsum + sT[q, col * vec + v]
                        ssum = tsum / den
                        rcp = Float32(1.0) / den
                        g = rG[v]
                        for i in cutlass.range_constexpr(chunk):
                            p = div_exact(rS[i, v], den, rcp)
                            gs = mul_rn(p, mul_rn(g, rX[i, v])) - mul_rn(p, ssum)
                            # an invalid position's gs is 0 - 0*S: NaN when S is; keep it out
                            if cutlass.const_expr(coff == 2):
                                if k0 + i >= ratio or has_prev:
                                    rPart[i, v] = rPart[i, v] + gs
                            else:
                                rPart[i, v] = rPart[i, v] + gs
                            rGS[i, v] = gs.to(BFloat16)
                            rGKV[i, v] = mul_rn(g, p).to(BFloat16)
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
                        if blk == n_blk - 1:
                            if cutlass.const_expr(coff == 2):
                                # first-half columns of the last block's own tokens (coff=1: one half)
                                zero_tokens(gGKV, gGS, own0 + c, own0 + ratio, n_chunks, cv, 1, n_vec, vec)
                            zero_tokens(gGKV, gGS, own0 + ratio + c, seg_end, n_chunks, cv, coff, n_vec, vec)
                row, own0, has_prev = nrow, nown0, nhas_prev
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
    def stage_row(self, mKV, mS, gGO, slots, row, own0, has_prev, cv, k0):
        """Start the copies of this thread's chunk of one row and its grad_out slice."""
        chunk = self.sched.chunk
        stage_any_chunk(mKV, mS, slots, own0, has_prev, cv, k0, chunk, self.ratio, self.coff, self.n_vec, self.vec)
        copy_async(gGO[(0, None), (row, cv)], slots[2 * chunk, None], self.vec)
