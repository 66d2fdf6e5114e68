"""Stream-family backward: a CTA walks ``rows_per_cta`` rows, each row's window split in chunks.

Per row, two phases, each ending in a barrier: (1) the window max, as shuffle maxima over a
warp's chunks, then over the warps' maxima in shared memory (exact, so every thread holds the
same max); (2) ``den = sum e`` and ``T = sum e * dp`` with ``dp = g * kv``, summed down each
warp in chunk order and then over the warps. The warps' partials sit in shared memory as ``[group, column thread,
vec]`` and the chunk lanes of a warp split the groups between them and finish with a
butterfly (``combine_groups``): fixed orders, so the bits are reproducible. In CTAs of
``STREAM_BWD_COMBINE_GROUPS`` or more warp groups only warps 0 and 1 combine, and the others
read their result after one more barrier per phase: every warp combining every group had kept
the MIO pipe (shuffles and shared loads) saturated. Then ``S = T / den``,
``p = e / den`` and the gradients ``gs = (dp - S) * p``, ``gkv = g * p`` of the thread's own
positions. Arithmetic: ``ex2.approx`` exp, ``rcp.approx`` weights and contractible products by
default (``STREAM_BWD_FAST_MATH``; the tolerance contract), else libdevice ``expf``, correctly
rounded weights and pinned products. A thread owns fixed window positions and columns across
all the CTA's rows, so its ape slice and its grad_ape partials stay in registers; the partials
go to this row group's slab, which ``ape_reduce`` sums in order. Zero-filling follows the
register-window backward.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.memory import SmemAllocator

from .common import (BackwardKernel, add_in_order, block_start, can_stage, chunk_position, copy_async,
                     div_exact, enter_grid, guessed_block_start, rcp_of_den, row_span, safe_max, stage_buffers,
                     stage_slots, store_partial_vector, zero_fill_cta, zero_tokens)
from .schedule import (FIRST_ROW_ALONE, STREAM_BWD_FAST_MATH, STREAM_BWD_GUESS, chunks_per_warp, combines_once_per_cta,
                       stream_bwd_may_interleave, warp_groups)
from .stream_chunks import (ape_slice, chunk_view, exp_relative, gather_scores, invalid_position, product,
                            stage_any_chunk, warp_chunks_max, warp_chunks_sum)


def warp_group_buffers(groups: int, col_threads: int, vec: int):
    """Shared per-warp partials (max, den, T): warp groups x column threads x ``vec``, so one
    thread's ``vec`` values are one vector access and a warp's accesses are conflict-free."""
    smem = SmemAllocator()
    layout = cute.make_layout((groups, col_threads, vec), stride=(col_threads * vec, vec, 1))
    return tuple(smem.allocate_tensor(Float32, layout, 16) for _ in range(3))


@cute.jit
def combine_groups(sX: cute.Tensor, rOut: cute.Tensor, col: Int32, lane_chunk: Int32, groups: cutlass.Constexpr,
                   per_warp: cutlass.Constexpr, col_threads: cutlass.Constexpr, vec: cutlass.Constexpr,
                   is_max: cutlass.Constexpr):
    """``rOut[v]`` = max or sum over the warp groups' partials of column ``(col, v)``.

    The chunk lanes of a warp share the work: lane ``j`` combines groups ``j*n, ..., j*n+n-1``
    (``n = ceil(groups / per_warp)``) in order, then a butterfly over the lanes finishes. Both
    ``max`` and ``+`` are commutative, so every lane (and every warp) ends with the same bits.
    """
    per_lane = -(-groups // per_warp)
    whole = per_lane * per_warp == groups  # every lane has per_lane groups: start from the first
    if cutlass.const_expr(not whole):
        for v in cutlass.range_constexpr(vec):
            rOut[v] = -Float32.inf if cutlass.const_expr(is_max) else Float32(0.0)
    for q in cutlass.range_constexpr(per_lane):
        g = lane_chunk * per_lane + q
        if cutlass.const_expr(whole) or g < groups:
            x = sX[g, col, None].load()
            for v in cutlass.range_constexpr(vec):
                if cutlass.const_expr(whole and q == 0):
                    rOut[v] = x[v]
                elif cutlass.const_expr(is_max):
                    rOut[v] = cute.arch.fmax(rOut[v], x[v])
                else:
                    rOut[v] = rOut[v] + x[v]
    dist = col_threads
    while cutlass.const_expr(dist < 32):
        for v in cutlass.range_constexpr(vec):
            y = cute.arch.shuffle_sync_bfly(rOut[v], dist)
            if cutlass.const_expr(is_max):
                rOut[v] = cute.arch.fmax(rOut[v], y)
            else:
                rOut[v] = rOut[v] + y
        dist *= 2


@cute.jit
def combine_and_publish(sX: cute.Tensor, rOut: cute.Tensor, sFinal: cute.Tensor, slot: cutlass.Constexpr, col: Int32,
                        lane_chunk: Int32, groups: cutlass.Constexpr, per_warp: cutlass.Constexpr,
                        col_threads: cutlass.Constexpr, vec: cutlass.Constexpr, is_max: cutlass.Constexpr):
    """``combine_groups`` by the calling warp, then its first chunk lane stores the result in
    ``sFinal[slot]`` for the CTA's other warps (which read it after the next barrier)."""
    combine_groups(sX, rOut, col, lane_chunk, groups, per_warp, col_threads, vec, is_max)
    if lane_chunk == 0:
        sFinal[slot, col, None].store(rOut.load())


