"""Stream-family forward: a CTA pools rows one at a time, each row's window split in chunks.

For windows too wide for one thread's registers (large ratio). Thread ``(c, col)`` owns window
positions ``[c*chunk, (c+1)*chunk)`` of column slice ``col`` for every row the CTA walks, so
its slice of ``ape`` is loaded into registers once (``ape`` is as many bytes per row as kv and
score together: re-reading it per row doubled the traffic into the SMs). Every input element
is read from DRAM exactly once.

Softmax by partials: a warp takes ``m``, the exact max over its chunks (a shuffle butterfly,
so every lane agrees), and sums ``d = sum exp(s - m)`` and ``a = sum kv * exp(s - m)`` down
the warp in chunk order. The warps' ``(m, d, a)`` partials meet in shared memory; one thread
per column takes their max and adds every warp's sums rescaled by ``exp(m_w - max)`` in warp
order (``merge_groups``), and ``out = a / d`` rounds once to bf16. One barrier per row (the
partial buffers alternate between rows), and no per-element division. The merge order is
fixed, so outputs are bitwise reproducible; they differ from the reference by re-association
only (tolerance contract, docs/csa_compressor.md).

Grid: x over groups of ``rows_per_cta`` rows (one contiguous run each, or interleaved with
the other groups' rows: ``fwd_interleaved``), y over column tiles of ``col_threads`` slices.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.memory import SmemAllocator

from .common import (HALF_LOG2E, PoolingKernel, add_in_order, block_start, can_stage, enter_grid,
                     exp2_half_squared, fma_rn, guessed_block_start, padding_bound, padding_row_exact, row_span,
                     safe_max, stage_buffers, stage_slots)
from .stream_chunks import (ape_slice, gather_scores, invalid_position, stage_any_chunk, warp_chunks_max,
                            warp_chunks_sum)
from .schedule import (EXACT_PADDING_ROWS, FIRST_ROW_ALONE, STREAM_FAST_EXP, STREAM_FWD_GUESS, STREAM_FWD_STAGED,
                       chunks_per_warp, stream_fwd_may_interleave, warp_groups)


@cute.jit
def exp_shifted(s: Float32, m: Float32, m_scaled: Float32, fast: cutlass.Constexpr) -> Float32:
    """``exp(s - m)``: libdevice ``expf``, or with ``fast`` one FMA and ``exp2_half_squared``
    (``m_scaled`` = ``m * log2(e) / 2``, once per column)."""
    r = Float32(0.0)
    if cutlass.const_expr(fast):
        r = exp2_half_squared(fma_rn(s, Float32(HALF_LOG2E), -m_scaled))
    else:
        r = cute.math.exp(s - m)
    return r


@cute.jit
def relative_sums(rS: cute.Tensor, rX: cute.Tensor, v: cutlass.Constexpr, n: cutlass.Constexpr, m: Float32,
                  fast: cutlass.Constexpr):
    """(``sum e``, ``sum kv e``, the max's ``top_scaled``) of column ``v`` over positions ``[0, n)``
    of ``rS`` (scores) and ``rX`` (kv), with ``e = exp(s - m)`` (``m`` through ``safe_max``),
    added in position order."""
    ms = safe_max(m)
    ms_scaled = ms * Float32(HALF_LOG2E)
    d = Float32(0.0)
    a = Float32(0.0)
    for i in cutlass.range_constexpr(n):
        e = exp_shifted(rS[i, v], ms, ms_scaled, fast)
        d = d + e
        a = a + rX[i, v] * e
    return d, a, ms_scaled


@cute.jit
def rescale_factor(m: Float32, top: Float32, top_scaled: Float32, fast: cutlass.Constexpr) -> Float32:
    """``exp(m - top)`` (``top_scaled`` as for ``exp_shifted``) for rescaling softmax partials
    taken relative to ``m`` to a max ``top``: exactly 1 where ``m`` is that max."""
    return Float32(cutlass.select_(m == top, Float32(1.0), exp_shifted(m, top, top_scaled, fast)))


@cute.jit
def merge_groups(sM: cute.Tensor, sD: cute.Tensor, sA: cute.Tensor, par: Int32, j: Int32,
                 groups: cutlass.Constexpr, fast: cutlass.Constexpr):
    """``a / d`` of column ``j`` from the warp groups' softmax partials ``(max, sum exp(s - max),
    sum kv exp(s - max))``: the window max first, then every group's sums rescaled once by
    ``exp(m_g - max)`` (exactly 1 for the group that holds the max, 0 for one that saw only
    -inf) and added in group order. The rescalings are independent of each other: a pairwise
    merge had chained ``groups - 1`` of them through one thread per column. NaN in any
    partial's sums stays NaN, as in the reference."""
    m = sM[par, 0, j]
    for g in cutlass.range_constexpr(1, groups):
        m = cute.arch.fmax(m, sM[par, g, j])
    top = safe_max(m)
    top_scaled = top * Float32(HALF_LOG2E)
    d = Float32(0.0)
    a = Float32(0.0)
    for g in cutlass.range_constexpr(groups):
        mg = sM[par, g, j]
        f = rescale_factor(mg, top, top_scaled, fast)
        d = add_in_order(d, sD[par, g, j] * f, g == 0)
        a = add_in_order(a, sA[par, g, j] * f, g == 0)
    return a / d


