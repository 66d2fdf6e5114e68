"""Register-window forward fed by bulk copies: a producer warp streams whole blocks into shared
memory while the consumer warps pool rows out of it.

Why: the per-thread forward (``window_fwd``) issues its loads and then computes, so a warp has
loads in flight only between its row lookup and its first ``exp``; with arithmetic at ~70% of
the memory time that leaves DRAM idle for much of each thread's life. Here one thread of a
producer warp keeps ``stages - 2`` stages of input in flight per CTA through the copy engine
(``cp.async.bulk``, one instruction per block, completion counted in bytes on an mbarrier),
and the row lookups leave the consumers' critical path: they wait on a barrier, read their
window from shared memory and compute exactly what ``WindowForward`` computes (same order,
same bits).

A stage is ``row_lanes`` consecutive output rows; the CTA walks a contiguous run of stages.
Each row's own block (``ratio`` token rows of kv or score, all ``coff * head_dim`` columns:
contiguous in memory) is one copy. With coff 2 a row also reads its previous block, which is
the own block of the row before it whenever it is valid (same segment), so it comes from the
previous row's slot - in the same stage, or the last row of the stage before, whose slot is
therefore released one stage late - and only a CTA's first row copies it separately.
Padding rows (``row >= cu_seqlens_comp[-1]``) pool segment 0's first block.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.experimental.primitives.nvvm_wrapper import cp_async_bulk_shared_cluster_global
from cutlass.memory import SmemAllocator

from .common import (PoolingKernel, block_start, enter_grid, find_segment, load_window, padding_bound, padding_row,
                     stage_ape)
from .schedule import WINDOW_FWD_BULK_CTAS_PER_SM, WINDOW_FWD_BULK_RAMP, bulk_block_bytes
from .window_fwd import pool_and_store


class WindowForwardBulk(PoolingKernel):
    family = "window"

    def __init__(self, ratio: int, coff: int, head_dim: int, sched, pdl: bool = False):
        super().__init__(ratio, coff, head_dim, sched, pdl=pdl)
        assert sched.stages >= 3 and sched.col_tiles == 1, sched
        self.stages = sched.stages
        self.consumers = -(-sched.threads // 32) * 32  # consumer threads: whole warps
        self.block_bytes = bulk_block_bytes(ratio, coff, head_dim)

    @cute.jit
    def __call__(
        self,
        mKV: cute.Tensor,  # (T, coff*d) bf16
        mS: cute.Tensor,  # (T, coff*d) bf16
        mApe: cute.Tensor,  # (ratio, coff*d) fp32
        mCu: cute.Tensor,  # (B+1,) int32
        mCuC: cute.Tensor,  # (B+1,) int32
        mOut: cute.Tensor,  # (total_comp, d) bf16
        stages_per_cta: Int32,
        stream,
    ):
        n_stages = (mOut.shape[0] + self.sched.row_lanes - 1) // self.sched.row_lanes
        self.kernel(mKV, mS, mApe, mCu, mCuC, mOut, stages_per_cta).launch(
            grid=((n_stages + stages_per_cta - 1) // stages_per_cta, 1, 1),
            block=(self.consumers + 32, 1, 1),
            stream=stream,
            use_pdl=self.pdl,
            min_blocks_per_mp=WINDOW_FWD_BULK_CTAS_PER_SM,
            preferred_smem_carveout=100,
        )

    @cute.kernel
    def kernel(self, mKV, mS, mApe, mCu, mCuC, mOut, stages_per_cta):
        enter_grid(self.pdl)
        S, G, ratio, coff = self.stages, self.sched.row_lanes, self.ratio, self.coff
        cols = coff * self.head_dim
        n_blocks = S * G + 1  # every stage's rows, then a CTA's first previous block
        smem = SmemAllocator()
        blocks = cute.make_layout((n_blocks * ratio, cols), stride=(cols, 1))
        sKV = smem.allocate_tensor(BFloat16, blocks, 128)
        sS = smem.allocate_tensor(BFloat16, blocks, 128)
        sPrev = smem.allocate_tensor(Int32, cute.make_layout((S, G), stride=(G, 1)), 16)
        full = smem.allocate_array(Int64, S, byte_alignment=8)
        empty = smem.allocate_array(Int64, S, byte_alignment=8)

        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        if tidx == 0:
            for x in cutlass.range_constexpr(S):
                cute.arch.mbarrier_init(full + x, 1)
                # every consumer thread arrives: a warp electing one lane after __syncwarp left
                # its other lanes' reads unordered for compute-sanitizer's racecheck (3 hazards;
                # same speed either way on the H200)
                cute.arch.mbarrier_init(empty + x, self.consumers)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        n_stages = (mOut.shape[0] + G - 1) // G
        first = bx * stages_per_cta
        count = cutlass.min(first + stages_per_cta, n_stages) - first
        if tidx == self.consumers:
            self.produce(mKV, mS, mCu, mCuC, mOut.shape[0], sKV, sS, sPrev, full, empty, first, count)
        elif tidx < self.consumers:
            self.consume(mKV, mS, mApe, mCuC, mOut, sKV, sS, sPrev, full, empty, first, count, tidx)

    @cute.jit
    def produce(self, mKV, mS, mCu, mCuC, n_out, sKV, sS, sPrev, full, empty, first, count):
        """One thread: per stage, wait for its slot to be released, place each row (a cursor over
        the current segment; a search only for the CTA's first row), copy its own block of kv and
        score, and arrive once all copies of the stage are issued."""
        S, G, ratio = self.stages, self.sched.row_lanes, self.ratio
        cols = self.coff * self.head_dim
        n_seg = mCu.shape[0] - 1
        n_tok = mKV.shape[0]
        n_real = mCuC[n_seg]
        seg = Int32(0)
        lo = Int32(0)
        hi = Int32(0)
        t0 = Int32(0)
        if first * G < n_real:  # else every row of this CTA is padding (and there may be no segment)
            seg = find_segment(mCuC, n_seg, first * G)
            lo = mCuC[seg]
            hi = mCuC[seg + 1]
            t0 = mCu[seg]
        for i in cutlass.range(count, unroll=1):
            slot = i % S
            if i >= S:
                cute.arch.mbarrier_wait(empty + slot, (i // S - 1) % 2)
            elif i >= WINDOW_FWD_BULK_RAMP:
                cute.arch.mbarrier_wait(full + (i - WINDOW_FWD_BULK_RAMP), 0)
            for r in cutlass.range_constexpr(G):
                row = (first + i) * G + r
                if row < n_out:
                    own0 = Int32(0)
                    has_prev = cutlass.Boolean(False)
                    if row < n_real:
                        while row >= hi and seg + 1 < n_seg:
                            seg = seg + 1
                            lo = hi
                            hi = mCuC[seg + 1]
                            t0 = mCu[seg]
                        own0, has_prev = block_start(t0, row - lo, ratio, n_tok)
                    else:
                        own0, has_prev = block_start(Int32(0), Int32(0), ratio, n_tok)
                    sPrev[slot, r] = Int32(1) if has_prev else Int32(0)
                    b = slot * G + r
                    self.copy_block(mKV, mS, sKV, sS, own0, b, full + slot, cols)
                    if cutlass.const_expr(self.coff == 2 and r == 0):
                        if i == 0 and has_prev:
                            self.copy_block(mKV, mS, sKV, sS, own0 - ratio, S * G, full + slot, cols)
            cute.arch.mbarrier_arrive(full + slot)

    @cute.jit
    def copy_block(self, mKV, mS, sKV, sS, tok: Int32, b, bar, cols: cutlass.Constexpr):
        """Bulk-copy the kv and score block starting at token ``tok`` into block slot ``b``."""
        ratio = self.ratio
        cute.arch.mbarrier_expect_tx(bar, 2 * self.block_bytes)
        src = tok * cols
        dst = b * (ratio * cols)
        cp_async_bulk_shared_cluster_global(sKV.iterator + dst, mKV.iterator + src, bar, self.block_bytes)
        cp_async_bulk_shared_cluster_global(sS.iterator + dst, mS.iterator + src, bar, self.block_bytes)

    @cute.jit
    def consume(self, mKV, mS, mApe, mCuC, mOut, sKV, sS, sPrev, full, empty, first, count, tidx):
        """Per stage: wait for its bytes, pool this thread's row and column slice out of shared
        memory, store, then release the stage before (its last row was this stage's previous
        block)."""
        S, G, ratio, coff, vec, n_vec = self.stages, self.sched.row_lanes, self.ratio, self.coff, self.vec, self.n_vec
        ct = self.sched.col_threads
        lane_row = tidx // ct
        cv = tidx % ct
        gA = cute.zipped_divide(mApe, (1, vec))
        gO = cute.zipped_divide(mOut, (1, vec))
        width = coff * ratio
        # this thread's column slice is the same in every stage: its ape window once, in registers
        rA = cute.make_rmem_tensor((width, 1, vec), Float32)
        stage_ape(gA, rA, cv < n_vec, cv, 0, 0, 1, ratio, coff, n_vec)
        ape_rows = rA[None, 0, None]
        n_real = padding_bound(mCuC, mCuC.shape[0] - 1)  # once: a global load per stage otherwise
        for i in cutlass.range(count, unroll=1):
            slot = i % S
            cute.arch.mbarrier_wait(full + slot, (i // S) % 2)
            row = (first + i) * G + lane_row
            if lane_row < G and row < mOut.shape[0]:
                b = slot * G + lane_row
                pb = b - 1
                if b == 0:
                    pb = S * G - 1
                if i == 0 and lane_row == 0:
                    pb = S * G
                has_prev = sPrev[slot, lane_row] != 0
                rS = cute.make_rmem_tensor((width, vec), Float32)
                rX = cute.make_rmem_tensor((width, vec), Float32)
                # ring blocks start at row ``block * ratio``; the previous block is block ``pb``
                load_window(sKV, sS, gA, rS, rX, b * ratio, has_prev, cv, ratio, coff, n_vec, vec,
                            ape_rows=ape_rows, prev0=(pb + 1) * ratio)
                pool_and_store(rS, rX, gO, row, cv, vec, width, ratio, coff, has_prev, padding_row(n_real, row))
            if i > 0:
                cute.arch.mbarrier_arrive(empty + (i - 1) % S)