class StreamBackward(BackwardKernel):
    family = "stream"

    @cute.kernel
    def kernel(self, mKV, mS, mApe, mCu, mCuC, mGO, mGKV, mGS, mSlab,
               rows_per_cta, row_groups, zero_ctas, interleaved):
        enter_grid(self.pdl)
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
            per_warp = chunks_per_warp(ct)
            groups = warp_groups(self.sched)
            sMax, sDen, sT = warp_group_buffers(groups, ct, vec)
            cta_combine = combines_once_per_cta(self.sched)
            sFinal = None
            if cutlass.const_expr(cta_combine):
                # combined (max, den, T) per column, written by the combining warps 0 and 1
                sFinal = SmemAllocator().allocate_tensor(
                    Float32, cute.make_layout((3, ct, vec), stride=(ct * vec, vec, 1)), 16)
            rA = ape_slice(mApe, col_ok, cv, k0, chunk, ratio, coff, n_vec, vec)
            rPart = cute.make_rmem_tensor((chunk, vec), Float32)
            rPart.fill(0.0)
            n_real = mCuC[n_seg]
            # Software pipeline over the CTA's rows, as the stream forward (grad_out slice too);
            # rows are looked up incrementally (``row_span``).
            staged = can_stage(vec)
            sBuf = stage_buffers(chunk, threads, vec, 1) if cutlass.const_expr(staged) else None
            # A CTA's rows: one contiguous run, or, interleaved, ``row_groups`` apart, so that the
            # whole grid works through one region of the pack at a time (``bwd_interleaved``;
            # compiled in where ``stream_bwd_may_interleave``)
            row = bx * rows_per_cta
            step = Int32(1)
            if cutlass.const_expr(stream_bwd_may_interleave(ratio, coff, self.sched)):
                if interleaved != 0:
                    row = bx
                    step = row_groups
            guess = staged and STREAM_BWD_GUESS
            if cutlass.const_expr(guess):
                # the first row requested before its lookup answers, as the stream forward's
                # (STREAM_FWD_GUESS): right for every real row of a launch of T / ratio rows
                whole, g_own0, g_has_prev = guessed_block_start(row, mGO.shape[0], ratio, mKV.shape[0])
                if whole and col_ok:
                    self.stage_row(mKV, mS, gGO, stage_slots(sBuf, 0, tidx), row, g_own0, g_has_prev, cv, k0)
                cute.arch.cp_async_commit_group()
            t0, lo, hi, t1 = row_span(mCu, mCuC, n_seg, row, False, self.one_round_loads("bwd"))
            own0, has_prev = block_start(t0, row - lo, ratio, mKV.shape[0])
            if cutlass.const_expr(staged):
                if row < n_real and col_ok:
                    if cutlass.const_expr(guess):
                        if not whole or own0 != g_own0 or has_prev != g_has_prev:
                            cute.arch.cp_async_wait_group(0)  # a wrong guess's copies land before the slots are reused
                            self.stage_row(mKV, mS, gGO, stage_slots(sBuf, 0, tidx), row, own0, has_prev, cv, k0)
                    else:
                        self.stage_row(mKV, mS, gGO, stage_slots(sBuf, 0, tidx), row, own0, has_prev, cv, k0)
                cute.arch.cp_async_commit_group()
                if cutlass.const_expr(FIRST_ROW_ALONE):
                    cute.arch.cp_async_wait_group(0)
            for it in cutlass.range(rows_per_cta, unroll=1):
                nrow = row + step
                blk = row - lo  # this row's block, block count and segment end, before the cursor moves
                n_blk = hi - lo
                seg_end = t1
                if nrow >= hi:
                    t0, lo, hi, t1 = row_span(mCu, mCuC, n_seg, nrow, False, self.one_round_loads("bwd"))
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
                    rS, rX, rG = self.gather_row(mKV, mS, gGO, rA, slots, row, own0, has_prev, cv, k0, col_ok)
                    lead = c % per_warp == 0
                    g_idx = c // per_warp
                    lane_chunk = c % per_warp
                    rM = cute.make_rmem_tensor((vec,), Float32)
                    # (1) window max: over the thread's chunk, the warp's chunks, then the groups
                    for v in cutlass.range_constexpr(vec):
                        rM[v] = warp_chunks_max(rS, v, chunk, ct)
                    if lead:
                        sMax[g_idx, col, None].store(rM.load())
                    cute.arch.sync_threads()
                    if cutlass.const_expr(cta_combine):
                        # one warp combines for the CTA (every warp would get the same bits), the
                        # others read its result: fewer shared loads and shuffles, one barrier more
                        if tidx < 32:
                            combine_and_publish(sMax, rM, sFinal, 0, col, lane_chunk, groups, per_warp, ct, vec, True)
                        cute.arch.sync_threads()
                        rM.store(sFinal[0, col, None].load())
                    else:
                        combine_groups(sMax, rM, col, lane_chunk, groups, per_warp, ct, vec, True)
                    # (2) e, den and T = sum e * dp with dp = g * kv (kept in rX for the gradients)
                    rD, rT = self.den_and_sum(rS, rX, rG, rM)
                    if lead:
                        sDen[g_idx, col, None].store(rD.load())
                        sT[g_idx, col, None].store(rT.load())
                    cute.arch.sync_threads()
                    if cutlass.const_expr(cta_combine):
                        if tidx < 32:
                            combine_and_publish(sDen, rD, sFinal, 1, col, lane_chunk, groups, per_warp, ct, vec, False)
                        elif tidx < 64:
                            combine_and_publish(sT, rT, sFinal, 2, col, lane_chunk, groups, per_warp, ct, vec, False)
                        cute.arch.sync_threads()
                        rD.store(sFinal[1, col, None].load())
                        rT.store(sFinal[2, col, None].load())
                    else:
                        combine_groups(sDen, rD, col, lane_chunk, groups, per_warp, ct, vec, False)
                        combine_groups(sT, rT, col, lane_chunk, groups, per_warp, ct, vec, False)
                    # (3) p = e / den, S = T / den, and the gradients in the reference's order
                    rGKV, rGS = self.row_gradients(rS, rX, rG, rD, rT, rPart, k0, has_prev)
                    if col_ok:
                        self.finish_row(mGKV, mGS, gGKV, gGS, rGKV, rGS, own0, has_prev, blk, n_blk, seg_end,
                                        cv, k0, c)
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
                        store_partial_vector(mSlab, bx, arow, colt, rPart, i, vec, self.atomic,
                                             self.vector_atomics)
        else:
            zb = bx - row_groups
            if col_ok:
                zero_fill_cta(gGKV, gGS, mCu, mCuC, zb, c, n_chunks, zero_ctas, cv, mKV.shape[0], coff, n_vec, vec)

    @cute.jit
    def gather_row(self, mKV, mS, gGO, rA, slots, row, own0, has_prev, cv, k0, col_ok):
        """(score + ape, kv, grad_out) of this thread's chunk of one row, from its staged slots
        (``slots``) or from global memory."""
        ratio, coff, vec, n_vec, chunk = self.ratio, self.coff, self.vec, self.n_vec, self.sched.chunk
        rS = cute.make_rmem_tensor((chunk, vec), Float32)
        rX = cute.make_rmem_tensor((chunk, vec), Float32)
        rG = cute.make_rmem_tensor((vec,), Float32)
        if cutlass.const_expr(slots is not None):
            # no test: a column thread past head_dim computes on stale slots of its own
            # and stores nothing (its columns meet no other thread's in any reduction)
            gather_scores(mKV, mS, rA, rS, rX, own0, has_prev, cv, k0, chunk, ratio, coff, n_vec, vec, slots)
            rG.store(slots[2 * chunk, None].load().to(Float32))
        else:
            rG.fill(0.0)
            if col_ok:
                gather_scores(mKV, mS, rA, rS, rX, own0, has_prev, cv, k0, chunk, ratio, coff, n_vec, vec, None)
                rG.store(gGO[(0, None), (row, cv)].load().to(Float32))
            else:
                for i in cutlass.range_constexpr(chunk):
                    invalid_position(rS, rX, i, vec)
        return rS, rX, rG

    @cute.jit
    def den_and_sum(self, rS, rX, rG, rM):
        """(den, T) of each column over the warp's chunks (on its first chunk lane), with
        ``rS`` <- e = exp(s - max) and ``rX`` <- dp = g * kv in place for the gradients."""
        vec, chunk, ct = self.vec, self.sched.chunk, self.sched.col_threads
        fast = STREAM_BWD_FAST_MATH
        rD = cute.make_rmem_tensor((vec,), Float32)
        rT = cute.make_rmem_tensor((vec,), Float32)
        for v in cutlass.range_constexpr(vec):
            ms = safe_max(rM[v])
            d = Float32(0.0)
            t = Float32(0.0)
            for i in cutlass.range_constexpr(chunk):
                e = exp_relative(rS[i, v] - ms, fast)
                dp = product(rG[v], rX[i, v], fast)
                rS[i, v] = e
                rX[i, v] = dp
                d = add_in_order(d, e, i == 0)
                t = add_in_order(t, product(e, dp, fast), i == 0)
            rD[v], rT[v] = warp_chunks_sum(d, t, ct)
        return rD, rT

    @cute.jit
    def row_gradients(self, rS, rX, rG, rD, rT, rPart, k0, has_prev):
        """p = e / den, S = T / den, and the chunk's gradients in the reference's order (bf16);
        grad_score's fp32 values added into the grad_ape partials ``rPart``."""
        ratio, coff, vec, chunk = self.ratio, self.coff, self.vec, self.sched.chunk
        fast = STREAM_BWD_FAST_MATH
        rGKV = cute.make_rmem_tensor((chunk, vec), BFloat16)
        rGS = cute.make_rmem_tensor((chunk, vec), BFloat16)
        for v in cutlass.range_constexpr(vec):
            den = rD[v]
            g = rG[v]
            rcp = Float32(0.0)
            ssum = Float32(0.0)
            if cutlass.const_expr(fast):
                rcp = cute.arch.rcp_approx(den)
                ssum = rT[v] * rcp
            else:
                rcp = rcp_of_den(den)
                ssum = rT[v] / den
            for i in cutlass.range_constexpr(chunk):
                p = Float32(0.0)
                if cutlass.const_expr(fast):
                    p = rS[i, v] * rcp
                else:
                    p = div_exact(rS[i, v], den, rcp)
                gs = product(rX[i, v] - ssum, p, fast)
                if cutlass.const_expr(coff == 2):
                    # an invalid (previous-block) position's gs is (0 - S) * 0: NaN when S
                    # is, so it is kept out by a select (a branch here would carry every
                    # partial through it)
                    keep = k0 + i >= ratio or has_prev
                    rPart[i, v] = Float32(cutlass.select_(keep, rPart[i, v] + gs, rPart[i, v]))
                else:
                    rPart[i, v] = rPart[i, v] + gs
                rGS[i, v] = gs.to(BFloat16)
                rGKV[i, v] = product(g, p, fast).to(BFloat16)
        return rGKV, rGS

    @cute.jit
    def finish_row(self, mGKV, mGS, gGKV, gGS, rGKV, rGS, own0, has_prev, blk, n_blk, seg_end, cv, k0, c):
        """Store the row's gradients (block ``blk`` of its segment's ``n_blk``); after a
        segment's last block, zero its never-consumed token slots (this thread's chunk lane of
        them)."""
        ratio, coff, vec, n_vec = self.ratio, self.coff, self.vec, self.n_vec
        n_chunks = self.sched.row_lanes
        self.store_gradients(mGKV, mGS, gGKV, gGS, rGKV, rGS, own0, has_prev, blk >= 0, cv, k0)
        if blk == n_blk - 1:
            if cutlass.const_expr(coff == 2):
                # first-half columns of the last block's own tokens (coff=1: one half)
                zero_tokens(gGKV, gGS, own0 + c, own0 + ratio, n_chunks, cv, 1, n_vec, vec)
            zero_tokens(gGKV, gGS, own0 + ratio + c, seg_end, n_chunks, cv, coff, n_vec, vec)

    @cute.jit
    def store_gradients(self, mGKV, mGS, gGKV, gGS, rGKV, rGS, own0, has_prev, own_ok, cv, k0):
        """Store this thread's chunk of grad_kv and grad_score for one row. A chunk inside one
        window half (``chunk`` divides ``ratio``) is consecutive tokens of one column slice: one
        validity test and one base address; other chunks go position by position."""
        ratio, coff, vec, n_vec, chunk = self.ratio, self.coff, self.vec, self.n_vec, self.sched.chunk
        if cutlass.const_expr(ratio % chunk == 0):
            tok, colt, _, ok = chunk_position(own0, has_prev, cv, k0, ratio, coff, n_vec)
            if ok and own_ok:
                wGKV = chunk_view(mGKV, tok, vec)
                wGS = chunk_view(mGS, tok, vec)
                for i in cutlass.range_constexpr(chunk):
                    wGKV[(0, None), (i, colt)].store(rGKV[i, None].load())
                    wGS[(0, None), (i, colt)].store(rGS[i, None].load())
        else:
            for i in cutlass.range_constexpr(chunk):
                tok, colt, _, ok = chunk_position(own0, has_prev, cv, k0 + i, ratio, coff, n_vec)
                if ok and own_ok:
                    gGKV[(0, None), (tok, colt)].store(rGKV[i, None].load())
                    gGS[(0, None), (tok, colt)].store(rGS[i, None].load())

    @cute.jit
    def stage_row(self, mKV, mS, gGO, slots, row, own0, has_prev, cv, k0):
        """Start the copies of this thread's chunk of one row and its grad_out slice."""
        chunk = self.sched.chunk
        stage_any_chunk(mKV, mS, slots, own0, has_prev, cv, k0, chunk, self.ratio, self.coff, self.n_vec, self.vec)
        copy_async(gGO[(0, None), (row, cv)], slots[2 * chunk, None], self.vec)