@cute.jit
def request_row(mKV: cute.Tensor, mS: cute.Tensor, slots: cute.Tensor, own0: Int32, has_prev: cutlass.Boolean,
                active: cutlass.Boolean, cv: Int32, k0: Int32, chunk: cutlass.Constexpr, ratio: cutlass.Constexpr,
                coff: cutlass.Constexpr, n_vec: cutlass.Constexpr, vec: cutlass.Constexpr):
    """Start copying one row's chunk into ``slots``, committed as one group."""
    if active:
        stage_any_chunk(mKV, mS, slots, own0, has_prev, cv, k0, chunk, ratio, coff, n_vec, vec)
    cute.arch.cp_async_commit_group()


def merge_buffers(groups: int, tile_cols: int):
    """Shared (m, d, a) partials: two row parities x warp groups x the tile's columns."""
    smem = SmemAllocator()
    layout = cute.make_layout((2, groups, tile_cols), stride=(groups * tile_cols, tile_cols, 1))
    return tuple(smem.allocate_tensor(Float32, layout, 16) for _ in range(3))


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
        interleaved: Int32,
        stream,
    ):
        self.kernel(mKV, mS, mApe, mCu, mCuC, mOut, rows_per_cta, interleaved).launch(
            grid=((mOut.shape[0] + rows_per_cta - 1) // rows_per_cta, self.sched.col_tiles, 1),
            block=(self.sched.threads, 1, 1),
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(self, mKV, mS, mApe, mCu, mCuC, mOut, rows_per_cta, interleaved):
        enter_grid(self.pdl)
        vec, n_vec, chunk = self.vec, self.n_vec, self.sched.chunk
        ct, threads = self.sched.col_threads, self.sched.threads
        per_warp = chunks_per_warp(ct)
        groups = warp_groups(self.sched)  # warp partials merged through shared memory
        tile_cols = ct * vec
        fast = STREAM_FAST_EXP
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        col = tidx % ct
        c = tidx // ct
        k0 = c * chunk
        cv = by * ct + col
        active = cv < n_vec
        n_seg = mCu.shape[0] - 1
        n_rows = mOut.shape[0]
        sM, sD, sA = merge_buffers(groups, tile_cols)

        rA = ape_slice(mApe, active, cv, k0, chunk, self.ratio, self.coff, n_vec, vec)

        # Software pipeline over the CTA's rows: the next row is in flight into the other
        # shared-memory stage while this row is reduced; each thread reads only the slots it
        # copied. Rows are looked up incrementally (``row_span``): a search only when a row
        # leaves its segment, as dependent loads of the offsets stalled every row.
        staged = can_stage(vec) and STREAM_FWD_STAGED[f"c{self.coff}"] == 1
        sBuf = stage_buffers(chunk, threads, vec) if cutlass.const_expr(staged) else None
        row, step = self.cta_walk(bx, rows_per_cta, interleaved)
        guess = staged and STREAM_FWD_GUESS
        if cutlass.const_expr(guess):
            # the first row requested before its lookup answers, where a launch of T / ratio
            # rows makes row * ratio its first token (STREAM_FWD_GUESS); checked below
            whole, g_own0, g_has_prev = guessed_block_start(row, n_rows, self.ratio, mKV.shape[0])
            if whole:
                request_row(mKV, mS, stage_slots(sBuf, 0, tidx), g_own0, g_has_prev, active, cv, k0, chunk,
                            self.ratio, self.coff, n_vec, vec)
        t0, lo, hi, _ = row_span(mCu, mCuC, n_seg, row, False, self.one_round_loads("fwd"))
        # the padding pass's bound, loaded beside the first lookup: after the loop it would be a
        # dependent round trip at the end of every CTA
        n_real = padding_bound(mCuC, n_seg)
        own0, has_prev = block_start(t0, row - lo, self.ratio, mKV.shape[0])
        if cutlass.const_expr(staged):
            if cutlass.const_expr(guess):
                if not whole or own0 != g_own0 or has_prev != g_has_prev:
                    cute.arch.cp_async_wait_group(0)  # a wrong guess's copies land before the slots are reused
                    request_row(mKV, mS, stage_slots(sBuf, 0, tidx), own0, has_prev, active, cv, k0, chunk,
                                self.ratio, self.coff, n_vec, vec)
            else:
                if row < n_rows and active:
                    stage_any_chunk(mKV, mS, stage_slots(sBuf, 0, tidx), own0, has_prev, cv, k0, chunk, self.ratio,
                                    self.coff, n_vec, vec)
                cute.arch.cp_async_commit_group()
            if cutlass.const_expr(FIRST_ROW_ALONE):
                cute.arch.cp_async_wait_group(0)
        for it in cutlass.range(rows_per_cta, unroll=1):
            nrow = row + step
            if nrow >= hi:
                t0, lo, hi, _ = row_span(mCu, mCuC, n_seg, nrow, False, self.one_round_loads("fwd"))
            nown0, nhas_prev = block_start(t0, nrow - lo, self.ratio, mKV.shape[0])
            slots = None
            if cutlass.const_expr(staged):
                if it + 1 < rows_per_cta and nrow < n_rows and active:
                    stage_any_chunk(mKV, mS, stage_slots(sBuf, (it + 1) % 2, tidx), nown0, nhas_prev, cv, k0,
                                    chunk, self.ratio, self.coff, n_vec, vec)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(1)
                slots = stage_slots(sBuf, it % 2, tidx)
            if row < n_rows:
                rS = cute.make_rmem_tensor((chunk, vec), Float32)
                rX = cute.make_rmem_tensor((chunk, vec), Float32)
                if cutlass.const_expr(staged):
                    # no test: a column thread past head_dim computes on stale slots of its own and
                    # its columns are never stored (they meet no other column in any reduction)
                    gather_scores(mKV, mS, rA, rS, rX, own0, has_prev, cv, k0, chunk, self.ratio, self.coff,
                                  n_vec, vec, slots)
                elif active:
                    gather_scores(mKV, mS, rA, rS, rX, own0, has_prev, cv, k0, chunk, self.ratio, self.coff,
                                  n_vec, vec, None)
                else:
                    for i in cutlass.range_constexpr(chunk):
                        invalid_position(rS, rX, i, vec)
                par = it % 2
                # this thread's partials (max, d, a), stored below as one vector each
                rM = cute.make_rmem_tensor((vec,), Float32)
                rD = cute.make_rmem_tensor((vec,), Float32)
                rSum = cute.make_rmem_tensor((vec,), Float32)
                for v in cutlass.range_constexpr(vec):
                    # max over the warp's chunks (exact, so every lane agrees), then sums
                    # relative to it, added in chunk order down the warp
                    m = warp_chunks_max(rS, v, chunk, ct)
                    d, a, _ = relative_sums(rS, rX, v, chunk, m, fast)
                    d, a = warp_chunks_sum(d, a, ct)
                    rM[v] = m
                    rD[v] = d
                    rSum[v] = a
                if c % per_warp == 0:
                    # one vector store per partial instead of vec scalar ones: the MIO pipe is
                    # what the narrower forwards wait on (NOTES row 43)
                    g = c // per_warp
                    for buf, val in ((sM, rM), (sD, rD), (sA, rSum)):
                        cute.zipped_divide(buf, (1, 1, vec))[(0, 0, None), (par, g, col)].store(val.load())
                cute.arch.sync_threads()
                # warp partials merged in order; the merging warp rotates with the row
                for q in cutlass.range_constexpr(-(-tile_cols // threads)):
                    j = (tidx + 32 * it) % threads + q * threads
                    if j < tile_cols and by * ct + j // vec < n_vec:
                        mOut[row, by * tile_cols + j] = merge_groups(sM, sD, sA, par, j, groups, fast).to(BFloat16)
            row, own0, has_prev = nrow, nown0, nhas_prev
        if cutlass.const_expr(EXACT_PADDING_ROWS):
            self.exact_padding_rows(mKV, mS, mApe, n_real, mOut, rows_per_cta, interleaved, tidx, bx, by)

    @cute.jit
    def cta_walk(self, bx, rows_per_cta, interleaved):
        """(first row, row step) of this CTA's rows: one contiguous run, or, interleaved, the
        grid's row CTAs apart, so that the whole grid reads one region of the pack at a time
        (``fwd_interleaved``; compiled in where ``stream_fwd_may_interleave``)."""
        first = bx * rows_per_cta
        step = Int32(1)
        if cutlass.const_expr(stream_fwd_may_interleave(self.coff)):
            if interleaved != 0:
                first = bx
                step = cute.arch.grid_dim()[0]
        return first, step

    @cute.jit
    def exact_padding_rows(self, mKV, mS, mApe, n_real, mOut, rows_per_cta, interleaved, tidx, bx, by):
        """After the row loop: this CTA's padding rows (``row >= cu_seqlens_comp[-1]``) again, in
        the reference's steps (``padding_row_exact``, one thread per column, once per CTA). Every
        padding row pools the same window, so a column the re-associated sums round one bf16
        step off would be off on every padding row (``EXACT_PADDING_ROWS``). The CTA's rows are
        recomputed here rather than carried through the loop."""
        ct, threads, vec, n_vec = self.sched.col_threads, self.sched.threads, self.vec, self.n_vec
        tile_cols = ct * vec
        first, step = self.cta_walk(bx, rows_per_cta, interleaved)
        n_rows = mOut.shape[0]
        # rows first + i * step, i < rows_per_cta, inside [n_real, n_rows): i in [lo, hi]
        lo = Int32(0)
        if first < n_real:
            lo = (n_real - first + step - 1) // step
        hi = cutlass.min(rows_per_cta - 1, (n_rows - 1 - first) // step)
        if lo <= hi:
            cute.arch.sync_threads()  # the loop's stores of these rows, by other threads, land first
            for q in cutlass.range_constexpr(-(-tile_cols // threads)):
                j = tidx + q * threads
                if j < tile_cols and by * ct + j // vec < n_vec:
                    col = by * tile_cols + j
                    val = padding_row_exact(mKV, mS, mApe, col, self.ratio, self.coff, self.head_dim).to(BFloat16)
                    for i in cutlass.range(lo, hi + 1, unroll=1):
                        mOut[first + i * step, col] = val
