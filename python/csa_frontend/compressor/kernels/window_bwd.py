"""Register-window backward: recompute the window, store disjoint gradients, reduce grad_ape.

Thread layout as the forward (``col_threads`` x ``row_lanes``), but each thread walks
``rows_per_thread`` rows (a runtime argument chosen from the row count) and keeps its
``grad_ape`` contributions in registers. At the end the CTA sums its row lanes in a fixed
order through shared memory and writes one partial slab ``(ratio, coff*d)`` per CTA row group;
``ape_reduce`` then sums the slabs in slab order. Nothing depends on the SM count or on
scheduling, so ``grad_ape`` is bitwise reproducible. The opt-in ``atomic`` variant adds the
CTA sums straight into ``grad_ape`` instead (``deterministic=False``).

Every gradient slot is written by this kernel: consumed ones by the thread owning the window,
the first-half columns of a segment's last block and the segment's tail tokens by the thread
of that last block, and slots no row can reach (segments shorter than ``ratio``, tokens past
``cu_seqlens[-1]``) by extra "zero-fill" CTAs appended to the grid.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32
from cutlass.memory import SmemAllocator

from .common import (BackwardKernel, ape_tile, block_start, can_stage, copy_async, enter_grid,
                     load_window, mul_rn, nanosleep, row_span, softmax_column, stage_ape, stage_buffers,
                     stage_slots, stage_window, store_partial, store_zeros, weights_and_products,
                     widen_bf16, window_view, zero_fill_cta, zero_tokens)
from .schedule import CTA_CLOCKS, FIRST_ROW_ALONE, WINDOW_BWD_STAGES, WINDOW_BWD_STAGGER_NS, stages_ape_tile


class WindowBackward(BackwardKernel):
    family = "window"

    @property
    def stages(self) -> int:
        stages = WINDOW_BWD_STAGES[f"c{self.coff}"]
        assert stages >= 2, f"CSA_FRONTEND_WINDOW_BWD_STAGES: at least 2 stages, got {stages}"
        return stages

    @cute.kernel
    def kernel(self, mKV, mS, mApe, mCu, mCuC, mGO, mGKV, mGS, mSlab,
               rows_per_thread, row_groups, zero_ctas, interleaved):
        enter_grid(self.pdl)
        ratio, coff, vec, n_vec, width = self.ratio, self.coff, self.vec, self.n_vec, self.width
        ct, lanes = self.sched.col_threads, self.sched.row_lanes
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        cvl = tidx % ct
        lane = tidx // ct
        cv = by * ct + cvl
        col_ok = cv < n_vec
        n_seg = mCu.shape[0] - 1
        gA = cute.zipped_divide(mApe, (1, vec))
        gGKV = cute.zipped_divide(mGKV, (1, vec))
        gGS = cute.zipped_divide(mGS, (1, vec))
        if bx < row_groups:
            t_start = cute.arch.globaltimer() if cutlass.const_expr(CTA_CLOCKS) else None
            staged = can_stage(vec)
            sBuf = stage_buffers(width, self.sched.threads, vec, 1, self.stages) if cutlass.const_expr(staged) else None
            gGO = cute.zipped_divide(mGO, (1, vec))
            sApe = ape_tile(width, ct, vec) if cutlass.const_expr(stages_ape_tile(self.sched)) else None
            rPart = cute.make_rmem_tensor((width, vec), Float32)
            rPart.fill(0.0)
            n_real = mCuC[n_seg]
            n_tok = mKV.shape[0]
            # Software pipeline over this thread's rows: while row ``it`` is computed, the windows
            # of its next ``stages - 1`` rows are already in flight into the other shared-memory
            # stages (cp.async), so the DRAM latency is paid once per thread instead of once per
            # row. Each thread reads only the slots it copied itself: no barrier, only its own
            # cp.async group wait. Rows are placed by a cursor over the segment of the computed
            # row (``row_span``: a search only when a row leaves it; with warp_rows the warp
            # shares the row, so a search, which votes, is taken by all its lanes together). The
            # cursor moves on before the row is computed: after it, ptxas needed 140-152
            # registers for r8 c1 (one CTA per SM) instead of 128.
            stages = self.stages
            # A thread's rows: ``lanes`` apart in one contiguous run per CTA, or, interleaved,
            # ``row_groups * lanes`` apart, so that the whole grid works through one region of
            # the pack at a time instead of one region per CTA (``bwd_interleaved``).
            step = lanes
            row = bx * rows_per_thread * lanes + lane
            if interleaved != 0:
                step = row_groups * lanes
                row = bx * lanes + lane
            t0, lo, hi, t1 = row_span(mCu, mCuC, n_seg, row, self.warp_rows, self.one_round_loads("bwd"))
            if cutlass.const_expr(staged):
                for p in cutlass.range_constexpr(stages - 1):
                    self.stage_ahead(mKV, mS, mCu, mCuC, n_seg, gGO, sBuf, p, p, p, rows_per_thread, row, step, t0,
                                     lo, hi, n_real, col_ok, cv, tidx)
            ape_rows = None
            if cutlass.const_expr(sApe is not None):
                # Every row re-reads the same ape window; from global (L1) those loads were the
                # backward's main stall (``WINDOW_BWD_APE_TILE_LANES``). Filled while the first
                # rows' copies are in flight.
                stage_ape(gA, sApe, col_ok, cv, cvl, lane, lanes, ratio, coff, n_vec)
                cute.arch.sync_threads()
                ape_rows = sApe[None, cvl, None]
            if cutlass.const_expr(staged and FIRST_ROW_ALONE):
                cute.arch.cp_async_wait_group(0)
            if cutlass.const_expr(WINDOW_BWD_STAGGER_NS > 0):
                if lane % 2 == 1:
                    nanosleep(WINDOW_BWD_STAGGER_NS)
            for it in cutlass.range(rows_per_thread, unroll=1):
                slots = None
                if cutlass.const_expr(staged):
                    self.stage_ahead(mKV, mS, mCu, mCuC, n_seg, gGO, sBuf, (it + stages - 1) % stages, stages - 1,
                                     it + stages - 1, rows_per_thread, row, step, t0, lo, hi, n_real, col_ok, cv,
                                     tidx)
                    cute.arch.cp_async_wait_group(stages - 1)
                    slots = stage_slots(sBuf, it % stages, tidx)
                this_row = row
                own0, has_prev = block_start(t0, row - lo, ratio, n_tok)
                last_blk = row - lo == hi - lo - 1
                seg_end = t1
                row = row + step
                if row >= hi:
                    t0, lo, hi, t1 = row_span(mCu, mCuC, n_seg, row, self.warp_rows, self.one_round_loads("bwd"))
                if this_row < n_real and col_ok:
                    wGKV, wGS = self.compute_row(mKV, mS, gA, gGO, mGKV, mGS, rPart, slots, this_row, own0,
                                                 has_prev, cv, ape_rows)
                    if last_blk:
                        # its segment's last block: nobody consumes its first-half columns, nor the tail
                        self.zero_unconsumed(wGKV, wGS, gGKV, gGS, own0, seg_end, cv)
            self.reduce_lanes(rPart, mSlab, bx, by, tidx, cvl, lane)
            if cutlass.const_expr(CTA_CLOCKS):
                if tidx == 0:
                    cute.printf("cta_clock {} {} {} {} {}", bx, by, cute.arch.smid(), t_start,
                                cute.arch.globaltimer())
        else:
            # zero-fill CTAs: one row lane per short segment, then tokens past the last segment
            zb = bx - row_groups
            if col_ok:
                zero_fill_cta(gGKV, gGS, mCu, mCuC, zb, lane, lanes, zero_ctas, cv, mKV.shape[0], coff, n_vec, vec)

    @cute.jit
    def compute_row(self, mKV, mS, gA, gGO, mGKV, mGS, rPart, slots, row, own0, has_prev, cv, ape_rows):
        """One row's window: recompute the softmax, store its disjoint grad_kv / grad_score slots
        and add its grad_ape contributions to ``rPart``. kv, score and grad_out come from this
        thread's staged ``slots`` (or from global without staging), ape from ``ape_rows`` (or from
        global). Returns the window views of grad_kv and grad_score it stored through."""
        ratio, coff, vec, n_vec, width = self.ratio, self.coff, self.vec, self.n_vec, self.width
        rS = cute.make_rmem_tensor((width, vec), Float32)
        rX = cute.make_rmem_tensor((width, vec), Float32)
        load_window(mKV, mS, gA, rS, rX, own0, has_prev, cv, ratio, coff, n_vec, vec, slots, ape_rows)
        rG = cute.make_rmem_tensor((vec,), Float32)
        if cutlass.const_expr(slots is not None):
            rG.store(widen_bf16(slots[2 * width, None].load(), vec))
        else:
            rG.store(gGO[(0, None), (row, cv)].load().to(Float32))
        rGKV = cute.make_rmem_tensor((width, vec), BFloat16)
        rGS = cute.make_rmem_tensor((width, vec), BFloat16)
        for v in cutlass.range_constexpr(vec):
            g = rG[v]
            # rS <- p, rX <- p * dp, then the left-to-right sum S
            ssum = weights_and_products(rS, rX, v, width, softmax_column(rS, v, width), g)
            for k in cutlass.range_constexpr(width):
                gs = rX[k, v] - mul_rn(rS[k, v], ssum)
                if cutlass.const_expr(coff == 2 and k < ratio):
                    # An invalid position (previous block of a first block) contributes nothing,
                    # as in the reference; its computed gs is 0 for finite inputs but NaN when den
                    # or S is (a NaN/Inf in the window).
                    if not has_prev:
                        gs = Float32(0.0)
                rPart[k, v] = rPart[k, v] + gs
                rGS[k, v] = gs.to(BFloat16)
                rGKV[k, v] = mul_rn(g, rS[k, v]).to(BFloat16)
        wGKV = window_view(mGKV, own0, ratio, coff, vec)
        wGS = window_view(mGS, own0, ratio, coff, vec)
        for k in cutlass.range_constexpr(width):  # window row k, as in load_window
            if cutlass.const_expr(coff == 2 and k < ratio):
                if has_prev:
                    wGKV[(0, None), (k, cv)].store(rGKV[k, None].load())
                    wGS[(0, None), (k, cv)].store(rGS[k, None].load())
            else:
                colt = cv + n_vec if cutlass.const_expr(coff == 2) else cv
                wGKV[(0, None), (k, colt)].store(rGKV[k, None].load())
                wGS[(0, None), (k, colt)].store(rGS[k, None].load())
        return wGKV, wGS

    @cute.jit
    def zero_unconsumed(self, wGKV, wGS, gGKV, gGS, own0, seg_end, cv):
        """A segment's last block (window views ``wGKV``, ``wGS`` from ``compute_row``): nobody
        consumes its first-half columns, nor the tail tokens up to ``seg_end``."""
        ratio, coff, vec, n_vec = self.ratio, self.coff, self.vec, self.n_vec
        if cutlass.const_expr(coff == 2):
            for i in cutlass.range_constexpr(ratio):
                store_zeros(wGKV, ratio + i, cv, vec, BFloat16)
                store_zeros(wGS, ratio + i, cv, vec, BFloat16)
        zero_tokens(gGKV, gGS, own0 + ratio, seg_end, 1, cv, coff, n_vec, vec)

    @cute.jit
    def stage_ahead(self, mKV, mS, mCu, mCuC, n_seg, gGO, sBuf, stage, ahead: cutlass.Constexpr, index,
                    rows_per_thread, row, step, t0, lo, hi, n_real, col_ok, cv, tidx):
        """Start the copies of the row ``ahead`` rows (``step`` apart) after this thread's ``row``
        (the thread's row number ``index``) into ``stage``, committed as one cp.async group (empty
        past its rows).

        ``row``'s segment (``t0``, ``lo``, ``hi``) places it unless it lies past that segment's end;
        then it takes a lookup of its own (with ``warp_rows`` the warp shares the row and votes
        together), so the thread keeps one row cursor, not one per stage."""
        srow = row + ahead * step
        if index < rows_per_thread and srow < n_real:
            s0 = t0
            slo = lo
            if srow >= hi:
                s0, slo, _, _ = row_span(mCu, mCuC, n_seg, srow, self.warp_rows, self.one_round_loads("bwd"))
            if col_ok:
                own0, has_prev = block_start(s0, srow - slo, self.ratio, mKV.shape[0])
                self.stage_row(mKV, mS, gGO, stage_slots(sBuf, stage, tidx), srow, own0, has_prev, cv)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def stage_row(self, mKV, mS, gGO, slots, row, own0, has_prev, cv):
        """Start the copies of one row's window and its grad_out slice into ``slots``."""
        stage_window(mKV, mS, slots, own0, has_prev, cv, self.ratio, self.coff, self.n_vec, self.vec)
        copy_async(gGO[(0, None), (row, cv)], slots[2 * self.width, None], self.vec)

    @cute.jit
    def reduce_lanes(self, rPart, mSlab, bx, by, tidx, cvl, lane):
        """Sum the CTA's row lanes in lane order and write this row group's slab."""
        ratio, vec, n_vec = self.ratio, self.vec, self.n_vec
        ct, lanes = self.sched.col_threads, self.sched.row_lanes
        tile_cols = ct * vec
        smem = SmemAllocator()
        sRed = smem.allocate_tensor(Float32, cute.make_layout((lanes, tile_cols), stride=(tile_cols, 1)), 16)
        col0 = by * tile_cols
        for k in cutlass.range_constexpr(self.width):
            for v in cutlass.range_constexpr(vec):
                sRed[lane, cvl * vec + v] = rPart[k, v]
            cute.arch.sync_threads()
            arow = k
            half = 0
            if cutlass.const_expr(self.coff == 2):
                arow = k % ratio
                half = k // ratio
            for idx in cutlass.range_constexpr(tidx_chunks(tile_cols, self.sched.threads)):
                c = idx * self.sched.threads + tidx
                if c < tile_cols and col0 + c < n_vec * vec:
                    acc = sRed[0, c]
                    if cutlass.const_expr(lanes <= UNROLLED_REDUCE_LANES):
                        for y in cutlass.range_constexpr(1, lanes):
                            acc = acc + sRed[y, c]
                    else:
                        # head_dim < 16: up to 256 row lanes; a traced loop of that length (times
                        # the window) took seconds to compile. Same lane order, same bits.
                        for y in cutlass.range(1, lanes, unroll=8):
                            acc = acc + sRed[y, c]
                    store_partial(mSlab, bx, arow, half * n_vec * vec + col0 + c, acc, self.atomic)
            cute.arch.sync_threads()


#: Row lanes up to which the slab's lane sum is unrolled at trace time (every head_dim >= 16).
UNROLLED_REDUCE_LANES = 64


def tidx_chunks(n: int, threads: int) -> int:
    return -(-n // threads)
