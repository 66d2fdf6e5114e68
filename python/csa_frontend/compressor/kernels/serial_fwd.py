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

The lean variant (``schedule.SERIAL_FWD_LEAN``, the default since session 32; 7-15% faster on
the H200): from 4097 outputs a launch has several CTAs per SM and is bound by issue (NOTES row
130), so it trims the per-position work. The lanes' maxima meet by shuffles within a warp and
one shared value per warp; weights come from the exact reciprocal and Markstein's correction
(``div_exact``: IEEE division's bits in three instructions, as the backwards take them;
``div.rn`` where an exponential is below ``MARKSTEIN_MIN``); where the ratio is a multiple of
the lanes, every position's load is a constant offset from one address per thread
(``load_affine``); kv is loaded with score and ape where its registers fit
(``EARLY_KV_POSITIONS``); the window compare per position goes where the lanes divide the
window. SASS, r128 c2 d128 (``benchmark/csa/sass_budget.py``): a warp's common path outside
the in-order sums ~570 -> ~370 instructions, 31 registers against 32.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32
from cutlass.memory import SmemAllocator

from .common import (RowsForward, add_in_order, block_start, chunk_position, div_exact, enter_grid, mul_rn,
                     rcp_of_den, row_start)
from .schedule import SERIAL_FWD_LEAN


