"""Device helpers shared by every kernel family: pinned arithmetic, row lookup, window gather.

Why pinned products: ptxas may contract a plain ``mul.f32`` feeding an ``add``/``sub`` into one
FMA, which changes bits against the eager reference (where every op rounds). ``mul.rn.f32``
is never contracted, so the products whose rounding the numerics contract fixes go through
``mul_rn``.
"""
from __future__ import annotations

import os
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator

from .schedule import EXACT_PADDING_ROWS, LOOKUP_ONE_ROUND, LOOKUP_OVERLAPPED


def _ptx_f32(instruction: str, args, loc, ip) -> Float32:
    """One fp32 PTX instruction ``instruction $0, $1, ...`` on ``args``, as inline assembly
    (so ptxas cannot contract, reorder into, or substitute it)."""
    operands = ", ".join(f"${i}" for i in range(len(args) + 1))
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip) for x in args],
            f"{instruction} {operands};",
            ",".join(["=f"] + ["f"] * len(args)),
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def mul_rn(a, b, *, loc=None, ip=None) -> Float32:
    """``a * b`` rounded once, never fused into a neighbouring add."""
    return _ptx_f32("mul.rn.f32", (a, b), loc, ip)


@dsl_user_op
def fma_rn(a, b, c, *, loc=None, ip=None) -> Float32:
    """``a * b + c`` with one rounding."""
    return _ptx_f32("fma.rn.f32", (a, b, c), loc, ip)


