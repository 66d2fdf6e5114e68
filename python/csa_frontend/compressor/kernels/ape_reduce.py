"""grad_ape = sum of the backward's partial slabs, in slab order (deterministic, no atomics).

A CTA of ``WARPS`` warps owns ``32 * WARPS / split`` consecutive grad_ape elements: ``split``
warps share each 32-element group and divide the slab axis into ``split`` contiguous chunks,
each summed in slab order; the chunk totals are then summed in chunk order. ``split`` is a
runtime argument chosen from the slab count alone (``ape_split``), so the order, hence the
bits, depends on the shape and nothing else. Many slabs (short rows, small ratio: 512 slabs
of 4096 elements) want many warps per element, each with a short chain of loads in flight;
few slabs over many elements (ratio 128: 9 slabs of 131072 elements) want one thread per
element: the old fixed 16-way split ran 2M mostly idle threads there (9.8 us on the H200).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.memory import SmemAllocator

from .common import enter_grid, release_dependents
from .schedule import APE_REDUCE_WARPS as WARPS

#: slabs per block of loads a warp keeps in flight
CHAIN_BLOCK = 32


class ApeReduce:
    def __init__(self, pdl: bool = False):
        self.pdl = pdl  # launched as a programmatic dependent of the backward (sm_90+)

    @cute.jit
    def __call__(
        self,
        mSlab: cute.Tensor,  # (row_groups, ratio, coff*d) fp32, compact
        mGApe: cute.Tensor,  # (ratio, coff*d) fp32, compact
        split: Int32,
        stream,
    ):
        # both taken in the shapes the backward allocates and flattened here: two torch views
        # per call cost ~2 us of host time on the H200's host (1x8192 r4 c2 d128 backward: 23 us)
        n = cute.size(mGApe.shape)
        slabs = cute.make_tensor(mSlab.iterator, cute.make_layout((mSlab.shape[0], n), stride=(n, 1)))
        flat = cute.make_tensor(mGApe.iterator, cute.make_layout((n,)))
        per_cta = 32 * WARPS // split
        self.kernel(slabs, flat, split).launch(
            grid=((n + per_cta - 1) // per_cta, 1, 1), block=(32 * WARPS, 1, 1), stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, mSlab, mGApe, split):
        # the slabs are complete only once the backward grid has finished; the next grid is let
        # in only after the sums: launched earlier, its CTAs would take the slots the backward's
        # tail frees, piling up on the SMs that finish first (a one-wave grid of ours below
        # full occupancy, 3x8192 r4 c1 d512 backward: 36.0 -> 39.2 us on the H200)
        enter_grid(self.pdl, release=False)
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        w = tidx // 32
        group = w // split
        part = w - group * split
        local = group * 32 + tidx % 32
        e = bx * (32 * WARPS // split) + local
        n_slab = mSlab.shape[0]
        chunk = (n_slab + split - 1) // split
        begin = part * chunk
        end = cutlass.min(begin + chunk, n_slab)
        acc = Float32(0.0)
        if e < mGApe.shape[0]:
            if (end - begin) % CHAIN_BLOCK == 0:
                # whole blocks: the unrolled loop keeps a block's loads in flight
                for g in cutlass.range(begin, end, unroll=CHAIN_BLOCK):
                    acc = acc + mSlab[g, e]
            else:
                # a partial block (e.g. 250 slabs in chunks of 32: the last warp's 26): that loop
                # ran a runtime remainder one dependent L2 round trip per slab (64x1000 r4 c2
                # d128 backward 47.2 -> 43.1 us on the H200). Here each block's loads are
                # predicated and all issued before the adds, which keep the slab order.
                rV = cute.make_rmem_tensor((CHAIN_BLOCK,), Float32)
                for base in cutlass.range(begin, end, CHAIN_BLOCK, unroll=1):
                    for q in cutlass.range_constexpr(CHAIN_BLOCK):
                        rV[q] = Float32(0.0)
                        if base + q < end:
                            rV[q] = mSlab[base + q, e]
                    for q in cutlass.range_constexpr(CHAIN_BLOCK):
                        if base + q < end:
                            acc = acc + rV[q]
        smem = SmemAllocator()
        sPart = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 32), stride=(32, 1)), 16)
        sPart[w, tidx % 32] = acc
        cute.arch.sync_threads()
        if part == 0 and e < mGApe.shape[0]:
            tot = sPart[w, tidx % 32]
            for j in cutlass.range(1, split, unroll=1):
                tot = tot + sPart[w + j, tidx % 32]
            mGApe[e] = tot
        release_dependents(self.pdl)
