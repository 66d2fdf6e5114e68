"""grad_ape = sum of the backward's partial slabs, in slab order (deterministic, no atomics).

Each CTA owns 32 consecutive grad_ape elements and splits the slab axis into ``SPLIT``
contiguous chunks, one per warp (16 warps keep each warp's chain of dependent loads short);
warp ``w`` sums chunk ``w`` in slab order, then warp 0 sums the chunk totals in warp order. The order depends only on the slab count, which the
schedule derives from the row count alone.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.memory import SmemAllocator

ELEMS = 32
SPLIT = 16


class ApeReduce:
    @cute.jit
    def __call__(
        self,
        mSlab: cute.Tensor,  # (row_groups, ratio*coff*d) fp32
        mGApe: cute.Tensor,  # (ratio*coff*d,) fp32
        stream,
    ):
        n = mGApe.shape[0]
        self.kernel(mSlab, mGApe).launch(
            grid=((n + ELEMS - 1) // ELEMS, 1, 1), block=(ELEMS * SPLIT, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, mSlab, mGApe):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        e = bx * ELEMS + tidx % ELEMS
        w = tidx // ELEMS
        n_slab = mSlab.shape[0]
        chunk = (n_slab + SPLIT - 1) // SPLIT
        begin = w * chunk
        end = cutlass.min(begin + chunk, n_slab)
        acc = Float32(0.0)
        if e < mGApe.shape[0]:
            for g in cutlass.range(begin, end, unroll=8):
                acc = acc + mSlab[g, e]
        smem = SmemAllocator()
        sPart = smem.allocate_tensor(Float32, cute.make_layout((SPLIT, ELEMS), stride=(ELEMS, 1)), 16)
        sPart[w, tidx % ELEMS] = acc
        cute.arch.sync_threads()
        if w == 0 and e < mGApe.shape[0]:
            tot = sPart[0, tidx]
            for j in cutlass.range_constexpr(1, SPLIT):
                tot = tot + sPart[j, tidx]
            mGApe[e] = tot
