"""Launch schedules for the fused kernels: pure Python, no CUDA, unit-tested on CPU.

A schedule fixes everything the compiled code depends on besides (ratio, coff, head_dim, arch):
the kernel family, the vector width and the CTA shape. Token and segment counts never enter
it, so they never recompile. The per-call choices are made here from the row count alone
(never from the SM count), so ``grad_ape`` bits depend on the shape and nothing else: how many
rows one backward thread (or stream CTA) walks, a runtime argument, and which of the stream
backward's two compiled schedules runs (``takes_few_rows_schedule``; both compile together).

CTA shape: ``col_threads`` threads across the head dimension (one ``vec``-wide column slice
each, coalesced along a token row) times ``row_lanes`` threads across output rows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache


def _per_direction(defaults: dict, env: str) -> dict:
    """``defaults`` with overrides from a tuning knob such as ``fwd=16,bwd=32`` (benchmark
    sweeps; read once at import)."""
    values = dict(defaults)
    for item in filter(None, os.environ.get(env, "").split(",")):
        direction, value = item.split("=")
        values[direction.strip()] = int(value)
    return values


#: Register-window family: threads per CTA we aim for, per direction. The forward's threads
#: each pool one row and exit, so small CTAs retire and refill at a finer grain: on the H200
#: 128 threads beat 256 (3x8192 r4 c2 d512 33.9 -> 33.0 us, 1x65536 80.4 -> 78.4, 512x256
#: 166.2 -> 163.4; 512 threads: 36.9 / 84.9 / 188.1). The backward keeps 256 (at 128, 3x8192
#: r4 c2 d512 67.4 -> 73.3 us). Tuning knob, e.g. CSA_FRONTEND_WINDOW_THREADS="fwd=128,bwd=256".
WINDOW_CTA_THREADS = _per_direction({"fwd": 128, "bwd": 256}, "CSA_FRONTEND_WINDOW_THREADS")
#: Register-window forward: pool each column by the checked fast path (MUFU exponentials, an
#: error bound, the exact path only where the bound cannot guarantee one bf16 step:
#: ``fast_pool_bound``) instead of always exactly. Tuning knob, CSA_FRONTEND_WINDOW_FWD_CHECKED=0.
WINDOW_FWD_CHECKED = os.environ.get("CSA_FRONTEND_WINDOW_FWD_CHECKED", "1") == "1"
#: Every forward: padding rows (``row >= cu_seqlens_comp[-1]``) take the reference's exact steps
#: (the register-window forwards their exact pooling, the stream forwards ``padding_row_exact``)
#: instead of the family's fast arithmetic. Every padding row pools the same window (segment 0's
#: first block), and so does row 0 where segment 0 starts the pack: a fast result one bf16 step
#: off on one column was off on every padding row too, which multiplied it past the contract's
#: max(1, 0.1%) differing elements (GPU fuzz seed 20163, r128 c2 d512, 24 rows and 3 padding
#: rows: 14 of 13824; NOTES row 182). Launches without padding rows run as before. Tuning knob
#: (A/B), CSA_FRONTEND_EXACT_PADDING_ROWS=0.
EXACT_PADDING_ROWS = os.environ.get("CSA_FRONTEND_EXACT_PADDING_ROWS", "1") == "1"
#: fp32 window values (positions x vec) one thread may hold per operand, per direction.
#: ptxas for sm_90a: r4/c2 at vec 8 (64 values) takes 144 registers forward and ~240 backward,
#: i.e. one 256-thread CTA per SM, which starves the memory system (H200, 2026-11-29: forward
#: at 19-42% of the DRAM floor). Swept on the H200 (benchmark/NOTES.md): forward is fastest at
#: 16 values (vec 2 for r4/c2, 5 CTAs per SM), backward at 32 (vec 4).
#: Tuning knob for experiments (benchmark sweeps), e.g. CSA_FRONTEND_WINDOW_BUDGET="fwd=16,bwd=32".
WINDOW_REGISTER_BUDGET = _per_direction({"fwd": 16, "bwd": 32}, "CSA_FRONTEND_WINDOW_BUDGET")
#: Register-window forward: windows of up to this many positions still run in the register
#: window at vec 2 (4-byte accesses, up to 32 values; 56-80 registers) where the budget above
#: would stream them. Measured on the H200 (NOTES row 89, fwd us stream -> window at vec 2):
#: 1x32768 d512 r5 c2 50.5 -> 36.5, r6 c2 44.6 -> 36.3, r7 c2 41.4 -> 36.1, r10 c1 25.9 -> 19.8,
#: r12 c1 22.9 -> 19.8, r14 c1 22.5 -> 20.0, r16 c1 20.6 -> 19.9; d128/d256 r6-r8 c2, r12-r16 c1
#: 14-20% faster. Not coff-2 windows of 16 positions (ratio 8) at head_dim >= 256, which the
#: stream forward runs faster (d512 38.7 against 44.1 us; d256 equal). Tuning knob,
#: CSA_FRONTEND_WINDOW_FWD_VEC2_POSITIONS (0: the budget alone decides).
WINDOW_FWD_VEC2_POSITIONS = int(os.environ.get("CSA_FRONTEND_WINDOW_FWD_VEC2_POSITIONS", "16"))
#: ... and the coff-2 windows it leaves to the stream forward: more positions than this, at
#: head_dim >= the second value.
WINDOW_FWD_VEC2_COFF2_STREAMED = (14, 256)
#: Register-window backward: past ratio ``WINDOW_BWD_BITWISE_RATIO`` windows of more than
#: ``WINDOW_BWD_LONG_POSITIONS`` positions are streamed although the budget admits them at vec
#: 2: from 13 positions ptxas needs 130-160 registers (one 256-thread CTA per SM) and the stream
#: backward is faster (H200, NOTES row 89, bwd us window -> stream: 1x32768 d512 r13 c1 49.3 ->
#: 42.8, r14 c1 50.5 -> 42.1, r16 c1 51.7 -> 42.6; r16 c1 d256 30.5 -> 24.3, d128 30.5 -> 23.3).
#: Ratios up to 8 keep the register window everywhere, with its bit-identical gradients (the
#: small-ratio contract), though at 14-16 positions the stream one is faster (r8 c2 d512 95.4
#: against 84.8 us, r7 c2 87.0 against 78.4).
WINDOW_BWD_BITWISE_RATIO = 8
WINDOW_BWD_LONG_POSITIONS = 12
#: Widest vector per direction: backward at vec 8 (r4 c1, 32 values) ran 3x8192 d512 in 46.6 us,
#: at vec 4 in 39.2 us (more CTAs per SM; measured before sessions 8-25 reworked the backward);
#: the forward keeps 16-byte accesses where they fit. Tuning knob, e.g.
#: CSA_FRONTEND_WINDOW_MAX_VEC="bwd=8".
WINDOW_MAX_VEC = _per_direction({"fwd": 8, "bwd": 4}, "CSA_FRONTEND_WINDOW_MAX_VEC")
#: Backward CTAs we aim for before a thread walks several rows: each CTA writes one grad_ape
#: partial slab, so more CTAs mean more slab traffic and a longer fixed-order reduction (1536
#: slabs cost 3x8192 r4 c1 d512 a third of its time), fewer leave SMs idle (192 CTAs: 44% of
#: the floor). 256 is one resident wave of 2 CTAs per SM on a 132-SM H100/H200 (measured on
#: the H200 with the pipelined backward: 3x8192 r4 c2 d512 69.1 -> 66.3 us against 512 CTAs,
#: 83.4 us at 384 = 1.45 waves). A constant, not the SM count, so the reduction order of
#: grad_ape is the same on every GPU.
BWD_TARGET_CTAS = int(os.environ.get("CSA_FRONTEND_BWD_CTAS", "256"))
#: Register-window backward: cp.async pipeline stages per coff (a thread's rows in flight:
#: ``stages - 1`` ahead of the one it computes). Measured on the H200 (NOTES row 45): 3 stages
#: were slower for coff 2 (3x8192 r4 c2 d512 66.2 -> 72.2 us, 1x65536 157 -> 174; suspected: two CTAs of
#: 104 KB leave L1 too small for the ape rows every row re-reads; with L1-bypassing 16-byte copies
#: a third stage only broke even, row 48) and within noise for coff 1 (3 or 4 stages: 36.1 ->
#: 35.6-36.2 us). Tuning knob, e.g. CSA_FRONTEND_WINDOW_BWD_STAGES="c1=2,c2=2".
WINDOW_BWD_STAGES = _per_direction({"c1": 2, "c2": 2}, "CSA_FRONTEND_WINDOW_BWD_STAGES")
#: Register-window backward: CTAs of at least this many row lanes stage their ape window once in
#: shared memory (``stage_ape``) instead of re-reading it from global (L1) for every row. ncu on
#: the H200 had put 37% of the 3x8192 r4 c2 d512 backward's warp samples on those loads. Measured
#: (H200, same runs): with 4-8 row lanes (head_dim <= 256) 5-11% faster on every shape tried
#: (3x8192 r4 c2 d128 21.7 -> 19.4 us, 64x1000 48.4 -> 46.6, 1x65536 r4 c2 d128 46.5 -> 42.9,
#: 1x32768 r4 c2 d256 46.7 -> 44.3, r1/r2 c2 d128, r4 c1 d128). With 2 (d512 at 256 threads) it
#: was mixed while threads walked up to 32 rows (1x65536 r4 c2 d512 152 -> 158); with the row cap
#: of 16 and the slab budget (BWD_MAX_ROWS_PER_THREAD) faster on 7 of 8 d512 shapes measured
#: (two rounds, e.g. 1x65536 r4 c1 87.6 -> 84.5, 3x8192 r1 c2 72.1 -> 69.4, 1x65536 r2 c2 158.0
#: -> 155.4; 3x8192 r4 c2 63.9 -> 61.6, where the rows did not change), slower on 1x32768 r4 c2
#: d512, 81.8 -> 83.5 (NOTES rows 104-105).
#: 1 stages it everywhere (one row lane, d >= 1024: not measured), 0 nowhere. Tuning knob,
#: CSA_FRONTEND_WINDOW_BWD_APE_TILE_LANES.
WINDOW_BWD_APE_TILE_LANES = int(os.environ.get("CSA_FRONTEND_WINDOW_BWD_APE_TILE_LANES", "2"))
#: Stream backward threads we aim for across the grid (one row at a time per CTA, one slab
#: each): 512 per SM on 128 SMs, rounded to whole CTAs per SM and capped at the resident ones
#: (``stream_row_ctas``). A constant, not the SM count (grad_ape's order).
STREAM_BWD_TARGET_THREADS = int(os.environ.get("CSA_FRONTEND_STREAM_BWD_THREADS", "65536"))
#: Both stream grids are also capped at one resident wave: the CTAs that fit at once on
#: STREAM_GRID_SMS SMs at the compiled kernel's register count (``resident_ctas_per_sm``; read
#: from its cubin at compile time). The thread targets count 512 threads per SM, true only of
#: 512- and 256-thread backward CTAs of <= 128 registers: one of 288-480 threads fits once per
#: SM (twice at <= 96-113 registers), so the target alone launched 1.2-1.7 waves, the last one
#: mostly idle. Measured on the H200 (session 23, backward us, target alone / one wave):
#: 1x16384 r48 c2 d256 41.6 / 28.7, 1x131072 r200 c2 d256 397.1 / 228.6, 1x65536 r100 c1 d512
#: 162.8 / 98.7, 4x8192 r13 c2 d1024 216.3 / 155.8; where a 320-thread CTA fits twice (96
#: registers) a one-per-SM grid lost 78 -> 103 us, hence the real register count. A constant
#: SM count, not the device's, so the row split (grad_ape's summation order) depends only on the
#: compiled kernel. Tuning knob (A/B), e.g. CSA_FRONTEND_STREAM_RESIDENT="fwd=0,bwd=0": the
#: thread targets alone.
STREAM_GRID_SMS = 128
#: The stream backward's grid laid over this many SMs instead of STREAM_GRID_SMS (0: that one);
#: a constant like it, so grad_ape's order still depends only on the compiled kernel and the row
#: count. Measured on the H100 only (session 55, graph replay, bwd us, 128 -> 112 SMs, clusters
#: of 2): 1x65536 r128 c2 d512 212.2-213.0 -> 201.2-201.9 (8 -> 7 row CTAs of 16 column tiles),
#: 1x131072 r128 c2 d512 408.3-409.3 -> 389.7-391.1, 1x32768 r128 c2 d512 114.1 -> 104.7,
#: 1x65536 r64 c2 d512 209.3-210.5 -> 203.0-205.4 (197.5-198.2 at 96). The gain holds with PDL
#: off and at the same clocks, but not under ncu (plain launches: 191.8 / 193.3 us, same bytes)
#: unless ncu leaves the previous call's dirty gradients in the L2 (session 56: 211.2 / 202.7).
#: But 1x65536 r256 c2 d512 238.6-240.6 -> 254.4 (4 -> 3 row CTAs), 1x8192 r128 c2 d128 12.2 ->
#: 12.9-13.0, 4x8192 r16 c2 d256 55.1-55.2 -> 56.2, and on the H200 112 SMs lost 4-10% on long
#: launches (session 60, STREAM_BWD_LONG_GRID_SMS): every launch keeps STREAM_GRID_SMS, and long
#: ones take STREAM_BWD_LONG_GRID_SMS where it is set. Tuning knob (A/B),
#: CSA_FRONTEND_STREAM_BWD_GRID_SMS: set, it lays every stream backward over that many SMs.
STREAM_BWD_GRID_SMS = int(os.environ.get("CSA_FRONTEND_STREAM_BWD_GRID_SMS", "0"))
#: Long stream backward launches (CTAs of at least STREAM_BWD_LONG_GRID_MIN_ROWS rows on the
#: STREAM_GRID_SMS grid) lay their grid over this many SMs where that scales the row CTAs
#: exactly (no column-tile rounding; ``stream_bwd_row_ctas``). Measured on the H100 only
#: (session 57, NOTES row 173, graph replay, bwd us, 128 SMs -> 112 for every launch, the
#: coff-2 walk on in both): 1x65536 r128 c2 d512 208.2-210.1 -> 193.9-194.6, 1x131072 r128 c2
#: d512 401.0-402.2 -> 377.5-377.8, 1x65536 r64 c2 d512 208.4 -> 200.0-200.3, 1x65536 r128 c2
#: d256 110.1-110.5 -> 104.9-105.3, 48x2048 r32 c2 d256 157.5-158.0 -> 154.0-155.5; walk off:
#: 1x65536 r64 c1 d512 107.7-108.5 -> 105.7-106.3. Short launches lose (CTAs of 2-11 rows:
#: 1x8192 r128 c2 d128 11.8 -> 12.7-12.9, 2x16384 r100 c2 d128 32.3-32.5 -> 33.6, 1x16384 r48 c2
#: d256 31.1 -> 32.9-33.0), and so does 1x65536 r256 c2 d512 (32 column tiles: 4 -> 3 row CTAs,
#: 218.2-218.6 -> 257.7-258.2): hence the two conditions. Left alone within noise: 64x2000 r32
#: c1 d128, 512x300 r64 c1 d128, 4x8192 r16 c2 d256 (55.0-58.9 -> 55.4-56.3). The rows-per-CTA
#: condition reads the launch's row count, so grad_ape's order is still the shape's. Suspected
#: cause (NOTES rows 170-171): the previous call's dirty L2 lines make the full grid's slowest SM
#: a straggler. Off by default since session 60 (NOTES row 176): on the H200 the 112-SM grid
#: loses on every launch it takes (bwd us, two rounds, the walk on in both, 128 -> 112 SMs):
#: 1x65536 r128 c2 d512 154.4-154.6 -> 169.2-170.1, 1x131072 r128 c2 d512 300.3-300.7 ->
#: 329.3-330.7, 1x65536 r128 c2 d256 80.9-81.6 -> 89.0-89.1, 1x131072 r128 c1 d128 42.6-42.7 ->
#: 44.6-45.0, 1x65536 r64 c1 d512 75.8 -> 79.3-79.4, 4x8192 r16 c2 d256 41.7 -> 45.8-46.1.
#: A device-dependent grid would make grad_ape's bits differ between the H100 and the H200, so
#: the H200, the product's target, sets it for both. 0: never; 112 for H100 runs. Tuning knob,
#: CSA_FRONTEND_STREAM_BWD_LONG_GRID_SMS.
STREAM_BWD_LONG_GRID_SMS = int(os.environ.get("CSA_FRONTEND_STREAM_BWD_LONG_GRID_SMS", "0"))
STREAM_BWD_LONG_GRID_MIN_ROWS = 16
STREAM_RESIDENT = _per_direction({"fwd": 1, "bwd": 1}, "CSA_FRONTEND_STREAM_RESIDENT")
#: The stream forward's wave is counted on the device's own SMs instead (0), or on this many:
#: its rows never meet across CTAs, so its bits do not depend on the grid. Measured on the
#: H200 (NOTES row 96, fwd us, 128 / 132 SMs): 1x65536 r200 c1 d192 24.0 / 20.9, 1x32768 r17 c1
#: d256 15.8 / 14.3, 1x32768 r24 c1 d512 24.2 / 22.7, 2x16384 r100 c2 d128 15.1 / 13.9, 1x65536
#: r37 c2 d512 78.1 / 75.3; no shape of 20 slower (the SPEC rows' grids are the same). Tuning
#: knob (A/B), e.g. CSA_FRONTEND_STREAM_FWD_GRID_SMS=128.
STREAM_FWD_GRID_SMS = int(os.environ.get("CSA_FRONTEND_STREAM_FWD_GRID_SMS", "0"))
#: The residency also counted in shared memory (``stream_shared_bytes``). Off: it binds before
#: the registers only for some forwards (about 79 KB per CTA, e.g. 224-thread r25 c2 d128, 2 per
#: SM), and on the H200 it changed no grid of the 8 forwards measured, the short ones slowed by
#: the one-wave grid included (their 224-thread CTAs take 62-68 KB, 3 fit; NOTES rows 93-94).
#: Tuning knob (A/B), CSA_FRONTEND_STREAM_SHARED_RESIDENT=1.
STREAM_SHARED_RESIDENT = os.environ.get("CSA_FRONTEND_STREAM_SHARED_RESIDENT", "0") == "1"
#: Shared memory an SM gives a CTA beyond its dynamic allocation: the hardware's 1 KB per CTA
#: and the kernel's 1 KB static segment (``.nv.shared`` in the cubin).
CTA_SHARED_OVERHEAD = 2 * 1024
#: Per-SM limits of sm_80 through sm_100 (registers, threads, CTAs), and the registers per
#: thread assumed where a kernel's own count is not known (the 512-thread cap).
REGISTER_FILE = 65536
REGISTER_UNIT = 256  # registers are allocated per warp in units of 256
MAX_THREADS_PER_SM = 2048
MAX_CTAS_PER_SM = 32
ASSUMED_REGISTERS = 128
#: Register-window backward: rows one thread walks before the grid grows past BWD_TARGET_CTAS
#: row groups, and the grad_ape slab bytes (row groups x ratio x coff x head_dim x 4) it may then
#: grow to before threads walk more rows (each slab costs its write and the reduction's read).
#: Measured on the H200 with the ape tile on in both (NOTES rows 104-105, two rounds, bwd us,
#: 32 -> 16 rows): 1x131072 r4 c1 d512 162.6 -> 155.9, 1x65536 r2 c2 d512 163.2 -> 155.4, r1 c2
#: 163.8 -> 161.5, 1x65536 r4 c1 d512 86.4 -> 84.4, 1x65536 r4 c2 d512 158.4 -> 151.3; but 1024
#: row groups of 16 KB slabs lost to 512 of 32 rows (1x131072 r4 c2 d512 298.5 / 291.6, 512x256
#: r4 c2 d512 298.6 / 295.2), hence the budget: 16 KB slabs stop at 512 groups. Why 32 rows
#: lose is not known. Tuning knobs, CSA_FRONTEND_BWD_MAX_ROWS and CSA_FRONTEND_BWD_SLAB_BYTES.
BWD_MAX_ROWS_PER_THREAD = int(os.environ.get("CSA_FRONTEND_BWD_MAX_ROWS", "16"))
BWD_SLAB_BYTES = int(os.environ.get("CSA_FRONTEND_BWD_SLAB_BYTES", str(8 << 20)))


@dataclass(frozen=True)
class Schedule:
    """Static launch facts of one compiled kernel (part of the compile key)."""

    family: str  # "window": whole window in registers; "stream": window split in chunks;
    # "serial": small forward launches in the reference's order (``serial_forward_schedule``)
    vec: int  # elements per thread access along head_dim (8 -> 16-byte bf16 accesses)
    col_threads: int  # threads across head_dim in one CTA
    row_lanes: int  # window family, online forward: threads across output rows; stream family: window chunks
    col_tiles: int  # CTAs across head_dim
    chunk: int = 0  # stream family: window positions per thread (online forward: per step of its walk)
    stages: int = 0  # window forward: bulk-copy pipeline stages (``bulk_forward_schedule``); 0: none
    online: bool = False  # stream forward: one thread walks a row's whole window (``online_fwd``)
    steal: int = 0  # window backward: rows at the back of a warp's run other warps may take (``WINDOW_BWD_STEAL``)

    @property
    def threads(self) -> int:
        return self.col_threads * self.row_lanes


def stages_ape_tile(sched: "Schedule") -> bool:
    """Whether the register-window backward of ``sched`` reads ape from a shared-memory tile
    (``WINDOW_BWD_APE_TILE_LANES``)."""
    return sched.family == "window" and 0 < WINDOW_BWD_APE_TILE_LANES <= sched.row_lanes


def vector_width(head_dim: int) -> int:
    """Widest access (8, 4, 2 or 1 bf16 elements) that keeps every row slice aligned.

    The slice starts of both window halves (``j`` and ``head_dim + j``) and every token row
    (stride ``coff * head_dim``) must be multiples of the width, so it must divide head_dim.
    """
    for vec in (8, 4, 2, 1):
        if head_dim % vec == 0:
            return vec
    return 1


def window_fits(ratio: int, coff: int, vec: int, direction: str = "fwd") -> bool:
    return coff * ratio * vec <= WINDOW_REGISTER_BUDGET[direction]


def window_at_vec2(ratio: int, coff: int, head_dim: int, direction: str) -> bool:
    """For a window that fits the values budget at no vector wider than 2: whether it runs in
    the register window at vec 2 (4-byte accesses). The forward also takes windows the budget
    would stream (``WINDOW_FWD_VEC2_POSITIONS``), the backward streams some it admits
    (``WINDOW_BWD_LONG_POSITIONS``): where each family measured faster."""
    positions = coff * ratio
    if direction == "fwd":
        if window_fits(ratio, coff, 2, direction):
            return True
        most, wide = WINDOW_FWD_VEC2_COFF2_STREAMED
        if coff == 2 and positions > most and head_dim >= wide:
            return False
        return positions <= WINDOW_FWD_VEC2_POSITIONS
    return (window_fits(ratio, coff, 2, direction)
            and (ratio <= WINDOW_BWD_BITWISE_RATIO or positions <= WINDOW_BWD_LONG_POSITIONS))


@lru_cache(maxsize=None)
def choose_schedule(ratio: int, coff: int, head_dim: int, direction: str = "fwd") -> Schedule:
    """The schedule for a configuration and direction; depends only on static facts."""
    vec = vector_width(head_dim)
    # Narrow the vector until the register window fits, but not below 4-byte accesses
    # (unless head_dim is odd); a window that still does not fit is streamed instead.
    narrow = min(vec, WINDOW_MAX_VEC[direction])
    while narrow > 1 and not window_fits(ratio, coff, narrow, direction):
        narrow //= 2
    if vec >= 2 and narrow <= 2:
        # the longest windows at 4-byte accesses: measured per family (``window_at_vec2``)
        fits, narrow = window_at_vec2(ratio, coff, head_dim, direction), 2
    else:
        fits = window_fits(ratio, coff, narrow, direction)
    if not fits:
        return _stream_schedule(ratio, coff, head_dim, vec, direction)
    return _window_schedule(head_dim, narrow, direction)


def _window_schedule(head_dim: int, vec: int, direction: str) -> Schedule:
    n_vec = head_dim // vec
    cta_threads = WINDOW_CTA_THREADS[direction]
    col_threads = min(n_vec, cta_threads)
    col_tiles = -(-n_vec // col_threads)
    row_lanes = max(1, cta_threads // col_threads)
    # whole warps (claims are per warp) and the cp.async walk (stolen rows' owners stage theirs)
    steal = WINDOW_BWD_STEAL if direction == "bwd" and vec >= 2 and col_threads * row_lanes % 32 == 0 else 0
    return Schedule("window", vec, col_threads, row_lanes, col_tiles, steal=steal)


#: Register-window backward at 16-byte accesses (vec 8: half the column threads, twice the row
#: lanes, half the memory instructions per byte) for long launches of ratio 4, coff 1 and
#: head_dim >= 512, whose default runs at vec 4 (``WINDOW_MAX_VEC``). Taken from this many rows
#: (``takes_wide_rows_schedule``). Measured on the H200 (session 38, two alternating rounds, bwd
#: us vec 4 -> vec 8): 1x65536 r4 c1 d512 84.03, 84.33 -> 80.94, 80.77 and 1x65536 r4 c1 d1024
#: 170.98, 171.86 -> 157.74, 158.08 (16384 rows); shorter launches lose: 3x8192 r4 c1 d512 (6144
#: rows) 33.1, 33.05 -> 35.84, 36.07, 3x8192 r4 c1 d1024 63.04, 62.76 -> 66.35, 66.64, 1x16384 r4
#: c1 d512 23.61, 23.66 -> 25.99, 26.08; and so did other ratios (3x8192 r2 c1 d512 34.32, 34.32 ->
#: 34.58, 34.79; session 26, NOTES row 105: 1x65536 r2 c1 d512 85.8 -> 87.0, r1 c2 161.5 -> 164.9).
#: Tuning knob, CSA_FRONTEND_WINDOW_BWD_WIDE_ROWS (0: never; the kernel is then not compiled).
WINDOW_BWD_WIDE_MIN_ROWS = int(os.environ.get("CSA_FRONTEND_WINDOW_BWD_WIDE_ROWS", "16384"))
WINDOW_BWD_WIDE_RATIO = 4
WINDOW_BWD_WIDE_MIN_HEAD_DIM = 512
#: The wide backward takes 137-138 registers (ptxas sm_90a, d512-d1024): one 256-thread CTA per
#: SM. Capped at 128 for two per SM (a 24 B spill), it lost everywhere (session 39, H200, bwd
#: us, two rounds, wide / two per SM: 1x65536 r4 c1 d512 81.78, 82.46 / 85.64, 85.63; d1024
#: 158.21, 158.44 / 163.69, 163.53; 3x8192 r4 c1 d512 36.22, 36.45 / 34.46, 34.50 against 33.16,
#: 33.03 at vec 4).


def wide_rows_schedule(ratio: int, coff: int, head_dim: int) -> "Schedule | None":
    """The register-window backward's schedule at 16-byte accesses for long launches
    (``WINDOW_BWD_WIDE_MIN_ROWS``), or None where the configuration has none."""
    if WINDOW_BWD_WIDE_MIN_ROWS <= 0 or (ratio, coff) != (WINDOW_BWD_WIDE_RATIO, 1):
        return None
    if head_dim < WINDOW_BWD_WIDE_MIN_HEAD_DIM or vector_width(head_dim) < 8:
        return None
    sched = choose_schedule(ratio, coff, head_dim, "bwd")
    if sched.family != "window" or sched.vec != 4 or not window_fits(ratio, coff, 8, "bwd"):
        return None
    return _window_schedule(head_dim, 8, "bwd")


def takes_wide_rows_schedule(n_rows: int, wide: "Schedule | None") -> bool:
    """Whether a backward launch of ``n_rows`` rows runs ``wide`` (``wide_rows_schedule``; the
    row-count bucket's schedule of its configuration, None where it has none)."""
    return (wide is not None and wide.family == "window" and WINDOW_BWD_WIDE_MIN_ROWS > 0
            and n_rows >= WINDOW_BWD_WIDE_MIN_ROWS)


#: Register-window forward fed by bulk copies (``window_fwd_bulk``): pipeline stages of
#: ``row_lanes`` output rows each, in flight per CTA (a stage's first row reads its previous
#: block from the stage before, so ``stages - 2`` load while one computes). Measured on the H200
#: (NOTES row 54): 5 beat 4 and equalled 6. 0 turns the bulk forward off. Tuning knob,
#: CSA_FRONTEND_WINDOW_FWD_BULK_STAGES.
WINDOW_FWD_BULK_STAGES = int(os.environ.get("CSA_FRONTEND_WINDOW_FWD_BULK_STAGES", "5"))
#: Bulk-copy forward: consumer threads per CTA (one producer warp more), CTAs resident per SM
#: (registers are capped to fit them; 3 or 4, with fewer stages, were slower on the H200), CTAs
#: we aim for (one resident wave on a 132-SM H100/H200, each walking a contiguous run of
#: stages; 2-8 waves of shorter runs were slower) and the shared memory of one SM.
WINDOW_FWD_BULK_THREADS = 256
WINDOW_FWD_BULK_CTAS_PER_SM = int(os.environ.get("CSA_FRONTEND_WINDOW_FWD_BULK_CTAS_PER_SM", "2"))
WINDOW_FWD_BULK_CTAS = int(os.environ.get("CSA_FRONTEND_WINDOW_FWD_BULK_CTAS", str(132 * WINDOW_FWD_BULK_CTAS_PER_SM)))
SM_SHARED_MEMORY = 228 * 1024
#: per CTA: an equal share of the SM, less the 1 KB the hardware reserves per CTA and 1 KB for
#: the barriers and row flags
WINDOW_FWD_BULK_SMEM = SM_SHARED_MEMORY // WINDOW_FWD_BULK_CTAS_PER_SM - 2 * 1024
#: Bulk-copy forward: stages a CTA requests at once when it starts; each later stage of the first
#: ``stages`` waits until the stage ``ramp`` before it has landed. All CTAs start together, and a
#: burst of all their stages made each CTA's first stage wait for most of the burst (H200,
#: 1x65536 r4 c2 d512: 75.0 us requesting all 5 stages at once, 72.7 at 2, 75.7 at 1).
#: Tuning knob, CSA_FRONTEND_WINDOW_FWD_BULK_RAMP.
WINDOW_FWD_BULK_RAMP = max(1, int(os.environ.get("CSA_FRONTEND_WINDOW_FWD_BULK_RAMP", "2")))
#: Bulk-copy forward: launches whose CTAs would walk fewer stages than this run the per-thread
#: forward instead. A CTA pays its pipeline's start (barriers, first lookup, the first stage's
#: latency with nothing to overlap) once; on the H200 r4 c2 d512 at 8 stages per CTA (1x8192)
#: ran 14.2 us against 12.1 per-thread, at 24 (3x8192) 31.6-33.1 against 33.2-34.0. Tuning
#: knob, CSA_FRONTEND_WINDOW_FWD_BULK_MIN_STAGES.
WINDOW_FWD_BULK_MIN_STAGES = int(os.environ.get("CSA_FRONTEND_WINDOW_FWD_BULK_MIN_STAGES", "16"))
#: Bulk-copy forward: the head dimensions and coff it serves. Measured on the H200 against the
#: per-thread forward, same runs: faster for coff 2 at head_dim 512 (1x65536 r4 72.7-75.3 us
#: against 78.0, 512x256 r4 141-145 against 163, 3x8192 r2 34.3 against 39.3, 1x65536 r1 91.0
#: against 98.3), slower for coff 1 (1x65536 r4 d512 41.7 against 40.7, r2 47.6 against 43.8)
#: and for head_dim 128-256 (1x262144 r4 c2 d128 81.6 against 79.4, 1x32768 r4 c2 d256 23.7
#: against 22.2); session 13 again: 64x1000 r4 c2 d128 25.1 against 23.1, 1x65536 r4 c2 d128 24.8
#: against 22.3. Tuning knob, CSA_FRONTEND_WINDOW_FWD_BULK_MIN_HEAD_DIM.
WINDOW_FWD_BULK_MIN_HEAD_DIM = int(os.environ.get("CSA_FRONTEND_WINDOW_FWD_BULK_MIN_HEAD_DIM", "512"))
WINDOW_FWD_BULK_COFFS = (2,)
#: Bulk-copy forward: the ratios it serves. With the checked fast pooling
#: (``WINDOW_FWD_CHECKED``) the per-thread forward issues ~29% fewer instructions and beat it
#: everywhere but ratio 2 (H200, session 18, two same-run rounds, fwd us per-thread / bulk,
#: coff 2 d512): 3x8192 r4 28.8 / 31.7-32.0, 1x65536 r4 68.8-68.9 / 73.4-73.6, 3x8192 r3
#: 29.0-29.3 / 31.7-31.9, 3x8192 r1 36.4-36.5 / 37.0-37.3, 1x16384 r4 d1024 37.2-37.4 / 37.2-37.5;
#: 512x256 r4 144.9-145.2 / 142.4-142.8 (short segments); ratio 2: 3x8192 34.6-34.7 /
#: 33.0-33.3, 1x65536 78.9 / 77.7-77.8.
WINDOW_FWD_BULK_RATIOS = (2,)


def bulk_block_bytes(ratio: int, coff: int, head_dim: int) -> int:
    """Bytes of one block (``ratio`` token rows of ``coff * head_dim`` bf16) of kv or score."""
    return ratio * coff * head_dim * 2


def bulk_smem_bytes(ratio: int, coff: int, head_dim: int, sched: "Schedule") -> int:
    """Shared memory of the bulk-copy forward: kv and score blocks of every stage's rows plus one
    previous block for a CTA's first row."""
    return 2 * (sched.stages * sched.row_lanes + 1) * bulk_block_bytes(ratio, coff, head_dim)


def arch_number(arch: "str | None") -> int:
    """``sm_90a`` -> 90; 0 for an unnamed arch."""
    return int("".join(filter(str.isdigit, arch or "")) or 0)


def sm90_or_later(arch: "str | None") -> bool:
    """Whether ``arch`` has the sm_90 features some launches use (programmatic dependent launch,
    vector atomics, bulk copies, thread-block clusters); an unnamed arch counts as older."""
    return arch_number(arch) >= 90


@lru_cache(maxsize=None)
def bulk_forward_schedule(ratio: int, coff: int, head_dim: int, arch: "str | None") -> "Schedule | None":
    """The bulk-copy schedule of the register-window forward, or None where it does not apply:
    not sm_90+ (``cp.async.bulk``), a stream-family window, a ratio, coff or head_dim it was slower on,
    token rows that are not whole 16-byte units (bulk copies move 16-byte multiples from 16-byte
    aligned addresses), more column slices than consumer threads, or fewer than 3 stages fitting
    in ``WINDOW_FWD_BULK_SMEM``."""
    base = choose_schedule(ratio, coff, head_dim, "fwd")
    if WINDOW_FWD_BULK_STAGES < 3 or not sm90_or_later(arch) or base.family != "window":
        return None
    n_vec = head_dim // base.vec
    if (coff not in WINDOW_FWD_BULK_COFFS or ratio not in WINDOW_FWD_BULK_RATIOS
            or head_dim < WINDOW_FWD_BULK_MIN_HEAD_DIM or (coff * head_dim) % 8 or n_vec > WINDOW_FWD_BULK_THREADS):
        return None
    rows = WINDOW_FWD_BULK_THREADS // n_vec
    for stages in range(WINDOW_FWD_BULK_STAGES, 2, -1):
        sched = Schedule("window", base.vec, n_vec, rows, 1, stages=stages)
        if bulk_smem_bytes(ratio, coff, head_dim, sched) <= WINDOW_FWD_BULK_SMEM:
            return sched
    return None


def bulk_stages_per_cta(n_rows: int, sched: Schedule) -> int:
    """Bulk-copy forward: consecutive stages one CTA walks (about WINDOW_FWD_BULK_CTAS CTAs)."""
    n_stages = -(-n_rows // sched.row_lanes)
    return max(1, -(-n_stages // WINDOW_FWD_BULK_CTAS))


def bulk_forward_walk(n_rows: int, bulk: "Schedule | None") -> int:
    """Stages per CTA of a forward launch of ``n_rows`` rows on the bulk-copy schedule ``bulk``
    (None: the configuration has none), or 0 where the per-thread forward runs instead: the
    launch's one runtime argument and the choice, in one computation per call."""
    if bulk is None:
        return 0
    per = bulk_stages_per_cta(n_rows, bulk)
    return per if per >= WINDOW_FWD_BULK_MIN_STAGES else 0


#: Stream family: window values (positions x vec) per thread, and threads per CTA. A CTA holds
#: one row's whole window (n_chunks lanes) for col_threads column slices. Swept on the H200
#: (benchmark/NOTES.md): the forward runs at 32 (at 16 it fits 64 registers and 4 CTAs per SM
#: but was 19% slower from the extra partials). The backward stays at 16 (its grad_ape
#: partials take registers too): at 32, ptxas needs 177 registers for 256 threads (one CTA per
#: SM) and spills at 512.
#: Tuning knob for experiments, e.g. CSA_FRONTEND_STREAM_CHUNK="fwd=32,bwd=16".
STREAM_CHUNK_VALUES = _per_direction({"fwd": 32, "bwd": 16}, "CSA_FRONTEND_STREAM_CHUNK")
#: Threads per stream CTA, per direction: the cap, used for windows of at least
#: STREAM_WIDE_CHUNKS chunks (smaller windows take 256). Wider CTAs give a warp more columns of
#: each token row. Forward: at 512, 16 column threads read a whole 128-byte line (at 256, 8
#: threads read half a line: ncu on the H200 showed the L2 81% busy at 61% of DRAM bandwidth
#: for r128 c2 d512, 89 us; at 512, 78 us). Backward: at 512 (one CTA of 128 registers per
#: SM), 32 -> 64 bytes per token row per warp (ncu: L2 tag lookups 83% -> 47% busy; r128 c2
#: d512 210.9 -> 203.2 us, 1x131072 425.1 -> 394.5 us, 1x8192 d128 16.2 -> 14.8 us).
#: Tuning knob, e.g. CSA_FRONTEND_STREAM_THREADS="fwd=256,bwd=256".
STREAM_CTA_THREADS = _per_direction({"fwd": 512, "bwd": 512}, "CSA_FRONTEND_STREAM_THREADS")
#: Windows of fewer chunks stay at 256 threads. Measured on the H200: the forward's 16-, 8- and
#: 4-chunk windows (r128 c1 d128, r64 c1 d512, r16 c2 d256) ran 6-48% slower at 512 threads.
#: The backward's 16- and 32-chunk windows had been slower at 512 too (r64 c1 d512 92.4 ->
#: 142.5 us), until the once-per-CTA combine (``STREAM_BWD_COMBINE_GROUPS``): with it, 512
#: threads run r64 c1 d512 in 79.7 us instead of 93.0, r128 c1 d128 48.4 instead of 49.1; the
#: 8-chunk r16 c2 d256 stays faster at 256 (43.2 against 44.8 us).
#: Tuning knob, e.g. CSA_FRONTEND_STREAM_WIDE_CHUNKS="fwd=32,bwd=16".
STREAM_WIDE_CHUNKS = _per_direction({"fwd": 32, "bwd": 16}, "CSA_FRONTEND_STREAM_WIDE_CHUNKS")
#: Stream forward: exp by ``ex2.approx`` (one FMA folds the max and log2(e), then
#: ``exp2_half_squared``: ~4 ulp, no flush to zero) instead of libdevice ``expf``. Measured on the
#: H200: r64 c1 d512 43.8 -> 38.4 us, r16 c2 d256 23.9 -> 21.9 us; the stream tolerance contract
#: holds (GPU tests).
STREAM_FAST_EXP = os.environ.get("CSA_FRONTEND_STREAM_FAST_EXP", "1") == "1"
#: Stream backward: ``ex2.approx`` exp (``exp2_half_squared``), ``rcp.approx`` weights
#: (``p = e * (1/den)``) and unpinned products (ptxas may contract them into FMAs) instead of
#: libdevice ``expf``, correctly rounded weights and pinned products. Tuning knob (A/B),
#: CSA_FRONTEND_STREAM_BWD_FAST_MATH=0.
STREAM_BWD_FAST_MATH = os.environ.get("CSA_FRONTEND_STREAM_BWD_FAST_MATH", "1") == "1"
#: Stream backward: CTAs of at least this many warp groups combine the per-row warp partials
#: (max, then den and T) once, in warps 0 and 1, and the other warps read the result, instead of
#: every warp combining all groups itself (same bits; two more barriers per row). ncu had put the
#: backward in the MIO pipe (NOTES row 37). Measured on the H200: at 16 groups (512 threads)
#: 1x65536 r128 c2 d512 174.5 -> 160.0 us, 1x131072 335.7 -> 307.8 us; at 8 groups within noise
#: (r128 c1 d128 48.7 -> 49.1, r64 c1 d512 89.7-92.7 -> 93.0). 0 turns it off.
#: Tuning knob, CSA_FRONTEND_STREAM_BWD_COMBINE_GROUPS.
STREAM_BWD_COMBINE_GROUPS = int(os.environ.get("CSA_FRONTEND_STREAM_BWD_COMBINE_GROUPS", "16"))


def chunks_per_warp(col_threads: int) -> int:
    """Stream family: window chunks one warp holds (``32 // col_threads`` chunk lanes, reduced by
    shuffles before anything goes through shared memory)."""
    return max(1, 32 // col_threads)


def warp_groups(sched: "Schedule") -> int:
    """Stream family: warps across a CTA's window chunks, i.e. the partials per column that are
    combined through shared memory."""
    assert not sched.online, "the online forward's row_lanes are output rows, not window chunks"
    return sched.row_lanes // chunks_per_warp(sched.col_threads)


def combines_once_per_cta(sched: "Schedule") -> bool:
    """Whether the stream backward of ``sched`` combines its warp partials once per CTA (warps 0
    and 1) rather than in every warp (``STREAM_BWD_COMBINE_GROUPS``). Only where one warp spans
    every column thread: at more than 32 (knob-made CTAs of 1024 threads) warp 0 would combine
    half the columns and the others would read stale results."""
    groups = warp_groups(sched)
    return sched.col_threads <= 32 and groups > 1 and 0 < STREAM_BWD_COMBINE_GROUPS <= groups


#: Stream backward: column tiles launched as thread-block clusters of this many CTAs (cluster
#: dims (1, n, 1)), so that CTAs reading neighbouring pieces of the same token rows (8 column
#: threads at vec 4 read 64 bytes of each row: half a 128-byte line) start together on one GPC
#: and ask for each line once. Measured on the H100 (session 53, alternating rounds, bwd us,
#: 1 -> 2): 1x65536 r128 c2 d512 265.0, 266.0 -> 214.8, 214.9 (ncu: DRAM reads 325 -> 269 MB,
#: the bytes that must be read; L2 read lookup misses 1.37x -> 0.99x the read sectors);
#: 1x131072 r128 c2 d512 556.4, 555.5 -> 413.4, 414.0; 1x65536 r128 c2 d256 123.1, 122.4 ->
#: 113.1, 113.2; 1x65536 r64 c2 d512 217.8, 218.1 -> 212.9, 213.1; r128 c1 d128, r64 c1 d512,
#: r16 c2 d256, 1x8192 r128 c2 d128 and r200 c1 d192 within 1% (session 54, five runs each:
#: r16 c2 d256 medians 55.7 -> 56.4; session 62 again 55.6 -> 56.8, and r128 c2 d512 270 -> 213;
#: session 63 55.8 -> 56.1, while the other tiles of 32 column threads gained or tied: r64 c1
#: d512 110.3 -> 109.2, r32 c2 d256 109.9 -> 108.9, r16 c2 d512 113.2 both; NOTES row 178).
#: Clusters of 4 lost on all three r128 c2 rows (1x65536 d512 315.7). The H200 (the same GH100
#: die and GPCs, faster memory) read no extra DRAM bytes there but counted the same 1.44x lookup
#: misses (NOTES row 164); with clusters (session 64, two alternating rounds, 1 -> 2) it gains
#: under 1%: 1x65536 r128 c2 d512 155.0, 155.0 -> 154.3, 154.6; 1x131072 301.2, 301.1 -> 300.0,
#: 300.6; r128 c2 d256 81.4, 81.4 -> 80.9, 81.1; r64 c2 d512 145.7, 145.7 -> 146.0, 145.9; r16
#: c2 d256 41.6, 41.6 -> 41.6, 41.7 (NOTES row 179). Clusters need sm_90: other arches launch
#: none; 1 launches none. Tuning knob, CSA_FRONTEND_STREAM_BWD_CLUSTER (1, 2, 4 or 8).
STREAM_BWD_COLUMN_CLUSTER = int(os.environ.get("CSA_FRONTEND_STREAM_BWD_CLUSTER", "2"))
PORTABLE_CLUSTER_SIZES = (1, 2, 4, 8)


def bwd_column_cluster(sched: "Schedule", arch: "str | None") -> int:
    """CTAs per thread-block cluster along the column tiles of a backward launch of ``sched``
    for ``arch``: ``STREAM_BWD_COLUMN_CLUSTER`` for stream schedules whose column tiles it
    divides, on sm_90 or later, else 1 (an unnamed arch, like ``uses_pdl``'s, gets none)."""
    n = STREAM_BWD_COLUMN_CLUSTER
    if n not in PORTABLE_CLUSTER_SIZES:
        raise ValueError(f"CSA_FRONTEND_STREAM_BWD_CLUSTER: expected one of {PORTABLE_CLUSTER_SIZES}, got {n}")
    if sched.family != "stream" or sched.col_tiles % n or not sm90_or_later(arch):
        return 1
    return n


#: Stream forward: whether the cp.async row pipeline is used, per coff (else kv and score load
#: straight from global). Tuning knob, e.g. CSA_FRONTEND_STREAM_FWD_STAGED="c1=1,c2=1".
#: Measured on the H200: staging helps coff 1 (r64 c1 d512 38.4 -> 37.1 us) and, since the
#: 512-thread CTAs, coff 2 (1x65536 r128 c2 d512 78.4 -> 68.5 us, r16 c2 d256 22.6 -> 22.0 us; at
#: 256 threads it had cost r128 c2 d512 88.0 -> 92.9 us).
STREAM_FWD_STAGED = _per_direction({"c1": 1, "c2": 1}, "CSA_FRONTEND_STREAM_FWD_STAGED")


def _floor_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _ceil_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


#: Widest stream vector per direction (swept on the H200: the forward at vec 8 lost 2-20%
#: against vec 4; the backward at vec 8 lost 19-40% and at vec 2 9-16% on r128 c1 d128, r64 c1
#: d512, r16 c2 d256 and r128 c2 d512, NOTES rows 84 and 87). Tuning knob, e.g.
#: CSA_FRONTEND_STREAM_MAX_VEC="fwd=8,bwd=4".
STREAM_MAX_VEC = _per_direction({"fwd": 4, "bwd": 4}, "CSA_FRONTEND_STREAM_MAX_VEC")


#: Stream forwards of windows of at most this many positions (``coff * ratio``) run the online
#: forward (``online_fwd``: a thread per output row and column slice walks the whole window in
#: chunks of ``STREAM_FWD_ONLINE_CHUNK`` positions, an online softmax, no shared memory or
#: barriers) instead of the CTA-per-rows pipeline. Measured on the H200 (session 46, two
#: alternating rounds, fwd us pipeline / online at chunk 4): 4x8192 r16 c2 d256 19.9, 19.9 /
#: 19.3, 19.5; 1x65536 r16 c2 d256 37.4, 37.1 / 35.9, 36.1; 16x8192 r16 c2 d256 70.0, 70.4 /
#: 67.1, 67.3. Longer windows lose or tie: 1x65536 r32 c2 d128 19.3, 19.3 / 21.3, 21.3, 1x65536
#: r64 c1 d512 35.8, 36.0 / 35.5, 35.7; at chunk 8 (74-87 registers) every one lost. On by
#: default since session 47 (the GPU suite, fuzz seeds 13298-13497, memcheck and initcheck ran
#: with it); 0 turns it off (``online_forward_off`` tests the pipeline on short windows). Tuning
#: knobs, CSA_FRONTEND_STREAM_FWD_ONLINE and CSA_FRONTEND_STREAM_FWD_ONLINE_CHUNK.
STREAM_FWD_ONLINE_MEASURED_WINDOW = 32
STREAM_FWD_ONLINE_WINDOW = int(os.environ.get("CSA_FRONTEND_STREAM_FWD_ONLINE", str(STREAM_FWD_ONLINE_MEASURED_WINDOW)))
STREAM_FWD_ONLINE_CHUNK = int(os.environ.get("CSA_FRONTEND_STREAM_FWD_ONLINE_CHUNK", "4"))
#: ... and of head dims up to this: from d512 on the pipeline reads whole token rows near the
#: floor and the online forward (each coff-2 half of a token row read by another output row)
#: does not beat it. Session 47, H200, fwd us pipeline / online, two rounds: 1x65536 r8 c2 d512
#: 70.7, 70.6 / 75.1, 75.0 (copy 67.5); r16 c2 d512 70.1, 70.2 / 69.8, 69.6; r32 c1 d512 37.0,
#: 36.8 / 36.2, 36.3; where below it wins: 4x8192 r8 c2 d256 24.1, 24.4 / 21.1, 21.0; 1x65536
#: r12 c2 d128 24.5, 24.6 / 22.5, 22.4; r32 c1 d128 12.8, 12.8 / 11.8, 11.7. Tuning knob,
#: CSA_FRONTEND_STREAM_FWD_ONLINE_MAX_HEAD_DIM.
STREAM_FWD_ONLINE_MAX_HEAD_DIM = int(os.environ.get("CSA_FRONTEND_STREAM_FWD_ONLINE_MAX_HEAD_DIM", "256"))

#: Online forward: threads per CTA (``_online_schedule``; 128 measured the same on the r16 rows
#: above).
STREAM_FWD_ONLINE_THREADS = 256


def takes_online_forward(ratio: int, coff: int, head_dim: int, direction: str) -> bool:
    """Whether a stream-family ``direction`` of this config runs the online forward."""
    return (direction == "fwd" and coff * ratio <= STREAM_FWD_ONLINE_WINDOW
            and head_dim <= STREAM_FWD_ONLINE_MAX_HEAD_DIM)


def _online_schedule(vec: int, head_dim: int) -> Schedule:
    """The online forward's CTA of ``STREAM_FWD_ONLINE_THREADS``: a power of two of column
    threads covering the head dim's ``vec`` slices (at most the CTA), the rest over output rows;
    column tiles for what one CTA row does not cover."""
    n_vec = head_dim // vec
    col_threads = min(_ceil_pow2(n_vec), STREAM_FWD_ONLINE_THREADS)
    return Schedule("stream", vec, col_threads, STREAM_FWD_ONLINE_THREADS // col_threads,
                    -(-n_vec // col_threads), STREAM_FWD_ONLINE_CHUNK, online=True)


def _stream_schedule(ratio: int, coff: int, head_dim: int, vec: int, direction: str,
                     threads: int = 0) -> Schedule:
    vec = min(vec, STREAM_MAX_VEC[direction])
    if takes_online_forward(ratio, coff, head_dim, direction):
        return _online_schedule(vec, head_dim)
    chunk = max(1, STREAM_CHUNK_VALUES[direction] // vec)
    n_chunks = -(-coff * ratio // chunk)
    n_vec = head_dim // vec
    # Both directions reduce the chunks of a warp by shuffles: col_threads is a power of two and
    # the chunk count is padded (with empty chunks) to whole warps.
    if not threads:
        threads = STREAM_CTA_THREADS[direction]
        if n_chunks < STREAM_WIDE_CHUNKS[direction]:
            threads = min(256, threads)
    col_threads = min(_floor_pow2(threads // n_chunks), _floor_pow2(2 * n_vec - 1))
    per_warp = chunks_per_warp(col_threads)
    n_chunks = -(-n_chunks // per_warp) * per_warp
    col_tiles = -(-n_vec // col_threads)
    return Schedule("stream", vec, col_threads, n_chunks, col_tiles, chunk)


#: Row-count bucket of the stream backward: launches whose CTAs walk at most this many rows
#: are a serial latency chain per CTA (row lookup, staging, the barriers of each row) rather than a
#: stream of bytes, and run a second compiled schedule (``few_rows_schedule``): vec 2 at the
#: default's CTA width, i.e. half the columns per thread, shorter reductions per row. Measured
#: on the H200: 1x8192 r128 c2 d128 (2 rows per CTA) 15.3 -> 13.4 us; with many rows per CTA the
#: vec-2 schedule is slower (1x65536 r128 c2 d512 175 -> 199 us, 1x262144 r128 c2 d128 177 ->
#: 202 us). 0 turns the bucket off. Tuning knob, e.g. CSA_FRONTEND_STREAM_BWD_FEW_ROWS=0.
STREAM_BWD_FEW_ROWS = int(os.environ.get("CSA_FRONTEND_STREAM_BWD_FEW_ROWS", "2"))
#: Few-rows schedule: windows of at most this many positions (``coff * ratio``) whose default
#: CTA has 512 threads run it in 256-thread CTAs (two per SM, up to 8 warp groups each, so every
#: warp combines and a row has two barriers) instead of the default's width. Measured on the
#: H200, same run, bwd us default width / 256 threads: 1x4096 r64 c1 d512 10.9 / 9.8-9.9, 1x8192
#: r128 c1 d128 8.2-8.3 / 7.9, 1x16384 r128 c1 d128 10.4 / 10.1-10.2, 1x4096 r64 c2 d256
#: 10.7-10.8 / 10.5; wider windows lose (2x4096 r200 c1 d192 10.7 / 10.7, 1x8192 r256 c1 d256
#: 11.0-11.1 / 12.0-12.1, 1x8192 r128 c2 d128 11.3 / 12.7, 1x16384 r128 c2 d128 18.3 / 21.7).
#: 0 keeps the default's width everywhere. Tuning knob, CSA_FRONTEND_STREAM_BWD_FEW_ROWS_NARROW.
STREAM_BWD_FEW_ROWS_NARROW = int(os.environ.get("CSA_FRONTEND_STREAM_BWD_FEW_ROWS_NARROW", "128"))
STREAM_BWD_FEW_ROWS_NARROW_THREADS = 256


@lru_cache(maxsize=None)
def few_rows_schedule(ratio: int, coff: int, head_dim: int) -> "Schedule | None":
    """The stream backward's schedule for launches of few rows per CTA (``STREAM_BWD_FEW_ROWS``),
    or None where the default has no narrower variant (window family, vec already <= 2): vec 2,
    at the default's CTA width, or at 256 threads instead of 512 for windows of at most
    ``STREAM_BWD_FEW_ROWS_NARROW`` positions."""
    sched = choose_schedule(ratio, coff, head_dim, "bwd")
    if sched.family != "stream" or sched.vec <= 2:
        return None
    threads = sched.threads
    if coff * ratio <= STREAM_BWD_FEW_ROWS_NARROW and threads == 2 * STREAM_BWD_FEW_ROWS_NARROW_THREADS:
        # measured only against 512-thread defaults; other widths keep theirs
        threads = STREAM_BWD_FEW_ROWS_NARROW_THREADS
    return _stream_schedule(ratio, coff, head_dim, 2, "bwd", threads=threads)


#: Rows per CTA up to which a launch takes the few-rows schedule where that schedule is the
#: narrow-window one (256-thread CTAs). Measured on the H200, same run, bwd us at 2 / 4 / 8:
#: 4 rows per CTA 1x32768 r128 c1 d128 17.9 / 15.3 / 15.3, 1x8192 r64 c1 d512 17.3-17.4 / 15.0 /
#: 15.0, 1x8192 r64 c2 d256 17.0 / 16.0 / 15.9; 8 rows per CTA 1x65536 r128 c1 d128 27.8 / 27.7-27.8
#: / 26.5, 1x16384 r64 c1 d512 26.3 / 26.3 / 26.0, 1x16384 r64 c2 d256 26.9 / 26.8-26.9 / 27.4.
#: Tuning knob, CSA_FRONTEND_STREAM_BWD_FEW_ROWS_NARROW_ROWS.
STREAM_BWD_FEW_ROWS_NARROW_ROWS = int(os.environ.get("CSA_FRONTEND_STREAM_BWD_FEW_ROWS_NARROW_ROWS", "4"))


def row_bucket_schedule(ratio: int, coff: int, head_dim: int) -> "Schedule | None":
    """The backward's second schedule, taken by launches of some row counts and compiled with
    the default: the stream family's few-rows schedule or the register window's wide one
    (at most one of them exists per configuration), or None."""
    return few_rows_schedule(ratio, coff, head_dim) or wide_rows_schedule(ratio, coff, head_dim)


def takes_few_rows_schedule(n_rows: int, sched: Schedule, few: "Schedule | None",
                            resident: "int | None" = None) -> bool:
    """Whether a backward launch of ``n_rows`` rows runs the few-rows schedule ``few``
    (``few_rows_schedule``; None where the configuration has none) instead of ``sched`` (the
    default): its CTAs would walk at most ``STREAM_BWD_FEW_ROWS`` rows, or
    ``STREAM_BWD_FEW_ROWS_NARROW_ROWS`` where ``few`` is the narrow-window variant (fewer
    threads than the default). ``resident``: the default kernel's residency."""
    limit = few_rows_limit(sched, few)
    return limit > 0 and bwd_rows_per_thread(n_rows, sched, resident) <= limit


def few_rows_limit(sched: Schedule, few: "Schedule | None") -> int:
    """Rows per CTA of ``sched`` (the default) up to which a launch takes the few-rows schedule
    ``few`` (``takes_few_rows_schedule``), or 0 where it never does."""
    if few is None or sched.family != "stream" or STREAM_BWD_FEW_ROWS <= 0:
        return 0
    if few.threads < sched.threads:
        return max(STREAM_BWD_FEW_ROWS, STREAM_BWD_FEW_ROWS_NARROW_ROWS)
    return STREAM_BWD_FEW_ROWS


def resident_ctas_per_sm(threads: int, registers: int = ASSUMED_REGISTERS) -> int:
    """CTAs of ``threads`` threads at ``registers`` registers each that an SM holds at once, by
    registers, threads and the CTA limit. Shared memory is not counted: the stream backward's
    (144 bytes per thread plus its partials) never binds first, but some stream forwards take
    about 79 KB (e.g. 224 threads at r25 c2 d128), 2 CTAs per SM where <= 97 registers would
    allow 3 (likewise some 96- and 128-thread forwards); NOTES rows 93-94."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    return max(1, min(REGISTER_FILE // (per_warp * warps), MAX_THREADS_PER_SM // (warps * 32), MAX_CTAS_PER_SM))


def stream_row_ctas(sched: Schedule, direction: str, resident: "int | None" = None,
                    sms: "int | None" = None) -> int:
    """Stream CTAs along the rows (backward: one grad_ape slab each), over the column tiles: on
    each of ``sms`` SMs (None: STREAM_GRID_SMS, or STREAM_BWD_GRID_SMS where the backward sets
    one) the direction's thread target in whole CTAs, rounded up, but no more than fit at once
    (``resident``, the compiled kernel's residency; None: at ASSUMED_REGISTERS). So the grid is
    one wave, the same number of CTAs on every SM."""
    assert not sched.online, "the online forward is launched by output rows alone"
    target = STREAM_FWD_TARGET_THREADS if direction == "fwd" else STREAM_BWD_TARGET_THREADS
    if not STREAM_RESIDENT[direction]:
        return max(1, target // sched.threads // sched.col_tiles)
    if sms is None and direction == "bwd":
        sms = STREAM_BWD_GRID_SMS
    sms = sms or STREAM_GRID_SMS
    return _row_ctas_on(sms, _stream_ctas_per_sm(sched, direction, target, resident), sched)


def _row_ctas_on(sms: int, per_sm: int, sched: Schedule) -> int:
    """Row CTAs of a one-wave grid of ``per_sm`` CTAs on each of ``sms`` SMs, over the column
    tiles (rounded down, at least one)."""
    return max(1, sms * per_sm // sched.col_tiles)


def _stream_ctas_per_sm(sched: Schedule, direction: str, target: int, resident: "int | None") -> int:
    # the target per SM stays that of STREAM_GRID_SMS SMs whatever the grid's SM count (for
    # every CTA width of 32-1024 threads it rounds to the same CTAs at 132): only that count
    # scales the grid
    per_sm = -(-target // (STREAM_GRID_SMS * sched.threads))
    per_sm = min(per_sm, resident or resident_ctas_per_sm(sched.threads))
    if STREAM_SHARED_RESIDENT:
        per_sm = min(per_sm, max(1, SM_SHARED_MEMORY // (stream_shared_bytes(sched, direction) + CTA_SHARED_OVERHEAD)))
    return per_sm


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


def stream_shared_bytes(sched: Schedule, direction: str) -> int:
    """Dynamic shared memory of the stream kernel of ``sched`` (with the default staging), as its
    allocations lay it out, each 16-byte aligned: the staging ring (2 stages x the chunk's kv and
    score rows, + a grad_out row backward, x threads x ``vec`` bf16; none at vec 1) and the warp
    partials: forward (max, d, a) x 2 row parities x warp groups x the tile's columns, backward
    (max, den, T) x groups x columns plus the combined row where one warp combines."""
    vec, cols, groups = sched.vec, sched.col_threads * sched.vec, warp_groups(sched)
    rows = 2 * sched.chunk + (0 if direction == "fwd" else 1)
    total = _aligned(2 * rows * sched.threads * vec * 2) if vec >= 2 else 0
    if direction == "fwd":
        return total + 3 * _aligned(2 * groups * cols * 4)
    total += 3 * _aligned(groups * cols * 4)
    if combines_once_per_cta(sched):
        total += _aligned(3 * cols * 4)
    return total


def bwd_rows_per_thread(n_rows: int, sched: Schedule, resident: "int | None" = None, slab: int = 0) -> int:
    """Rows each backward thread walks (window family): the fewest that bring the row groups
    down to BWD_TARGET_CTAS, at most BWD_MAX_ROWS_PER_THREAD unless the row groups' grad_ape
    slabs (``slab`` bytes each: ``slab_bytes``) would then pass BWD_SLAB_BYTES.
    Stream family: rows each CTA walks, one at a time, over ``stream_bwd_row_ctas`` CTAs per
    column tile (``resident``: the compiled kernel's residency)."""
    if sched.family == "stream":
        return max(1, -(-n_rows // stream_bwd_row_ctas(n_rows, sched, resident)))
    if slab <= 0:
        raise ValueError(f"slab: the window backward's grad_ape slab bytes (slab_bytes) are needed, got {slab}")
    most_groups = max(BWD_TARGET_CTAS, BWD_SLAB_BYTES // slab)
    rpt = min(-(-n_rows // (sched.row_lanes * BWD_TARGET_CTAS)), BWD_MAX_ROWS_PER_THREAD)
    return max(1, rpt, -(-n_rows // (sched.row_lanes * most_groups)))


def stream_bwd_row_ctas(n_rows: int, sched: Schedule, resident: "int | None" = None) -> int:
    """Row CTAs of a stream backward launch of ``n_rows`` rows: ``stream_row_ctas``, or for a
    long launch its STREAM_BWD_LONG_GRID_SMS grid (fewer SMs) where that keeps the same CTAs per
    SM. From the row count and the compiled kernel alone, so grad_ape's order is still the
    shape's."""
    long_sms = STREAM_BWD_LONG_GRID_SMS
    # only ever fewer CTAs (tests shrink STREAM_GRID_SMS below it): stream_row_ctas bounds the
    # row groups a launch may have (``atomic_may_fall_back``)
    if not 0 < long_sms < STREAM_GRID_SMS or STREAM_BWD_GRID_SMS or not STREAM_RESIDENT["bwd"]:
        return stream_row_ctas(sched, "bwd", resident)
    per_sm = _stream_ctas_per_sm(sched, "bwd", STREAM_BWD_TARGET_THREADS, resident)
    full = _row_ctas_on(STREAM_GRID_SMS, per_sm, sched)
    if n_rows < STREAM_BWD_LONG_GRID_MIN_ROWS * full:
        return full
    narrow = _row_ctas_on(long_sms, per_sm, sched)
    return narrow if narrow * STREAM_GRID_SMS == full * long_sms else full


def slab_bytes(ratio: int, coff: int, head_dim: int) -> int:
    """Bytes of one backward grad_ape partial slab (fp32, the shape of ape)."""
    return ratio * coff * head_dim * 4


#: Stream forward threads we aim for across the grid; each CTA walks rows one at a time. 65536
#: threads is 512 per SM on 128 SMs (256 CTAs of 256 threads, or 128 of 512), rounded to whole
#: CTAs per SM and capped at the resident ones (``stream_row_ctas``). The row CTAs are fixed
#: first (``ctas // col_tiles``), so the grid never spills a few CTAs into a second wave
#: (1x131072 r128 c2 d512 launched 272 CTAs at a target of 264).
STREAM_FWD_TARGET_THREADS = int(os.environ.get("CSA_FRONTEND_STREAM_FWD_THREADS", "65536"))


#: Forward launches of at most this many output elements (rows x head_dim) run the serial forward
#: (``serial_fwd``), which pools in the reference's order: ``out`` bit-identical. The contract
#: lets max(1, 0.1%) of ``out`` differ; the other forwards' fast pooling rounds 0.35-3.1e-4 of the
#: elements differently (H200, 2M-element packs, session 19: the register-window forward's
#: checked pooling 0.35e-4 at r16 c1 d63; the stream family 1.0e-4 at r16 c1 d64 up to 3.1e-4 at
#: r256 c2, mostly from re-associated sums: 0.64-2.8e-4 with exact exp), so launches of one to a
#: few thousand elements exceeded their allowance of 1-4 several percent of the time (fuzz seeds:
#: 2 of 1890 at r190 c2 d63, 4 of 3052 at r39 c1 d218). Above 4096 the register window's rate
#: makes that chance negligible (at most about 1e-6); for the stream family see
#: STREAM_SERIAL_FWD_MAX_OUTPUTS. The serial forward is latency-bound, about twice the fast
#: forwards' time on such launches. 0 turns it off. Tuning knob, CSA_FRONTEND_SERIAL_FWD_OUTPUTS.
SERIAL_FWD_MAX_OUTPUTS = int(os.environ.get("CSA_FRONTEND_SERIAL_FWD_OUTPUTS", "4096"))
#: The same limit for configurations whose own forward is the stream family, whose fast pooling
#: rounds up to 3.1e-4 of ``out`` differently (9x the register window's checked pooling). With
#: the differing elements roughly Poisson at that rate, a launch of n outputs exceeds its
#: allowance of max(1, n // 1000) with a probability that peaks right above each multiple of
#: 1000 (``benchmark/csa/contract_risk.py``): up to 2.1% for n in 4097-8191 (at 4999), 0.24% in
#: 8192-16383 (at 8999), under 4e-5 from 16384 (fuzz seed 3582, r128 c1 d211 at 6330 outputs,
#: met it: 7 against 6). So stream launches below 8192 outputs take the serial forward too, at
#: twice the time (H200, us, stream / serial: 1x6144 r128 c2 d128 4.6 / 9.7, 1x8192 r128 c2 d128
#: 5.1 / 10.2, 1x16384 r128 c2 d128 7.1 / 17.7: the SPEC's 8192-output row stays on the stream
#: forward). Tuning knob, CSA_FRONTEND_STREAM_SERIAL_FWD_OUTPUTS; the serial forward is off for
#: every family at SERIAL_FWD_MAX_OUTPUTS = 0.
STREAM_SERIAL_FWD_MAX_OUTPUTS = int(os.environ.get("CSA_FRONTEND_STREAM_SERIAL_FWD_OUTPUTS", "8191"))
#: Serial forward CTA: ``SERIAL_FWD_COLS`` columns (a column's in-order sums run in one thread)
#: times position lanes for the parallel steps (each lane holds ``ceil(window / lanes)``
#: positions' loads in flight at once). Its launches are small (chosen when the limit was 4096
#: outputs: at most 128 CTAs of 32 columns, under one per SM), so narrower CTAs spread a launch
#: over more SMs with fewer positions per lane. H200, same run, twice, fwd us at 32 x 16 /
#: 16 x 32: 1x4096 r128 c2 d128 8.5-8.6 / 7.5-7.6, 1x2048 r128 c2 d128 6.6 / 5.6-5.7, 1x1024
#: r256 c2 d512 12.9 / 10.2-10.3, 1x4096 r256 c1 d256 9.0 / 7.7-7.8, 1x256 r16 c2 d64 2.1 / 2.2.
SERIAL_FWD_COLS = 16
SERIAL_FWD_LANES = 32
#: The serial forward's lean variant (``serial_fwd``: shuffle max merge, Markstein weights,
#: constant-offset loads, kv loaded early; per warp about a third fewer SASS instructions outside
#: the in-order sums at r128 c2 d128, 31 registers against 32). H200, session 32, same run, fwd
#: us with every launch up to 20000 outputs serial, classic / lean: 1x2048 r128 c2 d128 5.32 /
#: 4.82, 1x4096 7.46 / 6.55, 1x8192 10.21 / 9.14, 1x16384 17.56 / 14.87, 1x4096 r256 c1 d256
#: 7.52 / 6.43, 1x1024 r256 c2 d512 10.07 / 9.34 (NOTES row 131). A/B knob,
#: CSA_FRONTEND_SERIAL_FWD_LEAN=0 for the classic variant.
SERIAL_FWD_LEAN = os.environ.get("CSA_FRONTEND_SERIAL_FWD_LEAN", "1") == "1"


def serial_forward_schedule(ratio: int, coff: int, head_dim: int) -> "Schedule | None":
    """The serial forward's schedule (any ratio, coff and head_dim), or None when it is off."""
    if SERIAL_FWD_MAX_OUTPUTS <= 0:
        return None
    return Schedule("serial", 1, SERIAL_FWD_COLS, SERIAL_FWD_LANES, -(-head_dim // SERIAL_FWD_COLS))


def serial_forward_outputs(family: str) -> int:
    """The most output elements a forward launch may have to run the serial forward, for a
    configuration whose own forward is of ``family`` ("window" or "stream"); 0 when it is off."""
    if SERIAL_FWD_MAX_OUTPUTS <= 0:
        return 0
    if family == "stream":
        return max(SERIAL_FWD_MAX_OUTPUTS, STREAM_SERIAL_FWD_MAX_OUTPUTS)
    return SERIAL_FWD_MAX_OUTPUTS


def takes_serial_forward(n_rows: int, head_dim: int, serial: "Schedule | None", family: str) -> bool:
    """Whether a forward launch of ``n_rows`` rows runs the serial forward ``serial``
    (``serial_forward_schedule``; None where it is off) rather than its configuration's own
    forward of ``family``."""
    return serial is not None and n_rows * head_dim <= serial_forward_outputs(family)


def fwd_rows_per_cta(n_rows: int, sched: Schedule, resident: "int | None" = None,
                     device_sms: "int | None" = None) -> int:
    """Stream forward: rows one CTA walks (the window family takes one row per thread) over
    ``stream_row_ctas`` CTAs per column tile, in a wave on ``device_sms`` SMs (the launching
    device's; STREAM_FWD_GRID_SMS overrides it, None: STREAM_GRID_SMS)."""
    sms = STREAM_FWD_GRID_SMS or device_sms
    return max(1, -(-n_rows // stream_row_ctas(sched, "fwd", resident, sms)))


#: Stream forward: each CTA walks rows the grid's row CTAs apart instead of one contiguous run,
#: as the stream backward (``STREAM_BWD_INTERLEAVE``), so the grid reads one region of the pack
#: at a time. Compiled into the coff-1 kernels ("auto"; "1": every stream forward, "0": none) and
#: taken by launches whose CTAs walk at least ``STREAM_FWD_INTERLEAVE_MIN_ROWS`` rows over
#: segments of at least ``STREAM_FWD_INTERLEAVE_SEGMENT_STEPS`` such steps on average. Session
#: 37 measured the walk on every launch (H200, two alternating rounds, fwd us contiguous ->
#: interleaved): 1x131072 r128 c1 d128 19.29, 19.36 -> 19.02, 19.11; 1x65536 r64 c1 d512 36.45,
#: 36.00 -> 35.98, 35.77; but coff 2 lost (1x131072 r128 c2 d512 128.2, 128.4 -> 129.2, 129.7)
#: and so did short segments (100x1311 r128 c1 d128 20.46, 20.36 -> 21.38, 21.35), which the
#: rule leaves contiguous. Tuning knob, CSA_FRONTEND_STREAM_FWD_INTERLEAVE=auto|0|1.
STREAM_FWD_INTERLEAVE = os.environ.get("CSA_FRONTEND_STREAM_FWD_INTERLEAVE", "auto")
STREAM_FWD_INTERLEAVE_MIN_ROWS = 8
STREAM_FWD_INTERLEAVE_SEGMENT_STEPS = 4


def _compiles_stream_walk(knob: str, coff: int, auto_coffs: tuple = (1,)) -> bool:
    """A stream interleave knob's compile-time side: "auto" compiles the walk into the coffs of
    ``auto_coffs``, "1" into every coff, "0" into none."""
    return knob == "1" if knob in ("0", "1") else coff in auto_coffs


def _takes_stream_walk(knob: str, n_rows: int, n_segments: int, rows_per_cta: int, min_rows: int,
                       segment_steps: int) -> bool:
    """A stream interleave knob's per-launch side, asked only where the launched kernel has the
    walk compiled in: "1" always; "auto" for CTAs of at least ``min_rows`` rows over segments of
    at least ``segment_steps`` steps of the grid's row CTAs on average (each step into a new
    segment is a lookup on the row's path)."""
    if knob in ("0", "1"):  # per call on the host: the common answers first, no nested calls
        return knob == "1"
    if rows_per_cta < min_rows:
        return False
    return n_rows >= segment_steps * max(1, n_segments) * -(-n_rows // rows_per_cta)


def stream_fwd_may_interleave(coff: int) -> bool:
    """Whether the stream forward of ``coff`` is compiled with the interleaved walk
    (``STREAM_FWD_INTERLEAVE``); a launch takes it where ``fwd_interleaved`` says so."""
    return _compiles_stream_walk(STREAM_FWD_INTERLEAVE, coff)


def fwd_interleaved(n_rows: int, n_segments: int, coff: int, rows_per_cta: int) -> bool:
    """Whether a stream forward launch of ``rows_per_cta`` rows per CTA (``fwd_rows_per_cta``)
    walks its CTAs' rows interleaved (``STREAM_FWD_INTERLEAVE``). The forward's outputs do not
    depend on its walk: each row is pooled whole by one CTA."""
    return stream_fwd_may_interleave(coff) and _takes_stream_walk(
        STREAM_FWD_INTERLEAVE, n_rows, n_segments, rows_per_cta, STREAM_FWD_INTERLEAVE_MIN_ROWS,
        STREAM_FWD_INTERLEAVE_SEGMENT_STEPS)


#: Register-window backward: a CTA walks its rows interleaved with the other CTAs' (a thread's
#: rows ``row_groups * row_lanes`` apart, so the whole grid streams through one region of the
#: pack at a time) instead of as one contiguous run (``row_groups`` regions read and written at
#: once). Taken at ratio >= ``WINDOW_BWD_INTERLEAVE_MIN_RATIO`` (4 at coff 2, 2 at coff 1; coff
#: 1 also needs at most ``WINDOW_BWD_INTERLEAVE_C1_MAX_GROUPS`` row groups) and head_dim >=
#: ``WINDOW_BWD_INTERLEAVE_MIN_HEAD_DIM``, threads walking at least
#: ``WINDOW_BWD_INTERLEAVE_MIN_ROWS`` rows, and a mean segment of at least
#: ``WINDOW_BWD_INTERLEAVE_SEGMENT_STEPS`` such steps (the row cursor searches whenever a step
#: leaves its segment). Measured on the H200 (session 12, same-run rounds, contiguous ->
#: interleaved, us): r4 c2 d512 1x65536 156.9-158.1 -> 153.4-154.7, 1x32768 84.5-84.8 ->
#: 83.5-84.1, 1x16384 47.5-47.7 -> 46.6-46.9, 3x8192 65.5-66.8 -> 64.6-66.1. No gain, so left
#: contiguous: r1 c2 d512 1x65536 175.6-175.9 -> 174.8-176.8, r4 c1 d1024 1x65536 181.5-181.8 ->
#: 181.8-182.7, 3x8192 r4 c1 d512 36.0-36.4 -> 35.4-36.4. Slower: many short segments (512x256
#: r4 c2 d512 298 -> 321, a search per row; 64x1000 r4 c2 d128 46.6-47.1 -> 50.3-50.5) and
#: 3x8192 r4 c2 d128 (19.6 -> 20.2-20.5).
#: coff 1 (session 38, after many kernel changes; two alternating rounds, contiguous ->
#: interleaved, us) gains at ratio >= 2 and head_dim >= 512 on grids of the ``BWD_TARGET_CTAS``
#: row groups: 3x8192 r4 c1 d512 33.72, 33.48 -> 32.82, 33.13; 1x16384 r4 c1 d512 24.27, 24.09 ->
#: 23.73, 23.63; 2x12288 r4 c1 d512 33.99, 33.89 -> 33.3, 33.4; 1x32768 r8 c1 d512 44.83, 44.72 ->
#: 44.81, 44.62; and past the rows-per-thread cap
#: (``BWD_MAX_ROWS_PER_THREAD``), where the grid grows: 384 row groups 3x8192 r2 c1 d512 35.26,
#: 35.25 -> 34.64, 34.36 and 3x8192 r4 c1 d1024 64.45, 64.23 -> 63.21, 63.24. It loses at 512 and
#: 1024 groups of d512: 1x65536 r4 c1 d512 84.2, 84.28 -> 85.38, 84.94; 1x65536 r2 c1 d512 85.39,
#: 85.08 -> 87.22, 86.91 (1x65536 r4 c1 d1024, 1024 groups: 172.7, 172.5 -> 172.2, 171.6), so
#: coff 1 interleaves up to ``WINDOW_BWD_INTERLEAVE_C1_MAX_GROUPS``. coff 2 keeps interleaving
#: past the target (same session, contiguous -> interleaved: 1x65536 r4 c2 d512, 512 groups,
#: 151.82, 151.57 -> 150.36, 150.51; 1x131072, 1024 groups, 294.38, 293.58 -> 290.73, 290.65).
#: Tuning knob (A/B): "0" never, "1" wherever the window family runs, default "auto":
#: CSA_FRONTEND_WINDOW_BWD_INTERLEAVE.
WINDOW_BWD_INTERLEAVE = os.environ.get("CSA_FRONTEND_WINDOW_BWD_INTERLEAVE", "auto")
#: smallest ratio interleaved, per coff
WINDOW_BWD_INTERLEAVE_MIN_RATIO = {1: 2, 2: 4}
WINDOW_BWD_INTERLEAVE_C1_MAX_GROUPS = 384
WINDOW_BWD_INTERLEAVE_MIN_HEAD_DIM = 512
WINDOW_BWD_INTERLEAVE_MIN_ROWS = 8
WINDOW_BWD_INTERLEAVE_SEGMENT_STEPS = 4


#: Stream backward: each CTA walks rows ``row_groups`` apart instead of one contiguous run, so the
#: whole grid works through one region of the pack at a time (the register window's interleaved
#: walk, ``WINDOW_BWD_INTERLEAVE``). Compiled into the coff-1 kernels and the coff-2 ones but
#: ``STREAM_BWD_WALK_SPILLS`` ("auto"; "1": every stream backward, "0": none) and taken by launches
#: whose CTAs walk at least ``STREAM_BWD_INTERLEAVE_MIN_ROWS`` rows over segments of at least
#: ``STREAM_BWD_INTERLEAVE_SEGMENT_STEPS`` steps on average (each step into a new segment is a
#: lookup on the row's path). Measured on the H200 (session 37, two alternating rounds, bwd us
#: contiguous -> interleaved): 1x131072 r128 c1 d128 44.87, 45.04, 45.32, 44.81 -> 41.83, 41.75,
#: 42.23, 41.97; 1x65536 r64 c1 d512 77.06, 76.45, 76.84, 77.04 -> 75.05, 75.11, 76.40, 75.41;
#: 1x65536 r16 c1 d256 42.89, 42.80 -> 41.94, 41.58; 1x262144 r256 c1 d64 45.69, 45.68 -> 44.63,
#: 44.47; 8x16384 r200 c1 d192 76.2, 76.6 -> 76.3, 76.0; CTAs of 2-4 rows gain nothing (1x8192 r128
#: c1 d128 7.81, 7.73 -> 7.86, 7.85; 1x16384 r64 c1 d512 24.0, 23.7 -> 23.9, 23.9); packs of short
#: segments lose (64x2000 r32 c1 d128 41.8, 41.5 -> 45.7, 45.8; 512x300 r64 c1 d128 51.6, 51.4 ->
#: 66.4, 66.8) though 100x1311 r128 c1 d128 gained (46.2, 46.1 -> 44.0, 44.4); coff 2 gains nothing
#: (1x65536 r128 c2 d512 155.6, 155.7 -> 155.3, 154.7; 4x8192 r16 c2 d256 41.2, 41.1 -> 41.0, 40.8;
#: 48x2048 r32 c2 d256 115.1, 114.4 -> 118.1, 117.6). The stream forward walked the same way was
#: mixed (r128 c1 d128 19.3 -> 19.1, r128 c2 d512 66.3 -> 66.7, 100x1311 r128 c1 d128 20.4 -> 21.4)
#: and is not. With the rule (third call, contiguous -> auto): 1x131072 r128 c1 d128 44.84 -> 42.10,
#: 1x65536 r64 c1 d512 76.96 -> 75.37; 512x300, 64x2000 and 100x1311 (contiguous by the rule) 50.68,
#: 41.40, 46.13 -> 50.87, 41.68, 46.26. Tuning knob, CSA_FRONTEND_STREAM_BWD_INTERLEAVE=auto|0|1
#: ("1" also interleaves every launch that can). Since session 57 (H100 with clusters, NOTES rows
#: 172-173; bwd us, walk in coff 1 only -> in coff 2 too, 128 SMs) "auto" compiles the walk into
#: coff 2 as well: 1x65536 r128 c2 d512 213.2-218.3 -> 208.2-210.1, 1x131072 r128 c2 d512
#: 408.5-408.8 -> 401.0-402.2, 1x65536 r256 c2 d512 236.4-240.7 -> 217.3-218.6, 1x131072 r256 c2
#: d256 275.2-275.8 -> 247.2, 1x65536 r128 c2 d256 114.4-114.5 -> 110.1-110.5, 2x16384 r100 c2 d128
#: 33.3-33.5 -> 32.3-32.5; with the long grid (STREAM_BWD_LONG_GRID_SMS) the walk gains more (r128
#: c2 d512 200.4-200.7 -> 193.9-194.6). On the H200 (session 60, NOTES row 176, 128 SMs, two
#: rounds): 1x65536 r128 c2 d512 155.5-156.1 -> 154.4-154.6, 1x131072 r128 c2 d512 300.3-300.6 ->
#: 300.3-300.7, 1x65536 r128 c2 d256 83.9-88.0 -> 80.9-81.6, but 1x65536 r256 c2 d512 192.3-193.1
#: -> 197.7-198.6; session 64 (NOTES row 179, same card) again: r256 c2 d512 192.1-193.3 ->
#: 197.8-198.6, 1x131072 r256 c2 d256 194.2-194.6 -> 194.1-195.0, 1x65536 r100 c2 d128 53.1 ->
#: 52.0-52.1, 48x2048 r32 c2 d256 (not taken) 114.3 -> 114.2-114.7. The walk sets grad_ape's
#: summation order, so one rule serves both cards: the H100's 8% gain on r256 outweighs this 3%
#: loss.
#: Except into the one coff-2 kernel class that spills with it (``STREAM_BWD_WALK_SPILLS``: ratio 16
#: at vec 4 in CTAs of 256 threads, two per SM at the 128-register cap): r16 c2 d128, d256 and d1024
#: spill 48 bytes with it (ptxas, sass_budget.py), r16 c2 d512 needs 134 registers, and 1x32768 r16
#: c2 d256 went 54.8-55.4 -> 59.0 (62.4-64.1 with the long grid), even where a launch did not take
#: the walk. Every other coff-2 class compiles it at -3 to +3 registers without spills (ptxas,
#: sessions 58-59: 160-320 threads r9 c2 d1024, r12/r17/r24 c2 d256, r20/r28/r36/r37/r44 c2 d512;
#: 256 threads r13-r16 c2 d130 and r16 c2 d66 at vec 2, r15 c2 d128-d1024, r25/r28/r29/r32 c2 d129,
#: r29/r32 c2 d130, r29 c2 d64-d1024, r30 c2 d128 and d512, r31/r32 c2 d64, r57/r64/r113 c2 d257,
#: r57 c2 d258, r128 c2 d15, r256 c2 d7) and gains where measured (H100, bwd us, two alternating
#: rounds, not compiled in -> forced in). Session 58: 1x65536 r17 c2 d256 (160 threads) 106.1, 105.2
#: -> 102.5, 102.9; r24 c2 d256 (192) 102.7, 102.9 -> 101.3, 101.2; r37 c2 d512 (320) 226.1, 226.3
#: -> 221.4, 220.1; r20 c2 d512 (160) 222.1, 222.5 -> 222.1, 222.5. Session 59, 256 threads: 1x65536
#: r15 c2 d256 109.5, 109.3 -> 106.9, 107.3; 1x32768 r15 c2 d256 55.5, 55.7 -> 54.3, 54.2; 1x65536
#: r29 c2 d512 218.3, 219.3 -> 212.8, 212.1; r30 c2 d128 57.6, 57.5 -> 56.9, 56.7; r32 c2 d64 31.0,
#: 31.0 -> 29.9, 29.9.
STREAM_BWD_INTERLEAVE = os.environ.get("CSA_FRONTEND_STREAM_BWD_INTERLEAVE", "auto")
#: the coffs "auto" compiles the walk into (coff 2 but in STREAM_BWD_WALK_SPILLS);
#: tuning knob, CSA_FRONTEND_STREAM_BWD_WALK_COFFS=1 builds the kernels of before session 57
STREAM_BWD_WALK_COFFS = tuple(int(c) for c in os.environ.get("CSA_FRONTEND_STREAM_BWD_WALK_COFFS", "1,2").split(","))
STREAM_BWD_INTERLEAVE_MIN_ROWS = 8
STREAM_BWD_INTERLEAVE_SEGMENT_STEPS = 4
#: the kernel classes, (ratio, vec, threads), that "auto" leaves the coff-2 walk out of
STREAM_BWD_WALK_SPILLS = frozenset({(16, 4, 256)})


def stream_bwd_may_interleave(ratio: int, coff: int, sched: Schedule) -> bool:
    """Whether the stream backward of ``ratio``, ``coff`` on schedule ``sched`` is compiled with
    the interleaved walk (``STREAM_BWD_INTERLEAVE``); a launch takes it where
    ``bwd_interleaved`` says so."""
    if (STREAM_BWD_INTERLEAVE == "auto" and coff == 2
            and (ratio, sched.vec, sched.threads) in STREAM_BWD_WALK_SPILLS):
        return False
    return _compiles_stream_walk(STREAM_BWD_INTERLEAVE, coff, STREAM_BWD_WALK_COFFS)


def bwd_interleaved(n_rows: int, n_segments: int, ratio: int, coff: int, head_dim: int, sched: Schedule,
                    rows_per_thread: int) -> bool:
    """Whether a backward launch walks its CTAs' rows interleaved (see
    ``WINDOW_BWD_INTERLEAVE``); from shapes alone, so grad_ape's summation order (each CTA's
    slab sums the rows it walked) depends on nothing else. Stream family: see
    ``STREAM_BWD_INTERLEAVE``."""
    if sched.family == "stream":  # rows_per_thread: rows per CTA, so the steps are its row groups
        return stream_bwd_may_interleave(ratio, coff, sched) and _takes_stream_walk(
            STREAM_BWD_INTERLEAVE, n_rows, n_segments, rows_per_thread, STREAM_BWD_INTERLEAVE_MIN_ROWS,
            STREAM_BWD_INTERLEAVE_SEGMENT_STEPS)
    if WINDOW_BWD_INTERLEAVE == "0":
        return False
    if WINDOW_BWD_INTERLEAVE == "1":
        return True
    if (ratio < WINDOW_BWD_INTERLEAVE_MIN_RATIO[coff] or head_dim < WINDOW_BWD_INTERLEAVE_MIN_HEAD_DIM
            or rows_per_thread < WINDOW_BWD_INTERLEAVE_MIN_ROWS):
        return False
    groups = bwd_row_groups(n_rows, sched, rows_per_thread)
    if coff == 1 and groups > WINDOW_BWD_INTERLEAVE_C1_MAX_GROUPS:
        return False
    return n_rows >= WINDOW_BWD_INTERLEAVE_SEGMENT_STEPS * max(1, n_segments) * groups * sched.row_lanes


def bwd_row_groups(n_rows: int, sched: Schedule, rows_per_thread: int) -> int:
    """Number of grad_ape partial slabs (one per CTA row group)."""
    rows_per_cta = rows_per_thread if sched.family == "stream" else sched.row_lanes * rows_per_thread
    return -(-n_rows // rows_per_cta)


#: The opt-in atomic grad_ape path (``deterministic=False``) of the stream backward adds every
#: row group's partial into grad_ape directly, so each element takes one atomic add per row
#: group, all near the end of a one-wave grid. Where more groups than this meet, a launch runs the
#: deterministic kernels instead (slab stores and a reduction kernel), which are faster there.
#: H200, session 31, bwd us atomic / deterministic (row groups): 1x131072 r128 c1 d128 43.8 /
#: 44.5 (64), 1x8192 r128 c2 d128 11.2 / 11.2 (32), 1x65536 r64 c1 d512 76.8 / 78.0 (32),
#: 1x65536 r128 c2 d512 155.6 / 157.8 (8), 4x8192 r16 c2 d256 51.0 / 41.7 (128). Above 64 the
#: count alone does not predict it (session 32, pure atomics against the default: 1x65536 r29 c2
#: d192 64.4 / 66.6 (84), r17 c2 d256 83.3 / 84.7 (95), r20 c2 d128 43.6 / 44.2 (182), but r16
#: 51.2 / 41.7 (128) and 1x65536 r32 c1 d64 17.3 / 13.2 (512)), so the limit stays where atomics
#: never lost: the opt-in path is never slower than the default, and gives up at most ~3% where
#: atomics would have won. The register-window backward keeps atomics at any count: with 256-512
#: row groups it was as fast or faster (NOTES row 64: 3x8192 r4 c2 d512 63.5 / 66.0, 64x1000 r4
#: c2 d128 42.0 / 47.3, 1x8192 r4 c2 d128 10.8 / 10.7).
#: Tuning knob, CSA_FRONTEND_STREAM_ATOMIC_GROUPS (0: the stream family never adds atomically).
STREAM_ATOMIC_MAX_GROUPS = int(os.environ.get("CSA_FRONTEND_STREAM_ATOMIC_GROUPS", "64"))


def atomic_ape_pays(sched: Schedule, groups: int) -> bool:
    """Whether a ``deterministic=False`` backward launch of ``groups`` row groups
    (``bwd_row_groups``) under ``sched`` adds grad_ape atomically, rather than running the
    deterministic kernels (``STREAM_ATOMIC_MAX_GROUPS``)."""
    return sched.family != "stream" or groups <= STREAM_ATOMIC_MAX_GROUPS


def zero_fill_ctas(n_segments: int, sched: Schedule) -> int:
    """CTAs appended to the backward grid to zero never-consumed gradient slots.

    One row lane per segment (segments shorter than ``ratio`` have no output row that could
    zero them), and at least one CTA for tokens past ``cu_seqlens[-1]``.
    """
    return max(1, -(-n_segments // sched.row_lanes))


#: Pipelined kernels (stream forward and backward, register-window backward): each thread waits
#: until its first row has landed before it requests the next, instead of requesting both at
#: once (with more window-backward stages, until every row of its prologue has). At the start
#: every CTA of the grid waits for its first row with nothing to overlap; requested together
#: with the second, the first shares the DRAM with it. H200, NOTES row 99,
#: two alternating rounds of the SPEC table, bwd us default -> first row alone: 3x8192 r4 c1
#: d512 35.1-35.2 -> 34.3-34.6, 1x131072 r128 c1 d128 47.3-47.4 -> 46.8-46.9, 512x256 r4 c2
#: d512 297.0-298.2 -> 296.0-296.1, 1x65536 r64 c1 d512 78.2-78.3 -> 77.8-77.9; every other
#: row and direction within 0.3 us either way. Tuning knob (A/B), CSA_FRONTEND_FIRST_ROW_ALONE=0.
FIRST_ROW_ALONE = os.environ.get("CSA_FRONTEND_FIRST_ROW_ALONE", "1") == "1"
#: Stream forward: each CTA requests its first row at the tokens it has when every segment is a
#: whole number of blocks (``row * ratio``) before its row lookup answers, and requests it again
#: where the lookup disagrees (padding rows, rows after a tail). Guessed only in launches of
#: exactly ``tokens / ratio`` rows: ``sum_s floor(L_s / ratio) = T / ratio`` holds only if no
#: segment has a tail, so there every real row's guess is right; other packs (where a wrong guess
#: costs the CTA one more round trip) request after the lookup as before. The lookup is a
#: dependent round trip before any of a CTA's bytes are requested. Same results. Measured on the
#: H200 (NOTES row 134, two alternating rounds, fwd us off -> on): 4x8192 r16 c2 d256 20.54,
#: 20.58 -> 20.12, 20.01; 16x2048 r16 c2 d256 20.43, 20.62 -> 20.18, 20.05; 1x8192 r128 c2 d128
#: 5.08, 5.09 -> 4.82, 4.77; 1x65536 r128 c2 d512 67.25, 67.77 -> 66.36, 66.88; 48x2048 r32 c2
#: d256 53.58, 53.75 -> 52.81, 53.09; 1x131072 r128 c1 d128 19.59, 19.78 -> 19.76, 19.70 (an
#: earlier call: 19.58, 19.46 -> 19.38, 19.19); the ragged 100x1311 r128 c1 d128 (no guess)
#: 20.43, 20.50 -> 20.72, 20.57. Guessing ragged packs too had cost that one 20.1 -> 20.4-20.7,
#: and the register-window forward guessing every thread's row was slower (64x1000 r4 c2 d128
#: 19.7 -> 22.9-25.1 us: 48 -> 56 registers). Tuning knob (A/B), CSA_FRONTEND_STREAM_FWD_GUESS=0.
STREAM_FWD_GUESS = os.environ.get("CSA_FRONTEND_STREAM_FWD_GUESS", "1") == "1"
#: Stream backward: the same guess for each CTA's first row (``STREAM_FWD_GUESS``; its grad_out
#: slice needs no lookup either way). Same bits. Measured on the H200 (NOTES row 135, two
#: alternating rounds in one call, bwd us off -> on): 4x8192 r16 c2 d256 41.54, 41.53 -> 41.35,
#: 41.29; 1x8192 r128 c2 d128 10.75, 10.72 -> 10.61, 10.62; 1x65536 r128 c2 d512 159.37, 159.97
#: -> 158.93, 158.75; 1x131072 r128 c1 d128 45.63, 45.68 -> 45.60, 45.43; 1x65536 r64 c1 d512
#: 77.08, 77.00 -> 77.21, 76.66; the ragged 100x1311 r128 c1 d128 (no guess) 45.93, 46.16 ->
#: 46.30, 46.09. Tuning knob (A/B), CSA_FRONTEND_STREAM_BWD_GUESS=0.
STREAM_BWD_GUESS = os.environ.get("CSA_FRONTEND_STREAM_BWD_GUESS", "1") == "1"
#: Row lookups (``common.row_start``, ``row_span``): the segment search starts without waiting
#: for ``cu_seqlens_comp[n_seg]`` (the padding test), which is loaded alongside the first probe
#: and applied afterwards. Every kernel's first row of a launch is a chain of dependent loads
#: (padding test, ceil(log32 B) probe rounds, the segment's offsets) before its data can be
#: requested; this takes one round trip out of it. Same results. Measured on the H200 (NOTES
#: row 110, two alternating rounds, us old -> new): 1x8192 r4 c2 d128 bwd 10.4 -> 10.0, 3x8192
#: r4 c2 d512 bwd 61.6-61.7 -> 61.1-61.2, 64x1000 fwd 20.3-20.4 -> 20.1-20.2, 1x8192 r128 c2
#: d128 fwd 5.3 -> 5.1; slower: 3x8192 r4 c1 d512 fwd 16.4 -> 16.8. Tuning knob (A/B),
#: CSA_FRONTEND_LOOKUP_OVERLAPPED=0.
LOOKUP_OVERLAPPED = os.environ.get("CSA_FRONTEND_LOOKUP_OVERLAPPED", "1") == "1"
#: Row lookups where a whole warp shares its row, in packs of few segments: one round of loads,
#: each lane both offsets of 1, 2 or 4 indices (the fewest that cover the pack), ballots and
#: shuffles (``common.tiered_offsets``), instead of probe rounds and then the segment's offsets.
#: The value is the widest round in loads per lane (a power of two; 0: always the search), so
#: packs of fewer than 32 x that many segments skip the search. Per kernel: ``fwd``/``bwd`` the
#: window family (with ``warp_rows``), ``stream_fwd``/``stream_bwd`` the stream family (a CTA
#: shares its row). Measured on the H200, two alternating rounds each:
#: - NOTES row 113 (us, search -> one load): forward 3x8192 r4 c1 d512 16.9, 16.8 -> 16.3, 16.2;
#:   3x8192 r4 c2 d512 29.1, 29.3 -> 28.8, 28.6; 3x8192 r4 c2 d128 9.0, 8.9 -> 8.8, 8.8. The
#:   backward, which looks up only where its walk leaves a segment, slower: 1x8192 r4 c2 d128
#:   10.1, 10.0 -> 10.3, 10.2; 3x8192 r4 c2 d512 61.2, 61.0 -> 61.7, 61.3.
#: - NOTES row 114 (forward us, widest 1 -> 4): 64x1000 r4 c2 d128 20.43, 20.39 -> 19.75, 19.80;
#:   100x640 20.62, 20.71 -> 19.85, 19.88; 64x1024 r4 c2 d512 70.89, 71.02 -> 70.29, 70.35; at 2
#:   loads 40x1600 20.25, 20.22 -> 19.57, 19.53 (4 loads: 19.72, 19.78). One width for every
#:   pack cost one segment 1x64000 19.5 -> 20.1 at 4 loads: a lane's loads are paid by every row.
#: - NOTES rows 116-117, the stream kernels (us, search -> 4 loads): forward 100x1311 r128 c1
#:   d128 21.2, 21.2 -> 20.2, 20.3; 48x2048 r32 c2 d256 54.1, 54.0 -> 53.2, 53.0; 4x8192 r16 c2
#:   d256 21.0, 20.6 -> 20.4, 20.4; backward 48x2048 115.8, 115.2 -> 114.6, 114.4; 16x2048 r16
#:   42.1, 42.2 -> 41.6, 41.5; 1x8192 r128 c2 d128 11.15, 11.12 -> 10.80, 10.79. The forward of
#:   one-segment packs lost (1x131072 r128 c1 d128 19.2, 19.2 -> 19.5, 19.4), from the code
#:   alone (2-6 more registers; searching one-segment packs inside it did not recover it), so
#:   those packs run a forward compiled with the search (``dispatch.compile_forward_one_segment``).
#: Tuning knob (A/B), e.g. CSA_FRONTEND_LOOKUP_ONE_ROUND="fwd=1,bwd=1,stream_fwd=1,stream_bwd=1".
LOOKUP_ONE_ROUND = _per_direction({"fwd": 4, "bwd": 0, "stream_fwd": 4, "stream_bwd": 4},
                                  "CSA_FRONTEND_LOOKUP_ONE_ROUND")
#: Register-window backward: odd row lanes sleep about this many nanoseconds after their first
#: row has landed, so half the warps of every CTA walk their rows shifted against the other half
#: (a probe of NOTES row 103's second reading: a one-wave grid's threads run in lockstep and
#: reach the DRAM in read and write bursts). Timing only: the same rows in the same order, the
#: same bits. 0 (the default) emits no code. Diagnostic knob (A/B), CSA_FRONTEND_WINDOW_BWD_STAGGER_NS.
WINDOW_BWD_STAGGER_NS = int(os.environ.get("CSA_FRONTEND_WINDOW_BWD_STAGGER_NS", "0"))
#: Register-window backward: thread 0 of every row CTA prints ``cta_clock bx by smid start end``
#: (global timer, ns, read at the CTA's start and after its slab is written) when it ends, so a
#: launch's CTAs can be sorted by SM, start and duration (``benchmark/csa/cta_clocks.py``; NOTES
#: rows 160-162: which CTAs make the busiest SM). The printf perturbs kernels near the register
#: limit (the 128-register coff-2 backward ran 9x slower with it; coff 1 ran at its usual time).
#: Off (the default) emits no code. Diagnostic knob, CSA_FRONTEND_CTA_CLOCKS=1.
CTA_CLOCKS = os.environ.get("CSA_FRONTEND_CTA_CLOCKS", "0") == "1"
#: Register-window backward, row stealing (NOTES row 186; off by default): a warp that has
#: walked its own rows takes up to this many rows from the back of a slower warp's run (the
#: warp of the same index and column tile in another CTA, the one with the most rows still
#: unrequested), claimed through a per-warp word of front and back counts. A stolen row's
#: grad_ape contributions go to the owner through global memory and are added after its own
#: rows in row order, so grad_ape keeps the bits of the static walk. The words and flags live
#: in a per-device workspace that every launch leaves zeroed: two backward launches must not
#: run at once on one device. Per-CTA clocks (NOTES rows 160-163) showed the slow SMs of a
#: launch drawn afresh each time, so no static split balances them. But as built it loses
#: (H100, session 70, bwd us static / 2 rows: 3x8192 r4 c2 d512 84.1 / 89.1-90.1, r4 c1 d512
#: 43.0 / 49.8-50.7, 64x1000 r4 c2 d128 57.0 / 61.2-61.4, 1x65536 r4 c2 d512 207.4 / 258.1-258.9):
#: a stolen row is walked cold, outside the thief's cp.async pipeline, so it costs the thief
#: about what the spread saves, and its owner waits for it. Experimental knob,
#: CSA_FRONTEND_WINDOW_BWD_STEAL (0: no code).
WINDOW_BWD_STEAL = int(os.environ.get("CSA_FRONTEND_WINDOW_BWD_STEAL", "0"))
#: Scans of the other warps' words a thief makes before it stops looking (a CAS lost to the
#: owner or another thief costs one).
WINDOW_BWD_STEAL_SCANS = 8
#: A thief takes a row only from a run with at least this many rows its owner has not yet
#: claimed (the owner is then that many rows behind; a stolen row is walked cold, unstaged).
WINDOW_BWD_STEAL_MIN_LEFT = int(os.environ.get("CSA_FRONTEND_WINDOW_BWD_STEAL_MIN_LEFT", "1"))
#: Tests only: with row stealing, the warps of CTA 0 start about this many microseconds late (so
#: others take their back rows) and every steal is counted in the workspace's last word. 0: no code.
WINDOW_BWD_STEAL_PROBE_US = int(os.environ.get("CSA_FRONTEND_WINDOW_BWD_STEAL_PROBE_US", "0"))
#: Register-window backward: at every step, thread 0 of each CTA of column tile 0 asks L2 for
#: the whole token rows (kv, score) and the grad_out rows of its CTA's rows this many steps
#: ahead (one ``cp.async.bulk.prefetch.L2`` per tensor), on top of the cp.async pipeline's
#: ``stages - 1``. NOTES row 188 found the kernel bound by its memory pipeline, not by its
#: arithmetic, with about one row per thread in flight and no shared memory left for another
#: stage at two CTAs per SM; the prefetch adds bytes in flight without any. Rows past the
#: computed row's segment are placed as if that segment went on (exact for packs of whole
#: blocks; elsewhere only the hint is off). Experimental knob, CSA_FRONTEND_WINDOW_BWD_L2_AHEAD
#: (0: no code; otherwise at least the pipeline's stages, whose rows are already in flight).
WINDOW_BWD_L2_AHEAD = int(os.environ.get("CSA_FRONTEND_WINDOW_BWD_L2_AHEAD", "0"))

#: Programmatic dependent launch of every kernel (sm_90+): each lets the next grid on the stream
#: launch at once and waits (``griddepcontrol.wait``) for the previous one to finish and flush
#: before its first global access, so launch latency and CTA start-up hide behind the previous
#: grid's tail (the grad_ape slab reduction behind the backward, a call behind the one before).
#: Tuning knob (A/B), CSA_FRONTEND_PDL=0.
PDL = os.environ.get("CSA_FRONTEND_PDL", "1") == "1"
#: grad_ape slab reduction: warps per CTA, and slabs one warp chain sums before the slab axis
#: is split over more warps.
APE_REDUCE_WARPS = 16
APE_SLABS_PER_CHAIN = int(os.environ.get("CSA_FRONTEND_APE_CHAIN", "32"))


def ape_split(n_slab: int) -> int:
    """Warps sharing one 32-element group of grad_ape (1, 2, 4, 8 or 16), from the slab count
    alone so the summation order depends on nothing but the shape."""
    split = 1
    while split < APE_REDUCE_WARPS and n_slab > split * APE_SLABS_PER_CHAIN:
        split *= 2
    return split
