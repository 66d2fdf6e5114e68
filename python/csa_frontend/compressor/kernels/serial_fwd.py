"""Serial forward: small launches pool in the reference's order, so ``out`` has its bits.

Why a third forward: the contract counts differing elements, at most max(1, 0.1%) of ``out``.
The fast forwards round a few elements in ten thousand differently from the reference (the
stream family re-associates sums over windows of up to 512 positions; the register-window
family keeps checked MUFU exponentials), which a launch of one to a few thousand elements
exceeds now and then (``schedule.SERIAL_FWD_MAX_OUTPUTS``, and for the stream family
``STREAM_SERIAL_FWD_MAX_OUTPUTS``). Such launches are latency-bound anyway, so this kernel
spends instructions on taking the reference's exact steps: libdevice ``expf`` of ``s - max``,
the denominator added left to right, weights by IEEE division, pinned products, and their sum
left to right, rounded once to bf16.

CTA: one output row x ``col_threads`` (16) columns times ``row_lanes`` (32) position lanes
(``schedule.SERIAL_FWD_COLS``). The lanes do the parallel steps for positions ``lane,
lane + lanes, ...`` (every load of a step in flight at once) into a shared ``(position,
column)`` tile; the two in-order sums are one thread per column walking down the tile.
Padding rows pool segment 0's first block, as everywhere.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32
from cutlass.memory import SmemAllocator

from .common import RowsForward, add_in_order, block_start, chunk_position, enter_grid, mul_rn, row_start


class SerialForward(RowsForward):
    family = "serial"

    def cta_rows(self) -> int:
        return 1

    @cute.kernel
    def kernel(self, mKV, mS, mApe, mCu, mCuC, mOut):
        enter_grid(self.pdl)
        ratio, width = self.ratio, self.width
        cols, lanes = self.sched.col_threads, self.sched.row_lanes
        per_lane = -(-width // lanes)
        tidx, _, _ = cute.arch.thread_idx()
        row, by, _ = cute.arch.block_idx()
        j = tidx % cols
        lane = tidx // cols
        col = by * cols + j
        col_ok = col < self.head_dim
        smem = SmemAllocator()
        sT = smem.allocate_tensor(Float32, cute.make_layout((width, cols), stride=(cols, 1)), 16)
        sMax = smem.allocate_tensor(Float32, cute.make_layout((lanes, cols), stride=(cols, 1)), 16)
        sDen = smem.allocate_tensor(Float32, cute.make_layout((cols,)), 16)
        t0, blk = row_start(mCu, mCuC, mCu.shape[0] - 1, row)
        own0, has_prev = block_start(t0, blk, ratio, mKV.shape[0])

        # s = score + ape (-inf where the position is invalid, as the reference masks it). Every
        # load of a step is issued before any is used (a use inside its branch would make each
        # position wait for the one before it).
        rScore = cute.make_rmem_tensor((per_lane,), BFloat16)
        rApe = cute.make_rmem_tensor((per_lane,), Float32)
        rScore.fill(-BFloat16.inf)
        rApe.fill(0.0)
        self.load_positions(mS, rScore, mApe, rApe, own0, has_prev, col, col_ok, lane)
        m = -Float32.inf
        for i in cutlass.range_constexpr(per_lane):
            k = lane + i * lanes
            if k < width:
                s = rScore[i].to(Float32) + rApe[i]
                sT[k, j] = s
                m = cute.arch.fmax(m, s)
        sMax[lane, j] = m
        cute.arch.sync_threads()
        m = sMax[0, j]
        for y in cutlass.range_constexpr(1, lanes):
            m = cute.arch.fmax(m, sMax[y, j])
        for i in cutlass.range_constexpr(per_lane):
            k = lane + i * lanes
            if k < width:
                sT[k, j] = cute.math.exp(sT[k, j] - m)
        cute.arch.sync_threads()
        if lane == 0:
            sDen[j] = column_sum(sT, j, width)
        cute.arch.sync_threads()
        den = sDen[j]
        # the weighted products; invalid positions: kv 0, weight 0
        rKV = cute.make_rmem_tensor((per_lane,), BFloat16)
        rKV.fill(0.0)
        self.load_positions(mKV, rKV, None, None, own0, has_prev, col, col_ok, lane)
        for i in cutlass.range_constexpr(per_lane):
            k = lane + i * lanes
            if k < width:
                sT[k, j] = mul_rn(rKV[i].to(Float32), sT[k, j] / den)
        cute.arch.sync_threads()
        if lane == 0 and col_ok:
            mOut[row, col] = column_sum(sT, j, width).to(BFloat16)

    @cute.jit
    def load_positions(self, mT, rT, mApe, rApe, own0, has_prev, col, col_ok, lane):
        """This lane's valid window positions of column ``col``: ``mT`` into ``rT`` and, given
        ``mApe``, the ape row into ``rApe``; invalid positions keep what the caller filled in."""
        ratio, coff, width, lanes = self.ratio, self.coff, self.width, self.sched.row_lanes
        for i in cutlass.range_constexpr(-(-width // lanes)):
            k = lane + i * lanes
            if k < width:
                tok, colt, arow, ok = chunk_position(own0, has_prev, col, k, ratio, coff, self.head_dim)
                if ok and col_ok:
                    rT[i] = mT[tok, colt]
                    if cutlass.const_expr(mApe is not None):
                        rApe[i] = mApe[arow, colt]


#: Positions a column sum loads before adding them: one shared-memory latency per block instead
#: of one per position (the loop's adds wait on each other anyway).
SUM_BLOCK = 16


@cute.jit
def column_sum(sT: cute.Tensor, j, width: cutlass.Constexpr) -> Float32:
    """``sT[0, j] + sT[1, j] + ...`` left to right: the reference's order."""
    block = cute.make_rmem_tensor((SUM_BLOCK,), Float32)
    total = Float32(0.0)
    for b in cutlass.range_constexpr(-(-width // SUM_BLOCK)):
        n = min(SUM_BLOCK, width - b * SUM_BLOCK)
        for i in cutlass.range_constexpr(n):
            block[i] = sT[b * SUM_BLOCK + i, j]
        for i in cutlass.range_constexpr(n):
            total = add_in_order(total, block[i], b == 0 and i == 0)
    return total