class SerialForward(RowsForward):
    family = "serial"

    def cta_rows(self) -> int:
        return 1

    @cute.kernel
    def kernel(self, mKV, mS, mApe, mCu, mCuC, mOut):
        enter_grid(self.pdl)
        ratio, width = self.ratio, self.width
        cols, lanes = self.sched.col_threads, self.sched.row_lanes
        per_lane = self.per_lane()
        tidx, _, _ = cute.arch.thread_idx()
        row, by, _ = cute.arch.block_idx()
        j = tidx % cols
        lane = tidx // cols
        col = by * cols + j
        col_ok = col < self.head_dim
        lean = SERIAL_FWD_LEAN
        smem = SmemAllocator()
        per_warp = 32 // cols if lean else 1  # lean: the lanes of one warp meet by shuffles first
        warps = lanes // per_warp
        sT = smem.allocate_tensor(Float32, cute.make_layout((width, cols), stride=(cols, 1)), 16)
        sMax = smem.allocate_tensor(Float32, cute.make_layout((warps, cols), stride=(cols, 1)), 16)
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
        # lean: kv in flight with them where its registers fit, one memory round trip per row
        early_kv = lean and per_lane <= EARLY_KV_POSITIONS
        rKV = self.load_kv(mKV, own0, has_prev, col, col_ok, lane) if cutlass.const_expr(early_kv) else None
        m = -Float32.inf
        for i in cutlass.range_constexpr(per_lane):
            k = lane + i * lanes
            if self.in_window(k):
                s = rScore[i].to(Float32) + rApe[i]
                sT[k, j] = s
                m = cute.arch.fmax(m, s)
        if cutlass.const_expr(lean):
            for dist in [cols << b for b in range(per_warp.bit_length() - 1)]:
                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, dist))
            if lane % per_warp == 0:
                sMax[lane // per_warp, j] = m
        else:
            sMax[lane, j] = m
        cute.arch.sync_threads()
        m = sMax[0, j]
        for y in cutlass.range_constexpr(1, warps):
            m = cute.arch.fmax(m, sMax[y, j])
        e_min = Float32.inf  # lean: the smallest exponential picks the weights' division
        for i in cutlass.range_constexpr(per_lane):
            k = lane + i * lanes
            if self.in_window(k):
                e = cute.math.exp(sT[k, j] - m)
                sT[k, j] = e
                if cutlass.const_expr(lean):
                    e_min = cute.arch.fmin(e_min, e)
        cute.arch.sync_threads()
        if lane == 0:
            sDen[j] = column_sum(sT, j, width)
        cute.arch.sync_threads()
        den = sDen[j]
        # the weighted products; invalid positions: kv 0, weight 0
        if cutlass.const_expr(not early_kv):
            rKV = self.load_kv(mKV, own0, has_prev, col, col_ok, lane)
        if cutlass.const_expr(lean):
            # Markstein's correction is exact from MARKSTEIN_MIN up; a thread holding a smaller
            # exponential (huge score spreads; the invalid half of a segment's first block, whose
            # exponentials are 0) divides all its positions by div.rn
            if e_min < Float32(MARKSTEIN_MIN):
                self.weighted_products(sT, rKV, j, lane, den, None)
            else:
                self.weighted_products(sT, rKV, j, lane, den, rcp_of_den(den))
        else:
            self.weighted_products(sT, rKV, j, lane, den, None)
        cute.arch.sync_threads()
        if lane == 0 and col_ok:
            mOut[row, col] = column_sum(sT, j, width).to(BFloat16)

    def per_lane(self) -> int:
        """Window positions per lane: ``lane + i * lanes`` for ``i`` below this."""
        return -(-self.width // self.sched.row_lanes)

    def in_window(self, k):
        """Whether position ``k = lane + i * lanes`` is in the window: the lean variant knows it is
        where the lanes divide the window (a constant, no compare per position)."""
        if SERIAL_FWD_LEAN and self.width % self.sched.row_lanes == 0:
            return True
        return k < self.width

    @cute.jit
    def weighted_products(self, sT, rKV, j, lane, den, rcp):
        """``sT[k, j]`` (the exponentials) becomes ``kv * (e / den)``, the weight by ``div_exact``
        from ``rcp`` (lean variant), or with ``rcp`` None by ``div.rn``."""
        lanes = self.sched.row_lanes
        for i in cutlass.range_constexpr(self.per_lane()):
            k = lane + i * lanes
            if self.in_window(k):
                if cutlass.const_expr(rcp is None):
                    p = sT[k, j] / den
                else:
                    p = div_exact(sT[k, j], den, rcp)
                sT[k, j] = mul_rn(rKV[i].to(Float32), p)

    @cute.jit
    def load_kv(self, mKV, own0, has_prev, col, col_ok, lane):
        """This lane's kv values of column ``col`` (0 at invalid positions)."""
        rKV = cute.make_rmem_tensor((self.per_lane(),), BFloat16)
        rKV.fill(0.0)
        self.load_positions(mKV, rKV, None, None, own0, has_prev, col, col_ok, lane)
        return rKV

    def affine(self) -> bool:
        """Whether the lean variant's loads take constant offsets (``load_affine``): every
        iteration of a lane's positions ``lane + i * lanes`` within one half of the window (the
        ratio a multiple of the lanes), so its token, column and ape row are a base's plus
        constants."""
        return SERIAL_FWD_LEAN and self.ratio % self.sched.row_lanes == 0

    @cute.jit
    def load_positions(self, mT, rT, mApe, rApe, own0, has_prev, col, col_ok, lane):
        """This lane's valid window positions of column ``col``: ``mT`` into ``rT`` and, given
        ``mApe``, the ape row into ``rApe``; invalid positions keep what the caller filled in."""
        ratio, coff, width, lanes = self.ratio, self.coff, self.width, self.sched.row_lanes
        if cutlass.const_expr(self.affine()):
            self.load_affine(mT, rT, mApe, rApe, own0, has_prev, col, col_ok, lane)
            return
        for i in cutlass.range_constexpr(self.per_lane()):
            k = lane + i * lanes
            if k < width:
                tok, colt, arow, ok = chunk_position(own0, has_prev, col, k, ratio, coff, self.head_dim)
                if ok and col_ok:
                    rT[i] = mT[tok, colt]
                    if cutlass.const_expr(mApe is not None):
                        rApe[i] = mApe[arow, colt]

    @cute.jit
    def load_affine(self, mT, rT, mApe, rApe, own0, has_prev, col, col_ok, lane):
        """``load_positions`` where ``affine()``: one address per thread and tensor, each
        position's load at a constant offset from it (coff 2 reads token ``own0 - ratio + k`` in
        both halves, the own half ``head_dim`` columns further on)."""
        ratio, coff, d, lanes = self.ratio, self.coff, self.head_dim, self.sched.row_lanes
        cols = coff * d
        first = own0 - ratio if cutlass.const_expr(coff == 2) else own0  # token of position 0
        span = cute.make_layout((self.width * cols + cols,))
        gT = cute.make_tensor(mT.iterator + ((first + lane) * cols + col), span)
        gA = None
        if cutlass.const_expr(mApe is not None):
            gA = cute.make_tensor(mApe.iterator + (lane * cols + col), span)
        for i in cutlass.range_constexpr(self.width // lanes):
            own_half = coff == 2 and i * lanes >= ratio
            shift = d if own_half else 0
            ok = col_ok
            if cutlass.const_expr(coff == 2 and not own_half):
                ok = col_ok and has_prev
            if ok:
                rT[i] = gT[i * lanes * cols + shift]
                if cutlass.const_expr(mApe is not None):
                    rApe[i] = gA[(i * lanes - (ratio if own_half else 0)) * cols + shift]


#: Lean variant: positions per lane up to which kv is loaded with score and ape rather than
#: after the denominator. 8 (windows of up to 256 positions) keep the kernel at 32 registers (4
#: CTAs of 512 threads per SM); at 16 it took 57 instead of 40 (ptxas, sm_90a, r256 c2 d512).
EARLY_KV_POSITIONS = 8

#: Lean variant: exponentials from which Markstein's correction is exact (quotient and
#: remainder in the normal range for denominators up to 512; NOTES row 82). A thread with a
#: smaller one divides by ``div.rn`` (``weighted_products``).
MARKSTEIN_MIN = 2.0 ** -100


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
