"""Stream-family forward: one CTA pools one output row, its window split in chunks over threads.

For windows too wide for one thread's registers (large ratio). Thread ``(c, col)`` loads
window positions ``[c*chunk, (c+1)*chunk)`` of column slice ``col`` once (every input element
is still read from DRAM exactly once), reduces them to a (max, sum, acc) softmax partial, and
the partials merge in a fixed binary tree through shared memory, so the result is bitwise
reproducible. Within tolerance of the reference (different summation order), not bitwise.

Grid: x over output rows, y over column tiles of ``col_threads`` slices.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.memory import SmemAllocator

from .common import chunk_partials, find_segment, load_chunk, merge_chunks
from .schedule import Schedule


def partial_buffers(n_chunks: int, tile_cols: int):
    """Shared (max, sum, acc) partial buffers, one row per chunk."""
    smem = SmemAllocator()
    layout = cute.make_layout((n_chunks, tile_cols), stride=(tile_cols, 1))
    return tuple(smem.allocate_tensor(Float32, layout, 16) for _ in range(3))


class StreamForward:
    def __init__(self, ratio: int, coff: int, head_dim: int, sched: Schedule):
        assert sched.family == "stream"
        self.ratio, self.coff, self.head_dim, self.sched = ratio, coff, head_dim, sched
        self.vec = sched.vec
        self.n_vec = head_dim // sched.vec

    @cute.jit
    def __call__(
        self,
        mKV: cute.Tensor,  # (T, coff*d) bf16
        mS: cute.Tensor,  # (T, coff*d) bf16
        mApe: cute.Tensor,  # (ratio, coff*d) fp32
        mCu: cute.Tensor,  # (B+1,) int32
        mCuC: cute.Tensor,  # (B+1,) int32
        mOut: cute.Tensor,  # (total_comp, d) bf16
        stream,
    ):
        self.kernel(mKV, mS, mApe, mCu, mCuC, mOut).launch(
            grid=(mOut.shape[0], self.sched.col_tiles, 1),
            block=(self.sched.threads, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mKV, mS, mApe, mCu, mCuC, mOut):
        vec, n_vec, chunk = self.vec, self.n_vec, self.sched.chunk
        ct, n_chunks = self.sched.col_threads, self.sched.row_lanes
        tidx, _, _ = cute.arch.thread_idx()
        row, by, _ = cute.arch.block_idx()
        col = tidx % ct
        c = tidx // ct
        cv = by * ct + col
        n_seg = mCu.shape[0] - 1
        t0 = Int32(0)
        blk = Int32(0)
        if row < mCuC[n_seg]:
            seg = find_segment(mCuC, n_seg, row)
            t0 = mCu[seg]
            blk = row - mCuC[seg]
        sM, sL, sA = partial_buffers(n_chunks, ct * vec)
        rS = cute.make_rmem_tensor((chunk, vec), Float32)
        rX = cute.make_rmem_tensor((chunk, vec), Float32)
        rS.fill(-Float32.inf)
        rX.fill(0.0)
        if cv < n_vec:
            load_chunk(cute.zipped_divide(mKV, (1, vec)), cute.zipped_divide(mS, (1, vec)),
                       cute.zipped_divide(mApe, (1, vec)), rS, rX, t0 + blk * self.ratio, blk > 0, cv,
                       c * chunk, chunk, self.ratio, self.coff, n_vec, vec)
        for v in cutlass.range_constexpr(vec):
            m, den, acc = chunk_partials(rS, rX, v, chunk)
            sM[c, col * vec + v] = m
            sL[c, col * vec + v] = den
            sA[c, col * vec + v] = acc
        cute.arch.sync_threads()
        merge_chunks(sM, sL, sA, c, col, n_chunks, vec)
        if c == 0 and cv < n_vec:
            rO = cute.make_rmem_tensor((vec,), Float32)
            for v in cutlass.range_constexpr(vec):
                rO[v] = sA[0, col * vec + v] / sL[0, col * vec + v]
            gO = cute.zipped_divide(mOut, (1, vec))
            gO[(0, None), (row, cv)].store(rO.load().to(BFloat16))