@dsl_user_op
def nanosleep(ns: int, *, loc=None, ip=None) -> None:
    """Suspend the thread for about ``ns`` nanoseconds (``nanosleep.u32``; the hardware picks a
    time in [0, 2 * ns])."""
    llvm.inline_asm(None, [], f"nanosleep.u32 {int(ns)};", "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


#: log2(e): the MUFU exponentials take base-2 arguments
LOG2E = 1.4426950408889634
HALF_LOG2E = 0.5 * LOG2E  # exp2_half_squared takes half the exponent


@dsl_user_op
def exp2_ftz(a, *, loc=None, ip=None) -> Float32:
    """``2**a`` by the MUFU (``ex2.approx.ftz``): results below 2**-126 flush to zero."""
    return _ptx_f32("ex2.approx.ftz.f32", (a,), loc, ip)


@dsl_user_op
def exp2_half_squared(a_half, *, loc=None, ip=None) -> Float32:
    """``2**(2 * a_half)`` as ``ex2.approx.ftz(a_half)**2``: no flush to zero of the result.

    ``ex2.approx.f32`` without ``.ftz`` costs a compare and two predicated multiplies per call
    (ptxas halves the argument and squares the result when it is below -126); here the caller
    folds the halving into its own multiply and the square is one plain ``mul`` (never
    flushed), so subnormal results are kept and 2**x for ``x < -252`` is 0 as in fp32 anyway.
    Error about twice the MUFU's (~4 ulp).
    """
    h = exp2_ftz(a_half, loc=loc, ip=ip)
    return mul_rn(h, h, loc=loc, ip=ip)


#: The exact backward weights' reciprocal ``1 / den`` as the branch-free fast path of ``div.rn``
#: (``rcp_of_den``) or as ``div.rn`` itself ("ieee": a range test and a slow-path call around
#: every reciprocal). The forward's exact fallback keeps ``div.rn`` (``window_fwd.pool_exact``).
#: Diagnostic knob for A/B runs, CSA_FRONTEND_EXACT_RCP=ieee.
EXACT_RCP_INLINE = os.environ.get("CSA_FRONTEND_EXACT_RCP", "inline") != "ieee"


@dsl_user_op
def rcp_of_den(den, *, loc=None, ip=None) -> Float32:
    """``1 / den`` correctly rounded, for a softmax denominator: ``den`` in [1, window] or NaN.

    ``div.rn.f32`` compiles to a test of the divisor's exponent around two paths: ``rcp.approx``
    refined by one Newton step (FMA) where the exponent is in range, a slow-path call
    otherwise (subnormals, huge values, Inf, NaN). A denominator is never out of range but
    for NaN (which both paths return), so this is that fast path alone, the same three
    instructions and bits (the GPU tests check every fp32 value in [1, 512]) without the
    branch, which had fenced each column's arithmetic off from its neighbours' in the
    scheduler. ``EXACT_RCP_INLINE`` off: plain ``div.rn``.
    """
    if not EXACT_RCP_INLINE:
        return Float32(1.0) / Float32(den)
    r = _ptx_f32("rcp.approx.ftz.f32", (den,), loc, ip)
    e = _ptx_f32("fma.rn.f32", (-Float32(den), r, Float32(1.0)), loc, ip)
    return _ptx_f32("fma.rn.f32", (r, e, r), loc, ip)


@cute.jit
def div_exact(a: Float32, b: Float32, rcp_b: Float32) -> Float32:
    """``a / b`` correctly rounded, given ``rcp_b = 1 / b`` correctly rounded.

    Markstein's correction: the remainder ``a - q0*b`` is exact in one FMA, and one more FMA
    with the rounded reciprocal yields the round-to-nearest quotient for operands in the
    normal range (softmax weights: ``a`` in [0, 1], ``b`` in [1, window]). Three instructions
    per weight instead of a full ``div.rn`` sequence, with the same bits (the GPU tests check
    them against true division).
    """
    q0 = a * rcp_b
    rem = fma_rn(-q0, b, a)
    return fma_rn(rem, rcp_b, q0)


@cute.jit
def ape_element(mSlab: cute.Tensor, arow: Int32, col: Int32):
    """Pointer to grad_ape's element ``(arow, col)`` where the atomic path passes grad_ape as
    the slab tensor, viewed as a single slab."""
    return mSlab.iterator + (arow * mSlab.shape[2] + col)


@cute.jit
def store_partial(mSlab: cute.Tensor, group: Int32, arow: Int32, col: Int32, val: Float32,
                  atomic: cutlass.Constexpr):
    """One grad_ape partial: a plain store into this row group's slab (deterministic path), or
    an fp32 atomic add straight into grad_ape viewed as a single slab (opt-in fast path: no
    slab traffic and no reduction launch, but the order of additions, hence the bits, varies)."""
    if cutlass.const_expr(atomic):
        cute.arch.atomic_add(ape_element(mSlab, arow, col).llvm_ptr, val, sem="relaxed", scope="gpu")
    else:
        mSlab[group, arow, col] = val


@dsl_user_op
def red_add_f32_vector(ptr, values, *, loc=None, ip=None) -> None:
    """fp32 atomic adds to 2 or 4 consecutive, aligned floats in one instruction
    (``red.global.add.v{2,4}.f32``, sm_90+): a half or a quarter of the L2 atomic requests of
    scalar adds."""
    n = len(values)
    assert n in (2, 4), n
    regs = ", ".join(f"${i + 1}" for i in range(n))
    llvm.inline_asm(None, [ptr.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)]
                    + [Float32(x).ir_value(loc=loc, ip=ip) for x in values],
                    f"red.global.add.v{n}.f32 [$0], {{{regs}}};", ",".join(["l"] + ["f"] * n),
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def _bulk_prefetch_l2(addr, nbytes, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(nbytes).ir_value(loc=loc, ip=ip)],
                    "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@cute.jit
def prefetch_l2(mT: cute.Tensor, first: Int32, rows: Int32):
    """Ask L2 for ``rows`` whole rows of the row-major ``mT`` from row ``first`` (sm_90+, a hint:
    no completion, nothing written). The bulk prefetch takes 16-byte units, so the range is
    trimmed to the whole units inside it: it never reaches outside the rows asked for."""
    start = cute.domain_offset((first, 0), mT).iterator.toint()
    end = start + Int64(rows) * Int64(mT.shape[1] * (mT.element_type.width // 8))
    start = (start + Int64(15)) & Int64(-16)
    end = end & Int64(-16)
    if end > start:
        _bulk_prefetch_l2(start, Int32(end - start))


@cute.jit
def store_partial_vector(mSlab: cute.Tensor, group: Int32, arow: Int32, colt: Int32, rPart: cute.Tensor,
                         i: cutlass.Constexpr, vec: cutlass.Constexpr, atomic: cutlass.Constexpr,
                         vector_atomics: cutlass.Constexpr = False):
    """``store_partial`` of the ``vec`` partials ``rPart[i, :]`` of column slice ``colt``: one
    vector store on the deterministic path (``vec`` scalar stores 4 bytes apart had each warp
    instruction touch ``vec`` times the sectors it filled). The atomic path adds them four
    (or two) at a time where ``vector_atomics`` (sm_90+) and ``vec`` allow, else one value at a time."""
    if cutlass.const_expr(atomic and vector_atomics and vec % 2 == 0):
        width = 4 if vec % 4 == 0 else 2
        for q in cutlass.range_constexpr(vec // width):
            red_add_f32_vector(ape_element(mSlab, arow, colt * vec + width * q),
                               [rPart[i, width * q + w] for w in range(width)])
    elif cutlass.const_expr(atomic):
        for v in cutlass.range_constexpr(vec):
            store_partial(mSlab, group, arow, colt * vec + v, rPart[i, v], atomic)
    else:
        gSlab = cute.zipped_divide(mSlab, (1, 1, vec))
        gSlab[(0, 0, None), (group, arow, colt)].store(rPart[i, None].load())


@cute.jit
def block_start(t0: Int32, blk: Int32, ratio: cutlass.Constexpr, n_tok: Int32):
    """(first token of the block, whether its previous block is valid), clamped into the pack.

    For offsets that passed validation the clamp changes nothing; for corrupt ones (never
    validated, or freed memory read through a stream race) it keeps every access inside kv and
    score, so a bad pack gives bad numbers instead of an illegal address.
    """
    own0 = cutlass.max(cutlass.min(t0 + blk * ratio, n_tok - ratio), 0)
    has_prev = blk > 0 and own0 >= ratio
    return own0, has_prev


@cute.jit
def guessed_block_start(row: Int32, n_rows: Int32, ratio: cutlass.Constexpr, n_tok: Int32):
    """(whether to guess, ``block_start`` of ``row`` guessed as ``row * ratio``) for a kernel
    that requests its first row before the lookup answers (``STREAM_FWD_GUESS``,
    ``STREAM_BWD_GUESS``). Guessed only in launches of ``n_tok / ratio`` rows: ``sum_s
    floor(L_s / ratio) = T / ratio`` holds only if no segment has a tail, so every real row's
    guess is right there."""
    whole = n_rows * ratio == n_tok
    own0, has_prev = block_start(Int32(0), row, ratio, n_tok)
    return whole, own0, has_prev


@cute.jit
def find_segment(mCuC: cute.Tensor, n_seg: Int32, row: Int32, warp: cutlass.Constexpr = False) -> Int32:
    """Segment ``s`` with ``cu_seqlens_comp[s] <= row < cu_seqlens_comp[s+1]``: a binary search,
    or with ``warp`` (the whole warp shares ``row`` and calls together) ``find_segment_warp``.

    O(log B) dependent loads of a tiny, L1-resident array, so packs of thousands of short
    segments cost the same per row as one long segment. Empty segments are skipped because
    the search keeps the last start that is <= row. Rows at or past ``cu_seqlens_comp[n_seg]``
    (padding) get some segment in range, which callers ignore.
    """
    lo = Int32(0)
    if cutlass.const_expr(warp):
        lo = find_segment_warp(mCuC, n_seg, row)
    else:
        hi = n_seg
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            if mCuC[mid] <= row:
                lo = mid
            else:
                hi = mid
    return lo


@cute.jit
def find_segment_warp(mCuC: cute.Tensor, n_seg: Int32, row: Int32) -> Int32:
    """``find_segment`` for a row the whole warp shares, all 32 lanes converged.

    Each round the 32 lanes probe 32 evenly spaced starts of the remaining range at once and a
    ballot keeps the last probe that is ``<= row``: ceil(log32 B) rounds of one load each
    (2 for 1024 segments) instead of log2 B dependent loads, and the same answer (the last
    start ``<= row``). Offsets out of order (unvalidated corrupt input) still end the loop,
    as the range shrinks 32-fold per round."""
    lane = cute.arch.lane_idx()
    lo = Int32(0)
    hi = n_seg
    while hi - lo > 1:
        step = (hi - lo + 31) >> 5
        probe = lo + lane * step
        ok = probe < hi
        if ok:
            ok = mCuC[probe] <= row
        below = cute.arch.popc(cute.arch.vote_ballot_sync(ok))
        lo = lo + cutlass.max(below - 1, 0) * step
        hi = cutlass.min(lo + step, hi)
    return lo


class PoolingKernel:
    """Static configuration every kernel class shares; ``family`` names the schedule it runs."""

    family = ""

    def __init__(self, ratio: int, coff: int, head_dim: int, sched, atomic: bool = False, pdl: bool = False,
                 lookup_loads: Optional[int] = None, vector_atomics: bool = False):
        assert sched.family == self.family, (sched.family, self.family)
        self.lookup_loads = lookup_loads  # overrides ``one_round_loads`` (a variant for some packs)
        self.ratio, self.coff, self.head_dim, self.sched = ratio, coff, head_dim, sched
        self.vec = sched.vec
        self.n_vec = head_dim // sched.vec
        self.width = coff * ratio
        self.atomic = atomic  # backward only: grad_ape by atomics instead of ordered slabs
        self.vector_atomics = vector_atomics  # ``red.global.add.v{2,4}.f32`` allowed (sm_90+)
        self.pdl = pdl  # programmatic dependent launch (``uses_pdl``, ``enter_grid``)
        # window family and online forward (rows across threads): when whole warps fit across
        # the columns, every warp works on one row at a time, so row lookups may vote. Not the
        # pipelined stream kernels: their CTA-wide rows would allow it, but the vote's registers
        # pushed the r16 forward from 64 to 67 registers (3 CTAs per SM instead of 4: 38 -> 48
        # us on the H200), for a lookup it makes once per CTA row.
        self.warp_rows = (sched.family == "window" or sched.online) and sched.col_threads % 32 == 0

    def one_round_loads(self, direction: str) -> int:
        """The widest one-round row lookup (``tiered_offsets``) this kernel takes, 0 for the
        search (``LOOKUP_ONE_ROUND``). Only where a whole warp shares its row: kernels with
        ``warp_rows`` (the direction's round), the pipelined stream kernels (CTA-wide rows; not
        the online forward, whose rows split warps where ``warp_rows`` is false);
        ``lookup_loads`` where given."""
        if self.lookup_loads is not None:
            return self.lookup_loads
        if self.warp_rows:
            return LOOKUP_ONE_ROUND[direction]
        if self.family == "stream" and not self.sched.online:
            return LOOKUP_ONE_ROUND[f"stream_{direction}"]
        return 0


class RowsForward(PoolingKernel):
    """Forwards launched as groups of ``cta_rows()`` output rows x the schedule's column tiles,
    with the tensors as their only arguments (the register-window, online and serial forwards)."""

    def cta_rows(self) -> int:
        """Output rows per CTA: the schedule's row lanes (``row_and_slice``)."""
        return self.sched.row_lanes

    def row_and_slice(self):
        """(output row, column slice) of this thread where a CTA is the schedule's ``row_lanes``
        rows x ``col_threads`` slices (x blocks over row groups, y over column tiles)."""
        ct = self.sched.col_threads
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        cv = by * ct + tidx % ct
        return bx * self.sched.row_lanes + tidx // ct, cv

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
        rows = self.cta_rows()
        self.kernel(mKV, mS, mApe, mCu, mCuC, mOut).launch(
            grid=((mOut.shape[0] + rows - 1) // rows, self.sched.col_tiles, 1),
            block=(self.sched.threads, 1, 1),
            stream=stream,
            use_pdl=self.pdl,
        )


@cute.jit
def release_dependents(pdl: cutlass.Constexpr):
    """Let the next grid launch (a kernel that chose ``enter_grid(pdl, release=False)``)."""
    if cutlass.const_expr(pdl):
        cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def enter_grid(pdl: cutlass.Constexpr, release: cutlass.Constexpr = True):
    """First statement of every kernel launched as a programmatic dependent (``pdl``): wait
    until the previous grid on the stream has finished and flushed, before the first global
    access (inputs may be its outputs; buffers it still reads may be ours to write). With
    ``release``, first let the next grid launch now (it waits for this one in turn). What
    overlaps is launch latency and CTA start-up, not work."""
    if cutlass.const_expr(pdl):
        if cutlass.const_expr(release):
            release_dependents(pdl)
        cute.arch.griddepcontrol_wait()


class BackwardKernel(PoolingKernel):
    """Both backward families launch alike: ``row_groups`` CTAs (one grad_ape slab each, walking
    ``rows_per_group`` rows per thread or per CTA as the family defines) plus ``zero_ctas``
    zero-fill CTAs, times the column tiles. ``interleaved``: a CTA's rows are spread over the
    pack instead of one contiguous run (``schedule.bwd_interleaved``; in the stream family only
    where ``schedule.stream_bwd_may_interleave`` compiled it in). ``column_cluster``: CTAs per
    thread-block cluster along the column tiles (``schedule.bwd_column_cluster``)."""

    def __init__(self, *args, column_cluster: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.column_cluster = column_cluster

    @cute.jit
    def __call__(
        self,
        mKV: cute.Tensor,  # (T, coff*d) bf16
        mS: cute.Tensor,  # (T, coff*d) bf16
        mApe: cute.Tensor,  # (ratio, coff*d) fp32
        mCu: cute.Tensor,  # (B+1,) int32
        mCuC: cute.Tensor,  # (B+1,) int32
        mGO: cute.Tensor,  # (total_comp, d) bf16
        mGKV: cute.Tensor,  # (T, coff*d) bf16
        mGS: cute.Tensor,  # (T, coff*d) bf16
        mSlab: cute.Tensor,  # (row_groups, ratio, coff*d) fp32 partial grad_ape
        rows_per_group: Int32,
        row_groups: Int32,
        zero_ctas: Int32,
        interleaved: Int32,
        stream,
    ):
        self.launch_grid(self.kernel(mKV, mS, mApe, mCu, mCuC, mGO, mGKV, mGS, mSlab,
                                     rows_per_group, row_groups, zero_ctas, interleaved), row_groups, zero_ctas, stream)

    def launch_grid(self, kernel, row_groups, zero_ctas, stream):
        """Launch ``kernel`` (a traced kernel call) on the backward grid: row groups and zero-fill
        CTAs times the column tiles."""
        kernel.launch(
            grid=(row_groups + zero_ctas, self.sched.col_tiles, 1),
            block=(self.sched.threads, 1, 1),
            cluster=self.launch_cluster(),
            stream=stream,
            use_pdl=self.pdl,
        )

    def launch_cluster(self):
        """Cluster dims of the launch, None for none."""
        n = self.column_cluster
        return (1, n, 1) if n > 1 else None


@cute.jit
def lane_pick(values: list, index: Int32):
    """Element ``index`` of the warp-wide array whose element ``32 * i + lane`` lane ``lane``
    holds in ``values[i]``: one shuffle per register, the register picked after."""
    picked = Int32(0)
    if cutlass.const_expr(len(values) == 1):
        picked = cute.arch.shuffle_sync(values[0], index)
    else:
        picked = cute.arch.shuffle_sync(values[0], index % 32)
        for i in cutlass.range_constexpr(1, len(values)):
            other = cute.arch.shuffle_sync(values[i], index % 32)
            if index // 32 == i:
                picked = other
    return picked


@cute.jit
def offsets_at(mCu: cute.Tensor, mCuC: cute.Tensor, index: Int32, n_seg: Int32, row: Int32):
    """(first row, first token, whether segment ``index`` starts at or before ``row``) of offset
    index ``index``; zeros and False past the end, where nothing is loaded."""
    c = Int32(0)
    t = Int32(0)
    if index <= n_seg:
        c = mCuC[index]
        t = mCu[index]
    below = index < n_seg
    if below:
        below = c <= row
    return c, t, below


@cute.jit
def segment_offsets_one_round(mCu: cute.Tensor, mCuC: cute.Tensor, n_seg: Int32, row: Int32,
                              span: cutlass.Constexpr, loads: cutlass.Constexpr):
    """``segment_offsets`` for a row the whole warp shares (all 32 lanes converged) in packs of
    fewer than ``32 * loads`` segments: lane ``j`` loads both offsets of the indices ``j, j +
    32, ...``, ballots count the segments starting at or before ``row`` (the last of them is
    the row's, as the search's), and shuffles hand out its offsets, ``cu_seqlens_comp[n_seg]``
    and, with ``span``, its end. One round of loads instead of probe rounds and then the
    segment's offsets."""
    lane = cute.arch.lane_idx()
    starts = []
    tokens = []
    count = Int32(0)
    for i in cutlass.range_constexpr(loads):
        c, t, below = offsets_at(mCu, mCuC, lane + 32 * i, n_seg, row)
        starts.append(c)
        tokens.append(t)
        count = count + cute.arch.popc(cute.arch.vote_ballot_sync(below))
    seg = cutlass.max(count - 1, 0)
    n_real = lane_pick(starts, n_seg)
    t0 = lane_pick(tokens, seg)
    lo = lane_pick(starts, seg)
    t1 = Int32(0)
    hi = Int32(0)
    if cutlass.const_expr(span):
        t1 = lane_pick(tokens, seg + 1)
        hi = lane_pick(starts, seg + 1)
    return n_real, t0, lo, hi, t1


@cute.jit
def searched_offsets(mCu: cute.Tensor, mCuC: cute.Tensor, n_seg: Int32, row: Int32,
                     warp_rows: cutlass.Constexpr, span: cutlass.Constexpr):
    """``segment_offsets`` by ``find_segment``: the padding test's load goes out with the first
    probe, the segment's offsets follow the search."""
    t1 = Int32(0)
    hi = Int32(0)
    n_real = mCuC[n_seg]
    seg = find_segment(mCuC, n_seg, row, warp_rows)
    t0 = mCu[seg]
    if cutlass.const_expr(span):
        t1 = mCu[seg + 1]
    lo = mCuC[seg]
    if cutlass.const_expr(span):
        hi = mCuC[seg + 1]
    return n_real, t0, lo, hi, t1


@cute.jit
def tiered_offsets(mCu: cute.Tensor, mCuC: cute.Tensor, n_seg: Int32, row: Int32, warp_rows: cutlass.Constexpr,
                   span: cutlass.Constexpr, loads: cutlass.Constexpr, widest: cutlass.Constexpr):
    """``segment_offsets`` of a warp-shared row in one round of ``loads`` offsets per lane where
    the pack has fewer than ``32 * loads`` segments, else with twice the loads, up to
    ``widest``, past which the search takes over. The fewest loads that cover the pack: a
    lane's loads are paid by every row (NOTES row 114)."""
    n_real = Int32(0)
    t0 = Int32(0)
    lo = Int32(0)
    hi = Int32(0)
    t1 = Int32(0)
    if n_seg < 32 * loads:
        n_real, t0, lo, hi, t1 = segment_offsets_one_round(mCu, mCuC, n_seg, row, span, loads)
    else:
        if cutlass.const_expr(2 * loads <= widest):
            n_real, t0, lo, hi, t1 = tiered_offsets(mCu, mCuC, n_seg, row, warp_rows, span, 2 * loads, widest)
        else:
            n_real, t0, lo, hi, t1 = searched_offsets(mCu, mCuC, n_seg, row, warp_rows, span)
    return n_real, t0, lo, hi, t1


@cute.jit
def segment_offsets(mCu: cute.Tensor, mCuC: cute.Tensor, n_seg: Int32, row: Int32,
                    warp_rows: cutlass.Constexpr, span: cutlass.Constexpr, one_round: cutlass.Constexpr):
    """(``cu_seqlens_comp[n_seg]``, first token, first row, end row, end token) of ``row``'s
    segment; the last two only with ``span`` (else 0). The search runs for padding rows too (it
    lands on some segment in range; callers override), so the padding test's load does not gate
    it (``LOOKUP_OVERLAPPED``). With ``one_round`` (the widest loads per lane, 0: none; only
    where the whole warp shares ``row``), packs of few segments take one round of loads instead
    (``tiered_offsets``)."""
    if cutlass.const_expr(one_round > 0):
        return tiered_offsets(mCu, mCuC, n_seg, row, warp_rows, span, 1, one_round)
    else:
        return searched_offsets(mCu, mCuC, n_seg, row, warp_rows, span)


@cute.jit
def row_start(mCu: cute.Tensor, mCuC: cute.Tensor, n_seg: Int32, row: Int32,
              warp_rows: cutlass.Constexpr = False, one_round: cutlass.Constexpr = 0):
    """(first token, block index) of ``row``; padding rows pool segment 0's first block.
    ``warp_rows``: every lane of the warp has this ``row`` and calls together (then the
    search is ``find_segment_warp``). ``one_round``: the widest one-round lookup for packs of
    few segments (``PoolingKernel.one_round_loads``; 0: the search)."""
    t0 = Int32(0)
    blk = Int32(0)
    if cutlass.const_expr(LOOKUP_OVERLAPPED):
        n_real, t0, slo, _, _ = segment_offsets(mCu, mCuC, n_seg, row, warp_rows, False, one_round)
        blk = row - slo
        if row >= n_real:
            t0 = Int32(0)
            blk = Int32(0)
    else:
        if row < mCuC[n_seg]:
            seg = find_segment(mCuC, n_seg, row, warp_rows)
            t0 = mCu[seg]
            blk = row - mCuC[seg]
    return t0, blk


@cute.jit
def row_span(mCu: cute.Tensor, mCuC: cute.Tensor, n_seg: Int32, row: Int32, warp_rows: cutlass.Constexpr = False,
             one_round: cutlass.Constexpr = 0):
    """(first token, first row, end row, end token) of ``row``'s segment, for walking consecutive
    rows: rows before the end row need no new lookup. A padding row pools segment 0's first
    block and spans only itself. ``warp_rows``, ``one_round``: as for ``row_start``."""
    t0 = Int32(0)
    t1 = Int32(0)
    lo = row
    hi = row + 1
    if cutlass.const_expr(LOOKUP_OVERLAPPED):
        n_real, t0, lo, hi, t1 = segment_offsets(mCu, mCuC, n_seg, row, warp_rows, True, one_round)
        if row >= n_real:
            t0 = Int32(0)
            t1 = Int32(0)
            lo = row
            hi = row + 1
    else:
        if row < mCuC[n_seg]:
            seg = find_segment(mCuC, n_seg, row, warp_rows)
            t0 = mCu[seg]
            t1 = mCu[seg + 1]
            lo = mCuC[seg]
            hi = mCuC[seg + 1]
    return t0, lo, hi, t1


@cute.jit
def widen_bf16(x: cute.TensorSSA, vec: cutlass.Constexpr) -> cute.TensorSSA:
    """A ``vec``-wide bf16 vector as fp32 (exact: bf16 is the top half of an fp32).

    Even widths go through 32-bit words: low element ``w << 16``, high element
    ``w & 0xffff0000``, one integer instruction each, where the generic conversion spends a
    byte permute and a shift on every high element."""
    if cutlass.const_expr(vec % 2 == 0):
        words = x.bitcast(Int32)
        lo = (words * Int32(65536)).bitcast(Float32)
        hi = (words & Int32(-65536)).bitcast(Float32)
        r = cute.make_rmem_tensor((vec,), Float32)
        for i in cutlass.range_constexpr(vec // 2):
            r[2 * i] = lo[i]
            r[2 * i + 1] = hi[i]
        return r.load()
    else:
        return x.to(Float32)


@cute.jit
def window_view(mT: cute.Tensor, own0: Int32, ratio: cutlass.Constexpr, coff: cutlass.Constexpr,
                vec: cutlass.Constexpr) -> cute.Tensor:
    """``mT`` re-based at the window's first token row (``own0 - ratio`` for coff 2) and
    divided into ``(1, vec)`` tiles: one 64-bit base address per row, after which every window
    position is a compile-time offset folded into the load instruction (indexing ``mT`` per
    position cost ~6 integer instructions per load in SASS)."""
    first = own0 - ratio if cutlass.const_expr(coff == 2) else own0
    return cute.zipped_divide(cute.domain_offset((first, 0), mT), (1, vec))


@cute.jit
def load_window(
    mKV: cute.Tensor,
    mS: cute.Tensor,
    gA: cute.Tensor,
    rS: cute.Tensor,
    rX: cute.Tensor,
    own0: Int32,
    has_prev: cutlass.Boolean,
    cv: Int32,
    ratio: cutlass.Constexpr,
    coff: cutlass.Constexpr,
    n_vec: cutlass.Constexpr,
    vec: cutlass.Constexpr,
    staged=None,
    ape_rows=None,
    prev0=None,
):
    """Gather one row's whole window for the columns ``[cv*vec, cv*vec+vec)`` into registers.

    The same gather as the stream family's ``gather_scores`` over positions ``[0, coff*ratio)``,
    written with every position known at compile time: routing the window family through the
    stream family's per-position gather cost ~30 extra integer instructions per thread
    (measured in PTX), 6-10% of the nearly compute-bound forward on the H200. ``mKV``/``mS``
    are the whole (T, coff*d) inputs (see ``window_view``).
    With ``staged`` (this thread's ``stage_slots``) kv and score come from shared memory,
    where ``stage_window`` copied them. ape comes from global (L1-resident) or, with
    ``ape_rows`` (this thread's ``(coff*ratio, vec)`` ape window, e.g. a view of ``stage_ape``),
    from there. With ``prev0`` (coff 2), the previous block is the one before row ``prev0``
    instead of the one before ``own0``: the bulk-copy forward's ring holds blocks that are not
    always adjacent.
    """
    wKV = window_view(mKV, own0, ratio, coff, vec)
    wS = window_view(mS, own0, ratio, coff, vec)
    pKV, pS = wKV, wS
    if cutlass.const_expr(prev0 is not None):
        pKV = window_view(mKV, prev0, ratio, coff, vec)
        pS = window_view(mS, prev0, ratio, coff, vec)
    for k in cutlass.range_constexpr(coff * ratio):
        # window row k: token own0 - ratio + k (coff 2) or own0 + k (coff 1)
        if cutlass.const_expr(coff == 2 and k < ratio):
            # previous block, first-half columns, ape row k
            if has_prev:
                gather_position(pKV, pS, gA, rS, rX, staged, k, cv, k, coff * ratio, vec, ape_rows)
            else:
                for v in cutlass.range_constexpr(vec):
                    rS[k, v] = -Float32.inf
                    rX[k, v] = Float32(0.0)
        else:
            i = k - ratio if cutlass.const_expr(coff == 2) else k
            colt = cv + n_vec if cutlass.const_expr(coff == 2) else cv
            gather_position(wKV, wS, gA, rS, rX, staged, k, colt, i, coff * ratio, vec, ape_rows)


@cute.jit
def kv_and_score(gKV: cute.Tensor, gS: cute.Tensor, staged, slot: cutlass.Constexpr, width: cutlass.Constexpr,
                 tok, colt, vec: cutlass.Constexpr):
    """kv and score of one window position as fp32 vectors: from this thread's staged slots
    (kv in row ``slot``, score in row ``width + slot``) or from ``(1, vec)`` tile ``(tok, colt)``
    of the global views."""
    if cutlass.const_expr(staged is not None):
        kvv = widen_bf16(staged[slot, None].load(), vec)
        scv = widen_bf16(staged[width + slot, None].load(), vec)
    else:
        kvv = widen_bf16(gKV[(0, None), (tok, colt)].load(), vec)
        scv = widen_bf16(gS[(0, None), (tok, colt)].load(), vec)
    return kvv, scv


@cute.jit
def gather_position(wKV: cute.Tensor, wS: cute.Tensor, gA: cute.Tensor, rS: cute.Tensor, rX: cute.Tensor,
                    staged, k: cutlass.Constexpr, colt: Int32, arow: cutlass.Constexpr,
                    width: cutlass.Constexpr, vec: cutlass.Constexpr, ape_rows=None):
    """``rS[k]`` = score + ape, ``rX[k]`` = kv of window row ``k`` (column slice ``colt``), kv
    and score from the staged slots or straight from the window views, ape from ``ape_rows[k]``
    or from global."""
    kvv, scv = kv_and_score(wKV, wS, staged, k, width, k, colt, vec)
    apv = None
    if cutlass.const_expr(ape_rows is not None):
        apv = ape_rows[k, None].load()
    else:
        apv = gA[(0, None), (arow, colt)].load()
    for v in cutlass.range_constexpr(vec):
        rS[k, v] = scv[v] + apv[v]
        rX[k, v] = kvv[v]


def can_stage(vec: int) -> bool:
    """cp.async moves 4, 8 or 16 bytes: bf16 vectors of 2, 4 or 8 elements (not odd head_dim)."""
    return vec >= 2


def stage_buffers(width: int, threads: int, vec: int, extra: int = 0, stages: int = 2):
    """``stages`` pipeline stages of per-thread bf16 slots in shared memory: ``width`` kv rows
    and ``width`` score rows (+ ``extra`` more rows, e.g. grad_out) of ``vec`` elements per
    thread. Thread-major within a row, so a warp's accesses to one row are consecutive (no bank
    conflicts)."""
    rows = 2 * width + extra
    smem = SmemAllocator()
    return smem.allocate_tensor(
        BFloat16,
        cute.make_layout((stages, rows, threads, vec), stride=(rows * threads * vec, threads * vec, vec, 1)), 16)


@cute.jit
def stage_slots(sBuf: cute.Tensor, stage: Int32, tidx: Int32) -> cute.Tensor:
    """One thread's ``(rows, vec)`` slots in one stage: kv rows ``[0, width)``, score rows
    ``[width, 2*width)``, then the extra rows."""
    return sBuf[stage, None, tidx, None]


def ape_tile(width: int, col_threads: int, vec: int):
    """A CTA's ape window in shared memory: ``(width, col_threads, vec)`` fp32, position-major,
    so a warp's vectors of one position are consecutive (no bank conflicts)."""
    return SmemAllocator().allocate_tensor(
        Float32, cute.make_layout((width, col_threads, vec), stride=(col_threads * vec, vec, 1)), 16)


@cute.jit
def stage_ape(gA: cute.Tensor, sApe: cute.Tensor, col_ok: cutlass.Boolean, cv: Int32, cvl: Int32, lane: Int32,
              lanes: cutlass.Constexpr, ratio: cutlass.Constexpr, coff: cutlass.Constexpr, n_vec: cutlass.Constexpr):
    """Fill ``ape_tile`` once per CTA: window position ``k`` of column slice ``cvl`` holds ape row
    ``k % ratio`` of the coff-half ``k // ratio``; the row lanes share the positions. The caller
    synchronises the CTA before reading it."""
    for k in cutlass.range_constexpr(coff * ratio):
        if k % lanes == lane and col_ok:
            colt = cv + n_vec if cutlass.const_expr(coff == 2 and k >= ratio) else cv
            sApe[k, cvl, None].store(gA[(0, None), (k % ratio, colt)].load())


@cute.jit
def copy_async(src: cute.Tensor, dst: cute.Tensor, vec: cutlass.Constexpr):
    """One ``vec``-wide bf16 vector global -> shared by cp.async (no registers, no wait)."""
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(), BFloat16, num_bits_per_copy=16 * vec)
    cute.copy(atom, src, dst)


@cute.jit
def stage_window(mKV: cute.Tensor, mS: cute.Tensor, slots: cute.Tensor, own0: Int32,
                 has_prev: cutlass.Boolean, cv: Int32, ratio: cutlass.Constexpr, coff: cutlass.Constexpr,
                 n_vec: cutlass.Constexpr, vec: cutlass.Constexpr):
    """Start copying one row's window (the positions ``load_window`` reads) into this thread's
    ``slots`` (``stage_slots``); invalid positions are skipped (``load_window`` never reads
    them)."""
    width = coff * ratio
    wKV = window_view(mKV, own0, ratio, coff, vec)
    wS = window_view(mS, own0, ratio, coff, vec)
    for k in cutlass.range_constexpr(width):
        if cutlass.const_expr(coff == 2 and k < ratio):
            if has_prev:
                copy_async(wKV[(0, None), (k, cv)], slots[k, None], vec)
                copy_async(wS[(0, None), (k, cv)], slots[width + k, None], vec)
        else:
            colt = cv + n_vec if cutlass.const_expr(coff == 2) else cv
            copy_async(wKV[(0, None), (k, colt)], slots[k, None], vec)
            copy_async(wS[(0, None), (k, colt)], slots[width + k, None], vec)


@cute.jit
def add_in_order(total: Float32, x: Float32, first: cutlass.Constexpr) -> Float32:
    """``total + x`` for the next term of a left-to-right sum, ``x`` itself for its first term:
    starting from ``0 + x`` would cost an add ptxas must keep (it turns -0 into +0)."""
    r = x
    if cutlass.const_expr(not first):
        r = total + x
    return r


@cute.jit
def softmax_column(rS: cute.Tensor, v: cutlass.Constexpr, width: cutlass.Constexpr) -> Float32:
    """In place: ``rS[:, v]`` becomes ``exp(s - max)``; returns the left-to-right sum.

    The order (max, exp, sequential sum) is the reference's, so with libdevice's ``expf``
    (what ``cute.math.exp`` lowers to, and what torch's CUDA ``exp`` runs) the bits match.
    """
    m = rS[0, v]
    for k in cutlass.range_constexpr(1, width):
        m = cute.arch.fmax(m, rS[k, v])
    den = Float32(0.0)
    for k in cutlass.range_constexpr(width):
        e = cute.math.exp(rS[k, v] - m)
        rS[k, v] = e
        den = add_in_order(den, e, k == 0)
    return den


@cute.jit
def padding_bound(mCuC: cute.Tensor, n_seg: Int32):
    """``cu_seqlens_comp[-1]``, the first padding row, for forwards that pool padding rows in
    the reference's exact steps (``EXACT_PADDING_ROWS``; with it off None: none is told apart).
    A kernel that walks rows loads it once, before its loop."""
    bound = None
    if cutlass.const_expr(EXACT_PADDING_ROWS):
        bound = mCuC[n_seg]
    return bound


@cute.jit
def padding_row(bound, row: Int32):
    """Whether ``row`` is a padding row under ``padding_bound``'s ``bound`` (None: not told)."""
    pad = None
    if cutlass.const_expr(bound is not None):
        pad = row >= bound
    return pad


#: Positions per iteration of ``padding_row_exact``'s loops: their loads go out together.
PADDING_UNROLL = 8


@cute.jit
def padding_row_exact(mKV: cute.Tensor, mS: cute.Tensor, mApe: cute.Tensor, col: Int32, ratio: cutlass.Constexpr,
                      coff: cutlass.Constexpr, head_dim: cutlass.Constexpr) -> Float32:
    """Output column ``col`` of every padding row in the reference's steps, read from global
    memory: segment 0's first block (tokens and ape rows ``0..ratio-1``; coff 2's previous half
    is invalid), its max, libdevice ``expf`` of ``s - max``, the denominator left to right,
    IEEE division, pinned products and their sum left to right. The reference adds coff 2's
    invalid positions first as exact zeros, so there both sums start from +0. For the stream
    forwards, whose own arithmetic re-associates (``EXACT_PADDING_ROWS``): the pipelined one
    takes it once per CTA that holds padding rows, the online one for each padding row."""
    colt = col + head_dim if cutlass.const_expr(coff == 2) else col
    unroll = min(PADDING_UNROLL, ratio)
    m = -Float32.inf
    for k in cutlass.range(ratio, unroll=unroll):
        m = cute.arch.fmax(m, mS[k, colt].to(Float32) + mApe[k, colt])
    den = Float32(0.0)
    for k in cutlass.range(ratio, unroll=unroll):
        den = den + cute.math.exp(mS[k, colt].to(Float32) + mApe[k, colt] - m)
    acc = Float32(0.0)
    start = 0
    if cutlass.const_expr(coff == 1):
        acc = mul_rn(mKV[0, colt].to(Float32), cute.math.exp(mS[0, colt].to(Float32) + mApe[0, colt] - m) / den)
        start = 1
    for k in cutlass.range(start, ratio, unroll=unroll):
        p = cute.math.exp(mS[k, colt].to(Float32) + mApe[k, colt] - m) / den
        acc = acc + mul_rn(mKV[k, colt].to(Float32), p)
    return acc


@cute.jit
def weights_and_products(rS: cute.Tensor, rX: cute.Tensor, v: cutlass.Constexpr, n: cutlass.Constexpr,
                         den: Float32, g: Float32) -> Float32:
    """Backward, column ``v`` of ``n`` positions: ``rS`` (exp) becomes ``p = e / den`` (correctly
    rounded), ``rX`` (kv) becomes ``p * (g * kv)``; returns their left-to-right sum."""
    rcp = rcp_of_den(den)
    total = Float32(0.0)
    for i in cutlass.range_constexpr(n):
        p = div_exact(rS[i, v], den, rcp)
        pd = mul_rn(p, mul_rn(g, rX[i, v]))
        rS[i, v] = p
        rX[i, v] = pd
        total = add_in_order(total, pd, i == 0)
    return total


@cute.jit
def store_zeros(gT: cute.Tensor, tok: Int32, colt: Int32, vec: cutlass.Constexpr, dtype: cutlass.Constexpr):
    """Write one ``vec``-wide slice of exact +0.0 (never-consumed gradient slots)."""
    z = cute.make_rmem_tensor((vec,), dtype)
    z.fill(0.0)
    gT[(0, None), (tok, colt)].store(z.load())


@cute.jit
def chunk_position(own0: Int32, has_prev: cutlass.Boolean, cv: Int32, k: Int32, ratio: cutlass.Constexpr,
                   coff: cutlass.Constexpr, n_vec: cutlass.Constexpr):
    """(token, column slice, ape row, valid) of window position ``k`` (SPEC section 2)."""
    tok = own0 + k
    colt = cv
    arow = k
    ok = k < coff * ratio
    if cutlass.const_expr(coff == 2):
        if k < ratio:
            tok = own0 - ratio + k
            ok = ok and has_prev
        else:
            tok = own0 + k - ratio
            colt = cv + n_vec
            arow = k - ratio
    return tok, colt, arow, ok


@cute.jit
def stage_chunk(gKV: cute.Tensor, gS: cute.Tensor, slots: cute.Tensor, own0: Int32, has_prev: cutlass.Boolean,
                cv: Int32, k0: Int32, chunk: cutlass.Constexpr, ratio: cutlass.Constexpr,
                coff: cutlass.Constexpr, n_vec: cutlass.Constexpr, vec: cutlass.Constexpr):
    """Start copying a chunk's valid positions (``chunk_position``) into this thread's ``slots``."""
    for i in cutlass.range_constexpr(chunk):
        tok, colt, arow, ok = chunk_position(own0, has_prev, cv, k0 + i, ratio, coff, n_vec)
        if ok:
            copy_async(gKV[(0, None), (tok, colt)], slots[i, None], vec)
            copy_async(gS[(0, None), (tok, colt)], slots[chunk + i, None], vec)
        else:
            stage_invalid(slots, i, vec)


@cute.jit
def stage_invalid(slots: cute.Tensor, i: cutlass.Constexpr, vec: cutlass.Constexpr):
    """Slot ``i`` of a position outside the window or the pack: kv 0 stored into the thread's own
    kv slot, so the gather from the slots needs no per-position test (a test there made every
    value carry a default through a branch). Its score slot stays stale: the gather sets such
    scores to -inf itself (``gather_scores``), as it must anyway to keep ape out of them."""
    slots[i, None].store(cute.full((vec,), 0.0, BFloat16))


@cute.jit
def safe_max(m: Float32) -> Float32:
    """The max to subtract: 0 for an all -inf set, so exp(-inf - 0) = 0 instead of NaN."""
    r = m
    if m == -Float32.inf:
        r = Float32(0.0)
    return r


@cute.jit
def zero_tokens(gGKV: cute.Tensor, gGS: cute.Tensor, begin: Int32, end: Int32, step: Int32, cv: Int32,
                coff: cutlass.Constexpr, n_vec: cutlass.Constexpr, vec: cutlass.Constexpr):
    """Exact zeros in column slice ``cv`` (the first ``coff`` halves) of tokens ``begin,
    begin+step, ... < end``, clamped into the pack like ``block_start``."""
    n_tok = gGKV.shape[1][0]
    begin = cutlass.max(begin, 0)
    end = cutlass.min(end, n_tok)
    n = (end - begin + step - 1) // step
    for j in cutlass.range(n, unroll=1):
        for half in cutlass.range_constexpr(coff):
            store_zeros(gGKV, begin + j * step, cv + half * n_vec, vec, BFloat16)
            store_zeros(gGS, begin + j * step, cv + half * n_vec, vec, BFloat16)


@cute.jit
def zero_fill_cta(gGKV: cute.Tensor, gGS: cute.Tensor, mCu: cute.Tensor, mCuC: cute.Tensor, zb: Int32,
                  lane: Int32, lanes: cutlass.Constexpr, zero_ctas: Int32, cv: Int32, n_tok: Int32,
                  coff: cutlass.Constexpr, n_vec: cutlass.Constexpr, vec: cutlass.Constexpr):
    """Zero-fill CTA ``zb`` of a backward grid: row lane ``lane`` of ``lanes`` zeroes segment
    ``zb * lanes + lane`` when it has no output row (shorter than ratio), then every
    ``zero_ctas * lanes``-th token past the last segment."""
    n_seg = mCu.shape[0] - 1
    seg = zb * lanes + lane
    if seg < n_seg:
        if mCuC[seg + 1] == mCuC[seg]:
            zero_tokens(gGKV, gGS, mCu[seg], mCu[seg + 1], 1, cv, coff, n_vec, vec)
    zero_tokens(gGKV, gGS, mCu[n_seg] + seg, n_tok, zero_ctas * lanes, cv, coff, n_vec, vec)
