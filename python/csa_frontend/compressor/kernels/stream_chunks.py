"""Chunk gathers shared by the stream kernels: a thread owns window positions
``[k0, k0 + chunk)`` of one column slice for every row its CTA walks.

Chunks inside one window half (``chunk`` divides ``ratio``) are consecutive tokens of one
column slice: one validity test and one base address per row, every position a compile-time
offset. Other chunks go position by position (``chunk_position``).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .common import (HALF_LOG2E, chunk_position, copy_async, exp2_half_squared, kv_and_score, mul_rn, stage_chunk,
                     stage_invalid)


@cute.jit
def ape_slice(mApe: cute.Tensor, active: cutlass.Boolean, cv: Int32, k0: Int32, chunk: cutlass.Constexpr,
              ratio: cutlass.Constexpr, coff: cutlass.Constexpr, n_vec: cutlass.Constexpr,
              vec: cutlass.Constexpr) -> cute.Tensor:
    """This thread's ``(chunk, vec)`` slice of ape in registers, loaded once for every row (zeros
    past the window end): ape is as many bytes per row as kv and score together, so re-reading
    it per row doubled the traffic into the SMs."""
    gA = cute.zipped_divide(mApe, (1, vec))
    rA = cute.make_rmem_tensor((chunk, vec), Float32)
    rA.fill(0.0)
    if active:
        for i in cutlass.range_constexpr(chunk):
            _, colt, arow, ok = chunk_position(Int32(0), True, cv, k0 + i, ratio, coff, n_vec)
            if ok:
                apv = gA[(0, None), (arow, colt)].load()
                for v in cutlass.range_constexpr(vec):
                    rA[i, v] = apv[v]
    return rA


@cute.jit
def stage_any_chunk(mKV: cute.Tensor, mS: cute.Tensor, slots: cute.Tensor, own0: Int32, has_prev: cutlass.Boolean,
                    cv: Int32, k0: Int32, chunk: cutlass.Constexpr, ratio: cutlass.Constexpr,
                    coff: cutlass.Constexpr, n_vec: cutlass.Constexpr, vec: cutlass.Constexpr):
    """Start copying one row's valid chunk positions into this thread's ``slots``."""
    if cutlass.const_expr(ratio % chunk == 0):
        tok, colt, _, ok = chunk_position(own0, has_prev, cv, k0, ratio, coff, n_vec)
        stage_uniform_chunk(mKV, mS, slots, tok, colt, ok, chunk, vec)
    else:
        stage_chunk(cute.zipped_divide(mKV, (1, vec)), cute.zipped_divide(mS, (1, vec)), slots,
                    own0, has_prev, cv, k0, chunk, ratio, coff, n_vec, vec)


@cute.jit
def chunk_view(mT: cute.Tensor, tok: Int32, vec: cutlass.Constexpr) -> cute.Tensor:
    """``mT`` re-based at token row ``tok`` in ``(1, vec)`` tiles: a chunk's positions are then
    compile-time offsets from one base address."""
    return cute.zipped_divide(cute.domain_offset((tok, 0), mT), (1, vec))


@cute.jit
def stage_uniform_chunk(mKV: cute.Tensor, mS: cute.Tensor, slots: cute.Tensor, tok: Int32, colt: Int32,
                        ok: cutlass.Boolean, chunk: cutlass.Constexpr, vec: cutlass.Constexpr):
    """``stage_chunk`` for a chunk inside one window half: consecutive tokens, one column slice."""
    if ok:
        wKV = chunk_view(mKV, tok, vec)
        wS = chunk_view(mS, tok, vec)
        for i in cutlass.range_constexpr(chunk):
            copy_async(wKV[(0, None), (i, colt)], slots[i, None], vec)
            copy_async(wS[(0, None), (i, colt)], slots[chunk + i, None], vec)
    else:
        for i in cutlass.range_constexpr(chunk):
            stage_invalid(slots, i, vec)


@cute.jit
def gather_scores(mKV: cute.Tensor, mS: cute.Tensor, rA: cute.Tensor, rS: cute.Tensor, rX: cute.Tensor,
                  own0: Int32, has_prev: cutlass.Boolean, cv: Int32, k0: Int32, chunk: cutlass.Constexpr,
                  ratio: cutlass.Constexpr, coff: cutlass.Constexpr, n_vec: cutlass.Constexpr,
                  vec: cutlass.Constexpr, staged):
    """``rS`` = score + ape (ape from the registers ``rA``), ``rX`` = kv for the chunk's
    positions; invalid positions get -inf / 0. Staged, their kv slots already hold 0 (the
    staging wrote it, ``stage_invalid``): every position is gathered without a test (a
    per-position branch made every value carry a default through it), then a branch that only
    first blocks and padding chunks take sets their scores to -inf (whatever their stale score
    slots and ape hold). From global memory, chunks inside one window half (``chunk`` divides
    ``ratio``) take one validity test and one base address; others go position by position."""
    if cutlass.const_expr(staged is not None):
        for i in cutlass.range_constexpr(chunk):
            _gather_one(mKV, mS, rA, rS, rX, staged, i, None, None, chunk, vec)
        mask_invalid_scores(rS, own0, has_prev, cv, k0, chunk, ratio, coff, n_vec, vec)
    elif cutlass.const_expr(ratio % chunk == 0):
        tok, colt, _, ok = chunk_position(own0, has_prev, cv, k0, ratio, coff, n_vec)
        wKV = chunk_view(mKV, tok, vec)
        wS = chunk_view(mS, tok, vec)
        for i in cutlass.range_constexpr(chunk):
            if ok:
                _gather_one(wKV, wS, rA, rS, rX, staged, i, i, colt, chunk, vec)
            else:
                invalid_position(rS, rX, i, vec)
    else:
        gKV = cute.zipped_divide(mKV, (1, vec))
        gS = cute.zipped_divide(mS, (1, vec))
        for i in cutlass.range_constexpr(chunk):
            tok, colt, _, ok = chunk_position(own0, has_prev, cv, k0 + i, ratio, coff, n_vec)
            if ok:
                _gather_one(gKV, gS, rA, rS, rX, staged, i, tok, colt, chunk, vec)
            else:
                invalid_position(rS, rX, i, vec)


@cute.jit
def mask_invalid_scores(rS: cute.Tensor, own0: Int32, has_prev: cutlass.Boolean, cv: Int32, k0: Int32,
                        chunk: cutlass.Constexpr, ratio: cutlass.Constexpr, coff: cutlass.Constexpr,
                        n_vec: cutlass.Constexpr, vec: cutlass.Constexpr):
    """Staged gathers: -inf for the chunk's invalid positions, whatever their stale score slots
    and ape hold; a branch taken only by first blocks and padding chunks."""
    if cutlass.const_expr(ratio % chunk == 0):
        if not chunk_position(own0, has_prev, cv, k0, ratio, coff, n_vec)[3]:
            for i in cutlass.range_constexpr(chunk):
                for v in cutlass.range_constexpr(vec):
                    rS[i, v] = -Float32.inf
    else:
        for i in cutlass.range_constexpr(chunk):
            if not chunk_position(own0, has_prev, cv, k0 + i, ratio, coff, n_vec)[3]:
                for v in cutlass.range_constexpr(vec):
                    rS[i, v] = -Float32.inf


@cute.jit
def _gather_one(gKV, gS, rA, rS, rX, staged, i: cutlass.Constexpr, tok, colt, chunk: cutlass.Constexpr,
                vec: cutlass.Constexpr):
    kvv, scv = kv_and_score(gKV, gS, staged, i, chunk, tok, colt, vec)
    for v in cutlass.range_constexpr(vec):
        rS[i, v] = scv[v] + rA[i, v]
        rX[i, v] = kvv[v]


@cute.jit
def invalid_position(rS, rX, i: cutlass.Constexpr, vec: cutlass.Constexpr):
    """Window position ``i`` outside the window or the pack: score -inf, kv 0 (zero weight)."""
    for v in cutlass.range_constexpr(vec):
        rS[i, v] = -Float32.inf
        rX[i, v] = Float32(0.0)


@cute.jit
def warp_chunks_max(rS: cute.Tensor, v: cutlass.Constexpr, chunk: cutlass.Constexpr,
                    col_threads: cutlass.Constexpr) -> Float32:
    """Max of column ``v`` over this thread's chunk and the other chunks of its warp (lanes
    ``col_threads`` apart). A butterfly of exact maxima, so every lane gets the same value."""
    m = rS[0, v]
    for i in cutlass.range_constexpr(1, chunk):
        m = cute.arch.fmax(m, rS[i, v])
    dist = col_threads
    while cutlass.const_expr(dist < 32):
        m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, dist))
        dist *= 2
    return m


@cute.jit
def warp_chunks_sum(x: Float32, y: Float32, col_threads: cutlass.Constexpr):
    """Sums of ``x`` and ``y`` over the chunks of a warp (lanes ``col_threads`` apart), in chunk
    order down the warp; the warp's first chunk lane holds the results."""
    dist = col_threads
    while cutlass.const_expr(dist < 32):
        x = x + cute.arch.shuffle_sync_down(x, dist)
        y = y + cute.arch.shuffle_sync_down(y, dist)
        dist *= 2
    return x, y


@cute.jit
def exp_relative(x: Float32, fast: cutlass.Constexpr) -> Float32:
    """``exp(x)`` for ``x = s - max <= 0``: libdevice ``expf``, or with ``fast`` ``ex2.approx`` of
    ``x * log2(e)`` (the subtraction first, as the reference, so the error scales with the
    spread of the window's scores, not with their offset)."""
    r = Float32(0.0)
    if cutlass.const_expr(fast):
        r = exp2_half_squared(x * Float32(HALF_LOG2E))
    else:
        r = cute.math.exp(x)
    return r


@cute.jit
def product(a: Float32, b: Float32, fast: cutlass.Constexpr) -> Float32:
    """``a * b``: pinned (never contracted into a neighbouring add) unless ``fast``."""
    r = Float32(0.0)
    if cutlass.const_expr(fast):
        r = a * b
    else:
        r = mul_rn(a, b)
    return r
