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
from cutlass import BFloat16, Float32, Int32
from cutlass.memory import SmemAllocator

from .common import (BackwardKernel, ape_tile, block_start, can_stage, copy_async, enter_grid,
                     load_window, mul_rn, nanosleep, prefetch_l2, row_span, softmax_column, stage_ape, stage_buffers,
                     stage_slots, stage_window, store_partial, store_zeros, weights_and_products,
                     widen_bf16, window_view, zero_fill_cta, zero_tokens)
from .schedule import (CTA_CLOCKS, FIRST_ROW_ALONE, WINDOW_BWD_L2_AHEAD, WINDOW_BWD_STAGES, WINDOW_BWD_STAGGER_NS,
                       WINDOW_BWD_STEAL_MIN_LEFT, WINDOW_BWD_STEAL_PROBE_US, WINDOW_BWD_STEAL_SCANS,
                       stages_ape_tile)


class WindowBackward(BackwardKernel):
    family = "window"

    @property
    def stages(self) -> int:
        stages = WINDOW_BWD_STAGES[f"c{self.coff}"]
        assert stages >= 2, f"CSA_FRONTEND_WINDOW_BWD_STAGES: at least 2 stages, got {stages}"
        if 0 < WINDOW_BWD_L2_AHEAD < stages or WINDOW_BWD_L2_AHEAD < 0:
            raise ValueError(f"CSA_FRONTEND_WINDOW_BWD_L2_AHEAD: 0 (off) or at least the {stages} pipeline "
                             f"stages (nearer rows are already being copied), got {WINDOW_BWD_L2_AHEAD}")
        return stages

    @cute.kernel
    def kernel(self, mKV, mS, mApe, mCu, mCuC, mGO, mGKV, mGS, mSlab,
               rows_per_thread, row_groups, zero_ctas, interleaved):
        self.body(mKV, mS, mApe, mCu, mCuC, mGO, mGKV, mGS, mSlab, rows_per_thread, row_groups, zero_ctas,
                  interleaved, None)

    @cute.jit
    def body(self, mKV, mS, mApe, mCu, mCuC, mGO, mGKV, mGS, mSlab, rows_per_thread, row_groups, zero_ctas,
             interleaved, mWork):
        """The kernel; ``mWork``: the stealing variant's claim words and flags (``StealingWindowBackward``),
        None for the static walk."""
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
            row, step = self.run_start(bx, rows_per_thread, row_groups, lane, interleaved)
            t0, lo, hi, t1 = row_span(mCu, mCuC, n_seg, row, self.warp_rows, self.one_round_loads("bwd"))
            # Rows of this thread's run it computes itself: all of them, unless (stealing) other
            # warps took rows from its back; then the first ``owned``.
            owned = rows_per_thread
            steals = cutlass.const_expr(mWork is not None)
            pending = Int32(-1)
            unit = Int32(0)
            if cutlass.const_expr(steals):
                assert staged, "row stealing needs the staged (cp.async) walk"
                unit = self.unit_of(by, bx, row_groups, tidx // 32)
            if cutlass.const_expr(staged):
                for p in cutlass.range_constexpr(stages - 1):
                    if cutlass.const_expr(steals):
                        if not self.claim_granted(self.claim_issue(mWork, unit, p, owned, rows_per_thread), p,
                                                  rows_per_thread):
                            owned = cutlass.min(owned, p)
                    self.stage_ahead(mKV, mS, mCu, mCuC, n_seg, gGO, sBuf, p, p, p, owned, row, step, t0,
                                     lo, hi, n_real, col_ok, cv, tidx)
                if cutlass.const_expr(steals):
                    pending = self.claim_issue(mWork, unit, stages - 1, owned, rows_per_thread)
                    if cutlass.const_expr(WINDOW_BWD_STEAL_PROBE_US > 0):
                        if bx == 0:  # tests: CTA 0 falls behind after its first claims
                            for _ in cutlass.range(WINDOW_BWD_STEAL_PROBE_US, unroll=1):
                                nanosleep(1000)
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
                if cutlass.const_expr(steals):
                    # the claim of the row staged now went out an iteration ago; the next one's goes now
                    ahead = it + stages - 1
                    if ahead < rows_per_thread:
                        if not self.claim_granted(pending, ahead, rows_per_thread):
                            owned = cutlass.min(owned, ahead)
                        pending = self.claim_issue(mWork, unit, ahead + 1, owned, rows_per_thread)
                if cutlass.const_expr(staged):
                    self.stage_ahead(mKV, mS, mCu, mCuC, n_seg, gGO, sBuf, (it + stages - 1) % stages, stages - 1,
                                     it + stages - 1, owned, row, step, t0, lo, hi, n_real, col_ok, cv,
                                     tidx)
                    if cutlass.const_expr(WINDOW_BWD_L2_AHEAD > 0):
                        if tidx == 0 and by == 0:
                            self.prefetch_ahead(mKV, mS, mGO, row + WINDOW_BWD_L2_AHEAD * step,
                                                it + WINDOW_BWD_L2_AHEAD, rows_per_thread, n_real, t0, lo)
                    cute.arch.cp_async_wait_group(stages - 1)
                    slots = stage_slots(sBuf, it % stages, tidx)
                this_row = row
                own0, has_prev = block_start(t0, row - lo, ratio, n_tok)
                last_blk = row - lo == hi - lo - 1
                seg_end = t1
                row = row + step
                if row >= hi:
                    t0, lo, hi, t1 = row_span(mCu, mCuC, n_seg, row, self.warp_rows, self.one_round_loads("bwd"))
                if cutlass.const_expr(steals):
                    if it >= owned:
                        this_row = n_real  # taken by another warp, which computes it
                if this_row < n_real and col_ok:
                    wGKV, wGS = self.compute_row(mKV, mS, gA, gGO, mGKV, mGS, rPart, slots, this_row, own0,
                                                 has_prev, cv, ape_rows)
                    if last_blk:
                        # its segment's last block: nobody consumes its first-half columns, nor the tail
                        self.zero_unconsumed(wGKV, wGS, gGKV, gGS, own0, seg_end, cv)
            if cutlass.const_expr(steals):
                park = None
                if cutlass.const_expr(not self.atomic):
                    # the own rows' partials wait in this thread's own (now idle) stage slots
                    # while rPart serves the stolen rows: two sets in registers took 154
                    # registers, not 128. Its own slots only: other warps may still be walking.
                    cute.arch.cp_async_wait_group(0)
                    park = self.park_view(sBuf)
                    for k in cutlass.range_constexpr(width):
                        for v in cutlass.range_constexpr(vec):
                            park[k * vec + v, tidx] = rPart[k, v]
                self.steal_rows(mKV, mS, gA, gGO, mGKV, mGS, gGKV, gGS, mCu, mCuC, mSlab, mWork, rPart, n_seg,
                                n_real, row_groups, rows_per_thread, interleaved, col_ok, cv, by, tidx, lane, ape_rows)
                if cutlass.const_expr(not self.atomic):
                    for k in cutlass.range_constexpr(width):
                        for v in cutlass.range_constexpr(vec):
                            rPart[k, v] = park[k * vec + v, tidx]
                    self.collect_stolen(mSlab, mWork, unit, rPart, row_groups, rows_per_thread, owned, tidx)
                if tidx % 32 == 0:  # every thief's CAS on this word has failed or landed: zeroed for the next launch
                    cute.arch.store(self.claim_word(mWork, unit), Int32(0), sem="relaxed", scope="gpu")
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
    def prefetch_ahead(self, mKV, mS, mGO, prow, index, rows_per_thread, n_real, t0, lo):
        """``WINDOW_BWD_L2_AHEAD``: L2 prefetch of the token rows under this CTA's rows at thread
        row ``index`` (its row lanes: ``lanes`` consecutive rows from ``prow``), placed by the
        segment of the row computed now (``t0``, ``lo``)."""
        lanes, ratio, coff = self.sched.row_lanes, self.ratio, self.coff
        if index < rows_per_thread and prow < n_real:
            first = t0 + (prow - lo) * ratio - (coff - 1) * ratio
            last = t0 + (prow + lanes - lo) * ratio
            first = cutlass.max(first, 0)
            last = cutlass.min(last, mKV.shape[0])
            if last > first:
                prefetch_l2(mKV, first, last - first)
                prefetch_l2(mS, first, last - first)
            prefetch_l2(mGO, prow, cutlass.min(prow + lanes, n_real) - prow)

    @cute.jit
    def run_start(self, group, rows, row_groups, lane, interleaved):
        """(first row, step between rows) of row lane ``lane``'s run in row group ``group``."""
        lanes = self.sched.row_lanes
        step = lanes
        row = group * rows * lanes + lane
        if interleaved != 0:
            step = row_groups * lanes
            row = group * lanes + lane
        return row, step

    # ---- row stealing (``WINDOW_BWD_STEAL``; ``StealingWindowBackward``) ----------------------
    # mWork (int32, zero between launches): one word per warp of the grid, ``unit`` =
    # (column tile * row groups + CTA) * warps + warp: low 16 bits the rows its owner has claimed
    # from the front, high 16 bits the rows thieves have taken from the back (at most
    # ``sched.steal``); then one flag per (unit, back slot): set when a thief has written that
    # row's grad_ape contributions, cleared by the owner once added. Only the last ``steal``
    # rows of a run are ever taken, so the owner adds its other rows' claims without waiting
    # for the answer (a reduction), and its back rows' a row early.

    @property
    def warps(self) -> int:
        return self.sched.threads // 32

    def unit_of(self, tile, group, row_groups, warp):
        """Index of the run (claim word) of warp ``warp`` of row group ``group`` in column tile ``tile``."""
        return (tile * row_groups + group) * self.warps + warp

    def claim_word(self, mWork, unit):
        """Pointer to claim word ``unit``."""
        return (mWork.iterator + unit).llvm_ptr

    def back_flag(self, mWork, unit, back, row_groups):
        """Pointer to the flag of back slot ``back`` of run ``unit`` (after the grid's words)."""
        n_units = self.sched.col_tiles * row_groups * self.warps
        return (mWork.iterator + (n_units + unit * self.sched.steal + back)).llvm_ptr

    def parts_slot(self, unit, back):
        """``parts_view``'s slot of back slot ``back`` of run ``unit`` (per CTA, not per warp:
        a CTA's warps hold different threads' values of it)."""
        return unit // self.warps * self.sched.steal + back

    @cute.jit
    def claim_issue(self, mWork, unit, index, owned, rows) -> Int32:
        """Claim row ``index`` of this warp's run (lane 0; in row order). Returns the word before
        the claim for a back row, whose answer matters (``claim_granted``), else -1."""
        old = Int32(-1)
        if index < rows and index < owned and cute.arch.lane_idx() == 0:
            ptr = self.claim_word(mWork, unit)
            if index < rows - self.sched.steal:
                cute.arch.atomic_add(ptr, Int32(1), sem="relaxed", scope="gpu")
            else:
                old = cute.arch.atomic_add(ptr, Int32(1), sem="relaxed", scope="gpu")
        return old

    @cute.jit
    def claim_granted(self, pending, index, rows):
        """Whether the owner keeps row ``index``, from its claim's word (``claim_issue``): rows
        before the back ones always; a back row while front + back claims stay under ``rows``."""
        word = cute.arch.shuffle_sync(pending, 0)
        granted = index < rows - self.sched.steal
        if not granted:
            granted = (word & 0xFFFF) + (word >> 16) < rows
        return granted

    @cute.jit
    def steal_rows(self, mKV, mS, gA, gGO, mGKV, mGS, gGKV, gGS, mCu, mCuC, mSlab, mWork, rPart, n_seg, n_real,
                   row_groups, rows, interleaved, col_ok, cv, by, tidx, lane, ape_rows):
        """After its own rows: take rows from the back of the runs of the same warp in other
        CTAs of this column tile, the one with the most rows its owner has not claimed first,
        until none has any left (or ``WINDOW_BWD_STEAL_SCANS`` scans). Each stolen row is
        computed as its owner would (same lane, same columns); its grad_ape contributions are
        added to ``rPart`` (atomic variant) or written there alone and handed to the owner
        (``publish_stolen``)."""
        steal = self.sched.steal
        warp = tidx // 32
        wl = tidx % 32
        scans = Int32(0)
        looking = Int32(1)
        while looking != 0:
            best = Int32(-1)
            best_word = Int32(0)
            for victim in cutlass.range(wl, row_groups, 32, unroll=1):
                word = cute.arch.load(self.claim_word(mWork, self.unit_of(by, victim, row_groups, warp)), Int32,
                                      sem="relaxed", scope="gpu")
                front = word & 0xFFFF
                back = word >> 16
                left = rows - front - back
                # front >= 1: the owner has started (a zeroed word is never a CAS's expected value)
                if front >= 1 and back < steal and left >= WINDOW_BWD_STEAL_MIN_LEFT:
                    key = cutlass.min(left, 255) * 65536 + victim
                    if key > best:
                        best = key
                        best_word = word
            for sh in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_bfly(best, offset=1 << (4 - sh))
                best = cutlass.max(best, other)
            looking = Int32(0)
            if best >= 0:
                victim = best & 0xFFFF
                expected = cute.arch.shuffle_sync(best_word, victim % 32)
                seen = Int32(0)
                if wl == 0:
                    seen = cute.arch.atomic_cas(self.claim_word(mWork, self.unit_of(by, victim, row_groups, warp)),
                                                cmp=expected, val=expected + 65536, sem="relaxed", scope="gpu")
                seen = cute.arch.shuffle_sync(seen, 0)
                if seen == expected:
                    if cutlass.const_expr(WINDOW_BWD_STEAL_PROBE_US > 0):
                        if wl == 0:
                            cute.arch.atomic_add((mWork.iterator + (mWork.shape[0] - 1)).llvm_ptr, Int32(1),
                                                 sem="relaxed", scope="gpu")
                    back = expected >> 16
                    index = rows - 1 - back
                    start, step = self.run_start(victim, rows, row_groups, lane, interleaved)
                    row = start + index * step
                    t0, lo, hi, t1 = row_span(mCu, mCuC, n_seg, row, self.warp_rows, self.one_round_loads("bwd"))
                    own0, has_prev = block_start(t0, row - lo, self.ratio, mKV.shape[0])
                    last_blk = row - lo == hi - lo - 1
                    if cutlass.const_expr(not self.atomic):
                        rPart.fill(0.0)  # the row's own contributions (the owner's partials are parked)
                    if row < n_real and col_ok:
                        wGKV, wGS = self.compute_row(mKV, mS, gA, gGO, mGKV, mGS, rPart, None, row, own0, has_prev,
                                                     cv, ape_rows)
                        if last_blk:
                            self.zero_unconsumed(wGKV, wGS, gGKV, gGS, own0, t1, cv)
                    if cutlass.const_expr(not self.atomic):
                        self.publish_stolen(mSlab, mWork, rPart, row_groups, self.unit_of(by, victim, row_groups, warp),
                                            back, tidx)
                scans = scans + 1
                if scans < WINDOW_BWD_STEAL_SCANS:
                    looking = Int32(1)

    def park_view(self, sBuf):
        """The stage slots as fp32, ``(value, thread)``: a thread's slot rows (every stage's) hold
        ``stages * (2 * width + 1) * vec / 2`` fp32 values, ``vec / 2`` per slot row, at least the
        ``width * vec`` of its partials."""
        half = self.vec // 2
        rows = self.stages * (2 * self.width + 1)
        threads = self.sched.threads
        return cute.make_tensor(cute.recast_ptr(sBuf.iterator, dtype=Float32),
                                cute.make_layout(((half, rows), threads), stride=((1, threads * half), half)))

    @cute.jit
    def parts_view(self, mSlab, row_groups):
        """The stolen rows' grad_ape contributions, after the slabs in the same allocation:
        ``(slot, window value, thread)`` with slot = (column tile * row groups + owner CTA) *
        steal + back slot; consecutive threads consecutive, so a warp's stores coalesce."""
        wv = self.width * self.vec
        threads = self.sched.threads
        base = row_groups * mSlab.shape[1] * mSlab.shape[2]
        n_slots = self.sched.col_tiles * row_groups * self.sched.steal
        return cute.make_tensor(mSlab.iterator + base,
                                cute.make_layout((n_slots, wv, threads), stride=(wv * threads, threads, 1)))

    @cute.jit
    def publish_stolen(self, mSlab, mWork, rTaken, row_groups, unit, back, tidx):
        """Hand a stolen row (back slot ``back`` of run ``unit``)'s grad_ape contributions to its
        owner: store them, then raise the slot's flag with release order (every lane's stores
        before it, through the warp barrier)."""
        gParts = self.parts_view(mSlab, row_groups)
        slot = self.parts_slot(unit, back)
        for k in cutlass.range_constexpr(self.width):
            for v in cutlass.range_constexpr(self.vec):
                gParts[slot, k * self.vec + v, tidx] = rTaken[k, v]
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_warp()
        if tidx % 32 == 0:
            cute.arch.store(self.back_flag(mWork, unit, back, row_groups), Int32(1), sem="release", scope="gpu")

    @cute.jit
    def collect_stolen(self, mSlab, mWork, unit, rPart, row_groups, rows, owned, tidx):
        """Add the rows thieves took from this warp's run (``owned`` on) in row order, as the
        static walk would have, each once its flag is up; then lower the flag."""
        gParts = self.parts_view(mSlab, row_groups)
        for index in cutlass.range(owned, rows, unroll=1):
            back = rows - 1 - index
            flag = self.back_flag(mWork, unit, back, row_groups)
            up = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
            while up == 0:
                nanosleep(64)
                up = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
            slot = self.parts_slot(unit, back)
            for k in cutlass.range_constexpr(self.width):
                for v in cutlass.range_constexpr(self.vec):
                    rPart[k, v] = rPart[k, v] + gParts[slot, k * self.vec + v, tidx]
            cute.arch.sync_warp()
            if tidx % 32 == 0:
                cute.arch.store(flag, Int32(0), sem="relaxed", scope="gpu")

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


class StealingWindowBackward(WindowBackward):
    """``WindowBackward`` with row stealing (``schedule.WINDOW_BWD_STEAL``): launched with the
    claim workspace ``mWork`` and, on the deterministic path, a slab tensor with room for the
    stolen rows' contributions after its ``row_groups`` slabs (``WindowBackward.parts_view``)."""

    @cute.jit
    def __call__(self, mKV: cute.Tensor, mS: cute.Tensor, mApe: cute.Tensor, mCu: cute.Tensor, mCuC: cute.Tensor,
                 mGO: cute.Tensor, mGKV: cute.Tensor, mGS: cute.Tensor, mSlab: cute.Tensor, mWork: cute.Tensor,
                 rows_per_group: Int32, row_groups: Int32, zero_ctas: Int32, interleaved: Int32, stream):
        self.launch_grid(self.stealing_kernel(mKV, mS, mApe, mCu, mCuC, mGO, mGKV, mGS, mSlab, mWork,
                                              rows_per_group, row_groups, zero_ctas, interleaved),
                         row_groups, zero_ctas, stream)

    @cute.kernel
    def stealing_kernel(self, mKV, mS, mApe, mCu, mCuC, mGO, mGKV, mGS, mSlab, mWork,
                        rows_per_thread, row_groups, zero_ctas, interleaved):
        self.body(mKV, mS, mApe, mCu, mCuC, mGO, mGKV, mGS, mSlab, rows_per_thread, row_groups, zero_ctas,
                  interleaved, mWork)


#: Row lanes up to which the slab's lane sum is unrolled at trace time (every head_dim >= 16).
UNROLLED_REDUCE_LANES = 64


def tidx_chunks(n: int, threads: int) -> int:
    return -(-n // threads)
