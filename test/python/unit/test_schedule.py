"""The launch planner (pure Python): families, vector widths, CTA shapes and per-call choices
at every bucket boundary. None of it may depend on the GPU's SM count."""
import dataclasses
import inspect
import os

import pytest
import torch

from csa_frontend.compressor.kernels import schedule as sch

pytestmark = pytest.mark.L0


@pytest.mark.parametrize("head_dim,vec", [(128, 8), (4096, 8), (65, 1), (66, 2), (68, 4), (1, 1), (24, 8)])
def test_vector_width_divides_head_dim(head_dim, vec):
    assert sch.vector_width(head_dim) == vec
    assert head_dim % vec == 0


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("ratio", [1, 2, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 64, 127, 128, 200, 255, 256])
@pytest.mark.parametrize("coff", [1, 2])
@pytest.mark.parametrize("head_dim", [1, 2, 8, 64, 65, 66, 128, 192, 512, 4096])
def test_schedule_covers_the_problem(direction, ratio, coff, head_dim):
    s = sch.choose_schedule(ratio, coff, head_dim, direction)
    width = coff * ratio
    assert head_dim % s.vec == 0
    n_vec = head_dim // s.vec
    assert s.col_threads * s.col_tiles >= n_vec > s.col_threads * (s.col_tiles - 1)
    assert 1 <= s.threads <= 1024
    if s.family == "window":
        budget = sch.WINDOW_REGISTER_BUDGET[direction]
        assert width * s.vec <= budget or (s.vec == 2 and sch.window_at_vec2(ratio, coff, head_dim, direction))
        assert width * s.vec <= 32
        assert s.vec >= 2 or sch.vector_width(head_dim) == 1
        assert s.threads <= sch.WINDOW_CTA_THREADS[direction]
    elif s.online:
        # one thread per output row and column slice walks the whole window, chunk by chunk
        assert s.family == "stream" and direction == "fwd" and width <= sch.STREAM_FWD_ONLINE_WINDOW
        assert s.chunk == sch.STREAM_FWD_ONLINE_CHUNK
        assert s.col_threads & (s.col_threads - 1) == 0
        assert s.col_threads < 2 * n_vec  # the smallest power of two covering the columns (at most the CTA)
        assert s.threads == sch.STREAM_FWD_ONLINE_THREADS
    else:
        assert s.family == "stream"
        assert s.chunk == max(1, sch.STREAM_CHUNK_VALUES[direction] // s.vec)
        # whole warps of chunks (reduced by shuffles): the padding is less than one warp's share
        per_warp = max(1, 32 // s.col_threads)
        assert s.col_threads & (s.col_threads - 1) == 0
        assert s.row_lanes % per_warp == 0
        assert s.row_lanes * s.chunk >= width > (s.row_lanes - per_warp) * s.chunk
        assert s.col_threads < 2 * n_vec  # no more than one power of two past the columns
        assert s.threads <= sch.STREAM_CTA_THREADS[direction]


def test_window_to_stream_boundary():
    budget = sch.WINDOW_REGISTER_BUDGET["bwd"]
    # the widest window that fits at 4-byte accesses stays in registers; one more position streams
    ratio = budget // 2 // 2  # coff 2, vec 2
    assert sch.choose_schedule(ratio, 2, 128, "bwd").family == "window"
    assert sch.choose_schedule(ratio + 1, 2, 128, "bwd").family == "stream"


def test_long_windows_at_vec2_follow_the_measurements():
    """NOTES row 89: the forward runs windows of up to 16 positions in registers at vec 2, but
    ratio-8 coff-2 windows stream at head_dim >= 256; the backward keeps the bit-exact register
    window for every ratio up to 8 and beyond it streams windows of more than 12 positions."""
    def family(ratio, coff, head_dim, direction):
        s = sch.choose_schedule(ratio, coff, head_dim, direction)
        return s.family if s.family == "stream" else f"window{s.vec}"

    assert family(4, 2, 512, "fwd") == "window2"  # within the budget: unchanged
    for ratio, coff, head_dim in [(5, 2, 512), (7, 2, 512), (8, 2, 128), (9, 1, 512), (16, 1, 512), (16, 1, 130)]:
        assert family(ratio, coff, head_dim, "fwd") == "window2"
    for ratio, coff, head_dim in [(8, 2, 256), (8, 2, 512), (17, 1, 512), (9, 2, 128), (16, 2, 64)]:
        assert family(ratio, coff, head_dim, "fwd") == "stream"
    for ratio, coff, head_dim in [(8, 2, 512), (7, 2, 128), (8, 1, 512), (12, 1, 512), (10, 1, 128)]:
        assert family(ratio, coff, head_dim, "bwd").startswith("window")
    for ratio, coff, head_dim in [(13, 1, 512), (16, 1, 128), (16, 1, 256), (9, 2, 512)]:
        assert family(ratio, coff, head_dim, "bwd") == "stream"
    # odd head_dim keeps its scalar window wherever the budget admits it
    assert family(16, 1, 65, "fwd") == family(16, 1, 65, "bwd") == "window1"


def test_vec2_knob_zero_leaves_the_budget_alone(monkeypatch):
    monkeypatch.setattr(sch, "WINDOW_FWD_VEC2_POSITIONS", 0)
    sch.choose_schedule.cache_clear()
    try:
        assert sch.choose_schedule(4, 2, 512, "fwd").family == "window"
        assert sch.choose_schedule(5, 2, 512, "fwd").family == "stream"
    finally:
        monkeypatch.undo()
        sch.choose_schedule.cache_clear()


def test_backward_vector_cap_knob(monkeypatch):
    """CSA_FRONTEND_WINDOW_MAX_VEC=bwd=8 lets windows of up to 4 positions take 16-byte accesses
    in the backward; longer windows still narrow to the register budget."""
    assert sch.choose_schedule(4, 1, 512, "bwd").vec == 4
    monkeypatch.setitem(sch.WINDOW_MAX_VEC, "bwd", 8)
    sch.choose_schedule.cache_clear()
    try:
        assert sch.choose_schedule(4, 1, 512, "bwd") == sch.Schedule("window", 8, 64, 4, 1)
        assert sch.choose_schedule(4, 2, 512, "bwd").vec == 4
    finally:
        monkeypatch.undo()
        sch.choose_schedule.cache_clear()


def test_odd_head_dim_keeps_scalar_window():
    assert sch.choose_schedule(4, 2, 65, "bwd") == sch.Schedule("window", 1, 65, 3, 1)


@pytest.mark.parametrize("family_ratio", [4, 128])
def test_rows_per_thread_boundaries(family_ratio):
    s = sch.choose_schedule(family_ratio, 2, 128, "bwd")
    slab = sch.slab_bytes(family_ratio, 2, 128)
    for n_rows in [0, 1, 2, 7, 1000, 4095, 4096, 4097, 10 ** 5, 10 ** 6, 10 ** 7]:
        rpt = sch.bwd_rows_per_thread(n_rows, s, None, slab)
        groups = sch.bwd_row_groups(n_rows, s, rpt)
        per_cta = rpt if s.family == "stream" else rpt * s.row_lanes
        assert rpt >= 1
        assert groups * per_cta >= n_rows > (groups - 1) * per_cta or n_rows == groups == 0
        if s.family == "window":
            most_groups = max(sch.BWD_TARGET_CTAS, sch.BWD_SLAB_BYTES // slab)
            assert groups <= most_groups
            # past the row cap only where one row fewer would pass the slab budget
            assert rpt <= sch.BWD_MAX_ROWS_PER_THREAD or sch.bwd_row_groups(n_rows, s, rpt - 1) > most_groups


def test_window_rows_per_thread_bucket_edges():
    s = sch.choose_schedule(4, 2, 128, "bwd")
    slab = sch.slab_bytes(4, 2, 128)
    edge = s.row_lanes * sch.BWD_TARGET_CTAS
    assert sch.bwd_rows_per_thread(edge, s, None, slab) == 1
    assert sch.bwd_rows_per_thread(edge + 1, s, None, slab) == 2
    assert sch.bwd_row_groups(edge, s, 1) == sch.BWD_TARGET_CTAS
    # the row cap: the grid grows past the CTA target, up to the slab budget
    capped = edge * sch.BWD_MAX_ROWS_PER_THREAD
    assert sch.bwd_rows_per_thread(capped + 1, s, None, slab) == sch.BWD_MAX_ROWS_PER_THREAD
    most_groups = sch.BWD_SLAB_BYTES // slab
    budget_edge = s.row_lanes * most_groups * sch.BWD_MAX_ROWS_PER_THREAD
    assert sch.bwd_rows_per_thread(budget_edge, s, None, slab) == sch.BWD_MAX_ROWS_PER_THREAD
    assert sch.bwd_row_groups(budget_edge, s, sch.BWD_MAX_ROWS_PER_THREAD) == most_groups
    # past the budget the threads walk more rows instead
    assert sch.bwd_rows_per_thread(budget_edge + 1, s, None, slab) == sch.BWD_MAX_ROWS_PER_THREAD + 1
    rpt = sch.bwd_rows_per_thread(10 ** 9, s, None, slab)
    assert sch.bwd_row_groups(10 ** 9, s, rpt) <= most_groups


def test_window_slab_budget_never_shrinks_the_cta_target():
    """Slabs larger than the budget's share (long windows, wide rows): the grid still reaches
    BWD_TARGET_CTAS row groups before threads walk more rows."""
    s = sch.choose_schedule(8, 2, 512, "bwd")
    slab = sch.slab_bytes(8, 2, 512)
    assert sch.BWD_SLAB_BYTES // slab <= sch.BWD_TARGET_CTAS
    n_rows = s.row_lanes * sch.BWD_TARGET_CTAS * 40
    assert sch.bwd_rows_per_thread(n_rows, s, None, slab) == 40


def test_window_rows_need_the_slab_bytes():
    with pytest.raises(ValueError, match="slab_bytes"):
        sch.bwd_rows_per_thread(1000, sch.choose_schedule(4, 2, 128, "bwd"))


def test_stream_forward_rows_per_cta():
    s = sch.choose_schedule(128, 2, 512, "fwd")
    row_ctas = sch.stream_row_ctas(s, "fwd")
    assert sch.fwd_rows_per_cta(1, s) == 1
    assert sch.fwd_rows_per_cta(row_ctas, s) == 1
    assert sch.fwd_rows_per_cta(row_ctas + 1, s) == 2


@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 2, 512), (16, 2, 256), (64, 1, 512), (200, 2, 192), (256, 1, 4096)])
def test_stream_forward_grid_stays_within_target(online_forward_off, ratio, coff, head_dim):
    """Whatever the row count, the pipelined forward's grid never exceeds the target (no
    second-wave stragglers)."""
    s = sch.choose_schedule(ratio, coff, head_dim, "fwd")
    for n_rows in [1, 7, 255, 256, 257, 512, 1000, 1024, 4096, 10 ** 5 + 3]:
        rpc = sch.fwd_rows_per_cta(n_rows, s)
        ctas = -(-n_rows // rpc) * s.col_tiles
        assert ctas * s.threads <= max(sch.STREAM_FWD_TARGET_THREADS, s.col_tiles * s.threads)
        assert -(-n_rows // rpc) * rpc >= n_rows


@pytest.mark.parametrize("threads,registers,ctas", [
    (512, 127, 1), (512, 64, 2), (416, 128, 1), (320, 96, 2), (320, 106, 1), (288, 123, 1), (256, 128, 2),
    (256, 129, 1), (224, 128, 2), (192, 100, 3), (160, 126, 3), (96, 124, 5), (64, 96, 10), (64, 16, 32),
    (1024, 32, 2), (32, 255, 8)])
def test_resident_ctas_per_sm(threads, registers, ctas):
    """Registers go per warp in units of 256 from 65536 per SM; 2048 threads and 32 CTAs cap the
    rest (values as ptxas gave them to the stream backward, NOTES row 91)."""
    assert sch.resident_ctas_per_sm(threads, registers) == ctas


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 2, 512), (16, 2, 256), (64, 1, 512), (128, 1, 128),
                                                (48, 2, 256), (100, 2, 128), (200, 1, 192), (37, 2, 512),
                                                (13, 2, 1024), (17, 1, 256), (12, 2, 64), (256, 2, 4096)])
@pytest.mark.parametrize("registers", [64, 96, 112, 128, 168])
def test_stream_grid_is_one_even_wave(online_forward_off, direction, ratio, coff, head_dim, registers):
    """The stream grid (pipelined forward, backward): the same CTA count on each of
    STREAM_GRID_SMS SMs (up to the column tiles' rounding), never more than fit at once, the
    thread target's CTAs per SM rounded up; where
    512 / threads is whole and the kernel fits it (the 512- and 256-thread CTAs of every SPEC
    row), exactly the grid of the thread target alone."""
    s = sch.choose_schedule(ratio, coff, head_dim, direction)
    resident = sch.resident_ctas_per_sm(s.threads, registers)
    row_ctas = sch.stream_row_ctas(s, direction, resident)
    target = sch.STREAM_FWD_TARGET_THREADS if direction == "fwd" else sch.STREAM_BWD_TARGET_THREADS
    per_sm = min(resident, -(-target // (sch.STREAM_GRID_SMS * s.threads)))
    assert row_ctas * s.col_tiles <= max(sch.STREAM_GRID_SMS * per_sm, s.col_tiles)
    assert row_ctas == max(1, sch.STREAM_GRID_SMS * per_sm // s.col_tiles)
    if target % (sch.STREAM_GRID_SMS * s.threads) == 0 and resident * s.threads * sch.STREAM_GRID_SMS >= target:
        assert row_ctas == max(1, target // s.threads // s.col_tiles)
    rows = sch.fwd_rows_per_cta if direction == "fwd" else sch.bwd_rows_per_thread
    for n_rows in (1, 300, 4096, 10 ** 6 + 7):
        # the backward's long launches may take fewer CTAs (stream_bwd_row_ctas), never more
        ctas = row_ctas if direction == "fwd" else sch.stream_bwd_row_ctas(n_rows, s, resident)
        assert ctas <= row_ctas
        assert rows(n_rows, s, resident) == max(1, -(-n_rows // ctas))


@pytest.mark.parametrize("ratio,coff,head_dim", [(100, 2, 128), (200, 1, 192), (17, 1, 256), (24, 1, 512),
                                                (128, 2, 512), (16, 2, 256), (64, 1, 512), (128, 1, 128)])
@pytest.mark.parametrize("device_sms", [78, 128, 132, 148])
def test_stream_forward_wave_counts_the_device_sms(online_forward_off, monkeypatch, ratio, coff, head_dim, device_sms):
    """The stream forward's wave is laid over the launching device's SMs (its bits do not depend
    on the grid); the backward's stays on STREAM_GRID_SMS (grad_ape's order). The launch never
    exceeds the resident CTAs of those SMs, and STREAM_FWD_GRID_SMS overrides the device."""
    s = sch.choose_schedule(ratio, coff, head_dim, "fwd")
    resident = sch.resident_ctas_per_sm(s.threads, 96)
    per_sm = min(resident, -(-sch.STREAM_FWD_TARGET_THREADS // (sch.STREAM_GRID_SMS * s.threads)))
    row_ctas = max(1, device_sms * per_sm // s.col_tiles)
    for n_rows in (1, 160, 327, 606, 4096, 10 ** 6 + 7):
        rpc = sch.fwd_rows_per_cta(n_rows, s, resident, device_sms)
        assert rpc == max(1, -(-n_rows // row_ctas))
        assert -(-n_rows // rpc) * s.col_tiles <= max(device_sms * per_sm, s.col_tiles)
        default = sch.stream_row_ctas(s, "fwd", resident)  # no SM count given: STREAM_GRID_SMS
        assert sch.fwd_rows_per_cta(n_rows, s, resident) == max(1, -(-n_rows // default))
    monkeypatch.setattr(sch, "STREAM_FWD_GRID_SMS", 128)
    assert sch.fwd_rows_per_cta(10 ** 6, s, resident, device_sms) == sch.fwd_rows_per_cta(10 ** 6, s, resident, 128)
    b = sch.choose_schedule(ratio, coff, head_dim, "bwd")
    b_ctas = sch.stream_bwd_row_ctas(10 ** 6, b, resident)  # no device SM count in it
    assert sch.bwd_rows_per_thread(10 ** 6, b, resident) == max(1, -(-10 ** 6 // b_ctas))


def test_shared_memory_caps_the_residency_when_counted(online_forward_off, monkeypatch):
    """CSA_FRONTEND_STREAM_SHARED_RESIDENT: a 224-thread forward of about 79 KB fits 2 CTAs per SM
    though its registers allow 3; off (the default), the registers alone decide."""
    s = sch.choose_schedule(25, 2, 128, "fwd")
    assert s.threads == 224 and sch.stream_shared_bytes(s, "fwd") == 78848
    assert sch.stream_row_ctas(s, "fwd", 3) == sch.STREAM_GRID_SMS * 3 // s.col_tiles
    monkeypatch.setattr(sch, "STREAM_SHARED_RESIDENT", True)
    assert sch.stream_row_ctas(s, "fwd", 3) == sch.STREAM_GRID_SMS * 2 // s.col_tiles
    for ratio, coff, head_dim in [(128, 2, 512), (16, 2, 256), (64, 1, 512), (128, 1, 128)]:  # SPEC rows
        for direction in ("fwd", "bwd"):
            t = sch.choose_schedule(ratio, coff, head_dim, direction)
            fits = sch.SM_SHARED_MEMORY // (sch.stream_shared_bytes(t, direction) + sch.CTA_SHARED_OVERHEAD)
            assert fits >= sch.resident_ctas_per_sm(t.threads, 96)  # shared memory never binds them


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_stream_resident_knob_off_keeps_the_thread_target(monkeypatch, direction):
    s = sch.choose_schedule(48, 2, 256, direction)
    monkeypatch.setitem(sch.STREAM_RESIDENT, direction, 0)
    target = sch.STREAM_FWD_TARGET_THREADS if direction == "fwd" else sch.STREAM_BWD_TARGET_THREADS
    assert sch.stream_row_ctas(s, direction, 1) == max(1, target // s.threads // s.col_tiles)


def _interleave_edge(ratio=4, coff=2, head_dim=512):
    """(schedule, rows, rows per thread) of the smallest one-segment launch whose threads walk
    WINDOW_BWD_INTERLEAVE_MIN_ROWS rows."""
    s = sch.choose_schedule(ratio, coff, head_dim, "bwd")
    n_rows = s.row_lanes * sch.BWD_TARGET_CTAS * sch.WINDOW_BWD_INTERLEAVE_MIN_ROWS
    return s, n_rows, sch.bwd_rows_per_thread(n_rows, s, None, sch.slab_bytes(ratio, coff, head_dim))


def test_interleaved_backward_rule_edges():
    s, n_rows, rpt = _interleave_edge()
    assert rpt == sch.WINDOW_BWD_INTERLEAVE_MIN_ROWS
    assert sch.bwd_interleaved(n_rows, 1, 4, 2, 512, s, rpt)
    # one row fewer per thread: contiguous runs
    fewer = n_rows - s.row_lanes * sch.BWD_TARGET_CTAS
    fewer_rpt = sch.bwd_rows_per_thread(fewer, s, None, sch.slab_bytes(4, 2, 512))
    assert not sch.bwd_interleaved(fewer, 1, 4, 2, 512, s, fewer_rpt)
    # the measured gains: coff 2 from ratio 4, coff 1 from ratio 2, head_dim 512 and wider;
    # outside them: narrower rows, smaller ratios
    for ratio, coff, head_dim, expected in [(4, 2, 256, False), (2, 2, 512, False), (8, 2, 1024, True),
                                            (4, 1, 1024, True), (2, 1, 512, True), (1, 1, 512, False),
                                            (4, 1, 256, False)]:
        s2, rows2, rpt2 = _interleave_edge(ratio, coff, head_dim)
        assert s2.family == "window" and rpt2 == rpt
        assert sch.bwd_interleaved(rows2, 1, ratio, coff, head_dim, s2, rpt2) is expected, (ratio, coff, head_dim)
    # mean segment of exactly SEGMENT_STEPS steps interleaves, shorter ones do not
    step = sch.bwd_row_groups(n_rows, s, rpt) * s.row_lanes
    segs = n_rows // (sch.WINDOW_BWD_INTERLEAVE_SEGMENT_STEPS * step)
    assert segs >= 1
    assert sch.bwd_interleaved(n_rows, segs, 4, 2, 512, s, rpt)
    assert not sch.bwd_interleaved(n_rows, segs + 1, 4, 2, 512, s, rpt)


def test_coff_1_interleaves_up_to_its_row_group_limit():
    """Past the rows-per-thread cap the grid grows beyond BWD_TARGET_CTAS row groups; coff 1
    interleaves up to WINDOW_BWD_INTERLEAVE_C1_MAX_GROUPS of them (more lost), coff 2 any number."""
    limit = sch.WINDOW_BWD_INTERLEAVE_C1_MAX_GROUPS
    assert limit > sch.BWD_TARGET_CTAS
    for coff, expected in [(1, False), (2, True)]:
        s = sch.choose_schedule(4, coff, 512, "bwd")
        slab = sch.slab_bytes(4, coff, 512)
        per_group = s.row_lanes * sch.BWD_MAX_ROWS_PER_THREAD
        for groups, interleaved in [(limit, True), (limit + 1, expected)]:
            n_rows = groups * per_group
            rpt = sch.bwd_rows_per_thread(n_rows, s, None, slab)
            assert rpt == sch.BWD_MAX_ROWS_PER_THREAD and sch.bwd_row_groups(n_rows, s, rpt) == groups
            assert sch.bwd_interleaved(n_rows, 1, 4, coff, 512, s, rpt) is interleaved, (coff, groups)


@pytest.mark.parametrize("rows_per_cta", [4, 32])
def test_window_interleave_knob_leaves_the_stream_family_alone(monkeypatch, rows_per_cta):
    s = sch.choose_schedule(128, 2, 512, "bwd")
    assert s.family == "stream"
    walks = sch.bwd_interleaved(10 ** 6, 1, 128, 2, 512, s, rows_per_cta)
    assert walks is (rows_per_cta >= sch.STREAM_BWD_INTERLEAVE_MIN_ROWS)
    for knob in ("0", "1"):
        monkeypatch.setattr(sch, "WINDOW_BWD_INTERLEAVE", knob)
        assert sch.bwd_interleaved(10 ** 6, 1, 128, 2, 512, s, rows_per_cta) is walks


@pytest.mark.parametrize("knob,coff,expected", [("auto", 1, True), ("auto", 2, False), ("0", 1, False),
                                                ("1", 2, True)])
def test_stream_forward_compiles_the_interleaved_walk_for_coff_1(monkeypatch, knob, coff, expected):
    monkeypatch.setattr(sch, "STREAM_FWD_INTERLEAVE", knob)
    assert sch.stream_fwd_may_interleave(coff) is expected


@pytest.mark.parametrize("knob,ratio,coff,head_dim,expected", [
    ("auto", 128, 1, 128, True), ("auto", 16, 1, 256, True), ("auto", 128, 2, 512, True),
    ("auto", 37, 2, 512, True), ("auto", 17, 2, 256, True), ("auto", 15, 2, 256, True),
    ("auto", 29, 2, 512, True), ("auto", 16, 2, 130, True), ("auto", 16, 2, 256, False),
    ("auto", 16, 2, 1024, False), ("0", 128, 1, 128, False), ("0", 128, 2, 512, False),
    ("1", 16, 2, 256, True)])
def test_stream_backward_compiles_the_walk_unless_it_would_spill(monkeypatch, knob, ratio, coff, head_dim, expected):
    """coff 2 compiles the walk into every kernel class but STREAM_BWD_WALK_SPILLS: the 256-thread
    r16 c2 kernels at vec 4 (128 registers for 2 CTAs per SM) spill with it."""
    monkeypatch.setattr(sch, "STREAM_BWD_INTERLEAVE", knob)
    s = sch.choose_schedule(ratio, coff, head_dim, "bwd")
    assert s.family == "stream"
    assert sch.stream_bwd_may_interleave(ratio, coff, s) is expected


def test_stream_backward_walk_spills_name_stream_kernels():
    """Each class left out names a stream backward that exists: a stale entry would silently
    leave nothing out."""
    for ratio, vec, threads in sch.STREAM_BWD_WALK_SPILLS:
        found = [s for d in range(1, 1025) for s in [sch.choose_schedule(ratio, 2, d, "bwd")]
                 if s.family == "stream" and s.vec == vec and s.threads == threads]
        assert found, (ratio, vec, threads)


@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 2, 512), (16, 2, 256), (16, 2, 128), (48, 2, 64), (17, 2, 256),
                                                (100, 2, 128), (256, 2, 512), (128, 1, 128), (32, 1, 128)])
def test_stream_backward_walks_only_where_compiled_in(ratio, coff, head_dim):
    """No launch asks the compiled kernel for a walk it was built without."""
    s = sch.choose_schedule(ratio, coff, head_dim, "bwd")
    assert s.family == "stream"
    for n_rows in (7, 300, 4096, 65536, 10 ** 6):
        for n_seg in (1, 3, 64):
            if sch.bwd_interleaved(n_rows, n_seg, ratio, coff, head_dim, s, sch.bwd_rows_per_thread(n_rows, s)):
                assert sch.stream_bwd_may_interleave(ratio, coff, s)


def test_stream_backward_interleaves_long_segments_of_many_rows_per_cta():
    """At least STREAM_BWD_INTERLEAVE_MIN_ROWS rows per CTA; a mean segment of at
    least STREAM_BWD_INTERLEAVE_SEGMENT_STEPS steps of ``row_groups`` rows."""
    s = sch.choose_schedule(128, 1, 128, "bwd")
    assert s.family == "stream"
    ctas = sch.stream_row_ctas(s, "bwd")
    n_rows = ctas * sch.STREAM_BWD_INTERLEAVE_MIN_ROWS
    rpt = sch.bwd_rows_per_thread(n_rows, s)
    assert rpt == sch.STREAM_BWD_INTERLEAVE_MIN_ROWS
    assert sch.bwd_interleaved(n_rows, 1, 128, 1, 128, s, rpt)
    # one row fewer per CTA: contiguous runs
    fewer = n_rows - ctas
    assert not sch.bwd_interleaved(fewer, 1, 128, 1, 128, s, sch.bwd_rows_per_thread(fewer, s))
    # segments of exactly SEGMENT_STEPS steps interleave, shorter ones do not
    step = sch.bwd_row_groups(n_rows, s, rpt)
    segs = n_rows // (sch.STREAM_BWD_INTERLEAVE_SEGMENT_STEPS * step)
    assert segs >= 1
    assert sch.bwd_interleaved(n_rows, segs, 128, 1, 128, s, rpt)
    assert not sch.bwd_interleaved(n_rows, segs + 1, 128, 1, 128, s, rpt)
    # coff 2 the same where compiled in (CTAs of 512, 320, 160, 256 threads), never in the
    # kernels that would spill with it
    for ratio, head_dim, threads in ((128, 512, 512), (37, 512, 320), (17, 256, 160), (15, 256, 256)):
        s2 = sch.choose_schedule(ratio, 2, head_dim, "bwd")
        assert s2.threads == threads
        assert sch.bwd_interleaved(10 ** 6, 1, ratio, 2, head_dim, s2, sch.bwd_rows_per_thread(10 ** 6, s2))
    s3 = sch.choose_schedule(16, 2, 256, "bwd")
    assert (16, s3.vec, s3.threads) in sch.STREAM_BWD_WALK_SPILLS
    assert not sch.bwd_interleaved(10 ** 6, 1, 16, 2, 256, s3, sch.bwd_rows_per_thread(10 ** 6, s3))


def test_stream_backward_interleave_knob_forces_every_launch(monkeypatch):
    s = sch.choose_schedule(32, 2, 64, "bwd")
    assert s.family == "stream"
    monkeypatch.setattr(sch, "STREAM_BWD_INTERLEAVE", "1")
    assert sch.bwd_interleaved(5, 3, 32, 2, 64, s, 1)
    monkeypatch.setattr(sch, "STREAM_BWD_INTERLEAVE", "0")
    s1 = sch.choose_schedule(32, 1, 64, "bwd")
    assert s1.family == "stream"
    assert not sch.bwd_interleaved(10 ** 6, 1, 32, 1, 64, s1, 10 ** 4)


def test_stream_forward_interleaves_long_segments_of_many_rows_per_cta():
    """coff 1 only; at least STREAM_FWD_INTERLEAVE_MIN_ROWS rows per CTA; a mean segment of at
    least STREAM_FWD_INTERLEAVE_SEGMENT_STEPS steps of the grid's row CTAs."""
    s = sch.choose_schedule(128, 1, 128, "fwd")
    assert s.family == "stream"
    ctas = sch.stream_row_ctas(s, "fwd", None, 132)
    n_rows = ctas * sch.STREAM_FWD_INTERLEAVE_MIN_ROWS
    rpc = sch.fwd_rows_per_cta(n_rows, s, None, 132)
    assert rpc == sch.STREAM_FWD_INTERLEAVE_MIN_ROWS
    assert sch.fwd_interleaved(n_rows, 1, 1, rpc)
    # one row fewer per CTA: contiguous runs
    fewer = n_rows - ctas
    assert not sch.fwd_interleaved(fewer, 1, 1, sch.fwd_rows_per_cta(fewer, s, None, 132))
    # segments of exactly SEGMENT_STEPS steps interleave, shorter ones do not
    segs = n_rows // (sch.STREAM_FWD_INTERLEAVE_SEGMENT_STEPS * ctas)
    assert segs >= 1
    assert sch.fwd_interleaved(n_rows, segs, 1, rpc)
    assert not sch.fwd_interleaved(n_rows, segs + 1, 1, rpc)
    # coff 2 never (not compiled in)
    assert not sch.fwd_interleaved(10 ** 6, 1, 2, 10 ** 3)


def test_stream_forward_interleave_knob_forces_every_launch(monkeypatch):
    monkeypatch.setattr(sch, "STREAM_FWD_INTERLEAVE", "1")
    assert sch.fwd_interleaved(5, 3, 2, 1)
    monkeypatch.setattr(sch, "STREAM_FWD_INTERLEAVE", "0")
    assert not sch.fwd_interleaved(10 ** 6, 1, 1, 10 ** 4)


@pytest.mark.parametrize("knob,expected", [("0", False), ("1", True)])
def test_interleaved_backward_knob(monkeypatch, knob, expected):
    s = sch.choose_schedule(4, 2, 128, "bwd")
    monkeypatch.setattr(sch, "WINDOW_BWD_INTERLEAVE", knob)
    assert sch.bwd_interleaved(5, 3, 4, 2, 128, s, 1) is expected


@pytest.mark.parametrize("n_segments", [0, 1, 2, 3, 511, 512, 513])
def test_zero_fill_covers_every_segment(n_segments):
    s = sch.choose_schedule(4, 2, 128, "bwd")
    ctas = sch.zero_fill_ctas(n_segments, s)
    assert ctas >= 1 and ctas * s.row_lanes >= n_segments


def test_planner_never_sees_the_sm_count():
    """Nothing that sets the backward's split of rows (grad_ape's summation order) takes an SM
    count; only the forward's row split does (``fwd_rows_per_cta``: no output of the forward
    depends on it, which a GPU test checks bitwise)."""
    for fn in (sch.choose_schedule, sch.bwd_rows_per_thread, sch.bwd_row_groups, sch.ape_split,
               sch.zero_fill_ctas, sch.bwd_interleaved):
        assert not any("sm" in p.lower() for p in inspect.signature(fn).parameters)
    assert "multi_processor_count" not in inspect.getsource(sch)


@pytest.mark.parametrize("n_slab", [1, 2, 31, 32, 33, 64, 65, 255, 256, 257, 512, 513, 1024, 10 ** 6])
def test_ape_split_keeps_chains_short(n_slab):
    """Warps per grad_ape element group: a power of two dividing the CTA's warps, the fewest
    that keep each warp's chain of slabs at APE_SLABS_PER_CHAIN (all warps past that)."""
    split = sch.ape_split(n_slab)
    assert split in (1, 2, 4, 8, 16) and sch.APE_REDUCE_WARPS % split == 0
    chain = -(-n_slab // split)
    assert chain <= sch.APE_SLABS_PER_CHAIN or split == sch.APE_REDUCE_WARPS
    if split > 1:  # one split fewer would leave a chain too long
        assert -(-n_slab // (split // 2)) > sch.APE_SLABS_PER_CHAIN


@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 2, 512), (128, 2, 128), (256, 2, 4096), (128, 1, 128),
                                                 (64, 1, 512), (16, 2, 256), (200, 2, 192)])
def test_stream_ctas_widen_only_wide_windows(ratio, coff, head_dim):
    """512-thread CTAs (more columns of each token row per warp) only for windows of
    STREAM_WIDE_CHUNKS chunks or more, per direction; 256 threads otherwise."""
    fwd = sch.choose_schedule(ratio, coff, head_dim, "fwd")
    bwd = sch.choose_schedule(ratio, coff, head_dim, "bwd")
    for sched, direction in ((fwd, "fwd"), (bwd, "bwd")):
        wide = -(-coff * ratio // sched.chunk) >= sch.STREAM_WIDE_CHUNKS[direction]
        assert sched.threads > 256 if wide else sched.threads <= 256
    # the measured choice (benchmark/NOTES.md row 39): r64 c1 and wider backwards at 512 threads, r16 c2 at 256
    assert bwd.threads > 256 if coff * ratio >= 64 else bwd.threads <= 256
    if -(-coff * ratio // fwd.chunk) >= sch.STREAM_WIDE_CHUNKS["fwd"]:
        assert fwd.col_threads * fwd.vec * 2 >= 64  # a warp reads at least half a line per token row


@pytest.mark.parametrize("ratio", [1, 4, 8, 16, 33, 64, 128, 200, 256])
@pytest.mark.parametrize("coff", [1, 2])
@pytest.mark.parametrize("head_dim", [2, 65, 66, 128, 192, 512, 4096])
def test_few_rows_schedule_is_a_narrower_stream_schedule(ratio, coff, head_dim):
    """The row-count bucket's schedule: only for stream backwards wider than vec 2; vec 2 at the
    default's CTA width (at most 256 threads for windows of up to STREAM_BWD_FEW_ROWS_NARROW
    positions), covering the same problem."""
    default = sch.choose_schedule(ratio, coff, head_dim, "bwd")
    few = sch.few_rows_schedule(ratio, coff, head_dim)
    if default.family == "window" or default.vec <= 2:
        assert few is None
        return
    narrow = coff * ratio <= sch.STREAM_BWD_FEW_ROWS_NARROW and default.threads == 512
    width = 256 if narrow else default.threads
    assert few.family == "stream" and few.vec == 2 and few.threads == width
    n_vec = head_dim // few.vec
    assert few.col_threads * few.col_tiles >= n_vec > few.col_threads * (few.col_tiles - 1)
    assert few.row_lanes * few.chunk >= coff * ratio and few.row_lanes % max(1, 32 // few.col_threads) == 0


@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 2, 128), (128, 2, 512), (64, 1, 512), (16, 2, 256),
                                                (128, 1, 128), (64, 2, 256)])
def test_few_rows_bucket_boundary(ratio, coff, head_dim):
    """The bucket is a function of the row count and the two schedules only: launches whose
    CTAs walk at most STREAM_BWD_FEW_ROWS rows of the default schedule (STREAM_BWD_FEW_ROWS_NARROW_ROWS
    where the few-rows schedule is the narrow, fewer-threads variant) take the few-rows
    schedule, the next row count takes the default."""
    s = sch.choose_schedule(ratio, coff, head_dim, "bwd")
    few = sch.few_rows_schedule(ratio, coff, head_dim)
    narrow = few.threads < s.threads
    assert narrow is (coff * ratio <= sch.STREAM_BWD_FEW_ROWS_NARROW and s.threads == 512)
    limit = sch.STREAM_BWD_FEW_ROWS_NARROW_ROWS if narrow else sch.STREAM_BWD_FEW_ROWS
    row_ctas = sch.stream_row_ctas(s, "bwd")
    last = row_ctas * limit
    for n_rows in (0, 1, row_ctas, last):
        assert sch.takes_few_rows_schedule(n_rows, s, few)
    for n_rows in (last + 1, 10 * last, 10 ** 6):
        assert not sch.takes_few_rows_schedule(n_rows, s, few)
    assert not sch.takes_few_rows_schedule(1, sch.choose_schedule(4, 2, 128, "bwd"), few)  # window family
    assert not sch.takes_few_rows_schedule(1, s, None)  # a configuration without a few-rows schedule


@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 2, 128), (64, 1, 512), (48, 2, 256), (4, 2, 128)])
def test_backward_launch_takes_the_bucket_once(ratio, coff, head_dim):
    """``dispatch.backward_for_rows``, the launch's one choice of kernels and rows per CTA: the
    few-rows kernels exactly where ``takes_few_rows_schedule`` says so, with their own rows."""
    from csa_frontend.compressor.kernels import dispatch
    s = sch.choose_schedule(ratio, coff, head_dim, "bwd")
    few_sched = sch.few_rows_schedule(ratio, coff, head_dim)
    few = None if few_sched is None else ("few main", "few reduce", few_sched, 2)
    slab = sch.slab_bytes(ratio, coff, head_dim)
    for n_rows in (0, 1, 63, 64, 65, 128, 129, 256, 257, 1000, 10 ** 6):
        main, reduce, sched, rpt = dispatch.backward_for_rows(n_rows, "main", "reduce", s, 1, few, slab)
        if sch.takes_few_rows_schedule(n_rows, s, few_sched, 1):
            assert (main, reduce, sched, rpt) == few[:3] + (sch.bwd_rows_per_thread(n_rows, few_sched, 2, slab),)
        else:
            assert (main, reduce, sched, rpt) == ("main", "reduce", s, sch.bwd_rows_per_thread(n_rows, s, 1, slab))


@pytest.mark.parametrize("head_dim,col_threads,row_lanes", [(512, 64, 4), (1024, 128, 2), (520, 65, 3),
                                                          (4096, 256, 1)])
def test_wide_window_backward_is_the_default_at_16_byte_accesses(head_dim, col_threads, row_lanes):
    s = sch.choose_schedule(4, 1, head_dim, "bwd")
    wide = sch.wide_rows_schedule(4, 1, head_dim)
    assert s.family == "window" and s.vec == 4
    assert wide == sch.Schedule("window", 8, col_threads, row_lanes, -(-head_dim // 8 // col_threads))
    assert sch.row_bucket_schedule(4, 1, head_dim) == wide


@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 1, 256), (4, 1, 516), (4, 2, 512), (2, 1, 512), (3, 1, 512),
                                                 (8, 1, 512), (128, 1, 512)])
def test_wide_window_backward_only_where_measured(ratio, coff, head_dim):
    """r4 c1 from head_dim 512 with a head_dim vec 8 divides; elsewhere no wide schedule (the
    row-count bucket is then the few-rows one or none)."""
    assert sch.wide_rows_schedule(ratio, coff, head_dim) is None
    assert sch.row_bucket_schedule(ratio, coff, head_dim) == sch.few_rows_schedule(ratio, coff, head_dim)


def test_wide_window_backward_knob_off(monkeypatch):
    monkeypatch.setattr(sch, "WINDOW_BWD_WIDE_MIN_ROWS", 0)
    assert sch.wide_rows_schedule(4, 1, 512) is None and sch.row_bucket_schedule(4, 1, 512) is None


def test_long_launches_take_the_wide_window_backward():
    """``dispatch.backward_for_rows``: from WINDOW_BWD_WIDE_MIN_ROWS rows the wide kernels with
    their own rows per thread, below it the default's; a stream few-rows bucket never counts as
    wide, and a configuration without a bucket keeps its default at any count."""
    from csa_frontend.compressor.kernels import dispatch
    s = sch.choose_schedule(4, 1, 512, "bwd")
    wide_sched = sch.wide_rows_schedule(4, 1, 512)
    wide = ("wide main", "wide reduce", wide_sched, 0)
    slab = sch.slab_bytes(4, 1, 512)
    edge = sch.WINDOW_BWD_WIDE_MIN_ROWS
    for n_rows in (0, 1, 6144, edge - 1, edge, edge + 1, 10 ** 6):
        got = dispatch.backward_for_rows(n_rows, "main", "reduce", s, 0, wide, slab)
        if n_rows >= edge:
            assert got == wide[:3] + (sch.bwd_rows_per_thread(n_rows, wide_sched, 0, slab),)
        else:
            assert got == ("main", "reduce", s, sch.bwd_rows_per_thread(n_rows, s, 0, slab))
        assert dispatch.backward_for_rows(n_rows, "main", "reduce", s, 0, None, slab)[0] == "main"
    few_sched = sch.few_rows_schedule(128, 2, 128)
    assert not sch.takes_wide_rows_schedule(edge, few_sched) and not sch.takes_wide_rows_schedule(edge, None)
    # the measured launches: 1x65536 r4 c1 d512 wide (and interleaved), 3x8192 not
    assert sch.takes_wide_rows_schedule(65536 // 4, wide_sched)
    assert not sch.takes_wide_rows_schedule(3 * 8192 // 4, wide_sched)
    rpt = sch.bwd_rows_per_thread(16384, wide_sched, 0, slab)
    assert sch.bwd_interleaved(16384, 1, 4, 1, 512, wide_sched, rpt)


def test_atomic_ape_only_where_few_row_groups_meet(monkeypatch):
    """``deterministic=False`` adds grad_ape atomically up to STREAM_ATOMIC_MAX_GROUPS row groups
    of the stream family (measured: 64 faster, 128 slower than the deterministic kernels), at
    any count in the register-window family; ``dispatch.atomic_may_fall_back`` says which
    configurations need the deterministic kernels compiled beside the atomic ones."""
    from csa_frontend.compressor.kernels import dispatch
    stream = sch.choose_schedule(16, 2, 256, "bwd")
    window = sch.choose_schedule(4, 2, 512, "bwd")
    limit = sch.STREAM_ATOMIC_MAX_GROUPS
    assert stream.family == "stream" and window.family == "window" and limit == 64
    assert sch.atomic_ape_pays(stream, 1) and sch.atomic_ape_pays(stream, limit)
    assert not sch.atomic_ape_pays(stream, limit + 1)
    assert sch.atomic_ape_pays(window, 10 ** 6)
    # the SPEC's stream rows at their launch's row groups (residency as compiled: 1 CTA of 512
    # threads per SM, 2 of 256): only r16 falls back
    for ratio, coff, head_dim, tokens, pays in [(128, 1, 128, 131072, True), (128, 2, 128, 8192, True),
                                                (64, 1, 512, 65536, True), (128, 2, 512, 65536, True),
                                                (16, 2, 256, 4 * 8192, False)]:
        s = sch.choose_schedule(ratio, coff, head_dim, "bwd")
        per_sm = 2 if s.threads == 256 else 1
        rows = tokens // ratio
        groups = sch.bwd_row_groups(rows, s, sch.bwd_rows_per_thread(rows, s, per_sm))
        assert sch.atomic_ape_pays(s, groups) is pays, (ratio, coff, head_dim, groups)
        # a stream launch has at most stream_row_ctas row groups, the bound the compile uses
        assert groups <= sch.stream_row_ctas(s, "bwd", per_sm)
        assert dispatch.atomic_may_fall_back(("main", None, s, per_sm), None) is not pays
    assert not dispatch.atomic_may_fall_back(("main", None, window, 0), None)
    assert dispatch.atomic_may_fall_back(None, ("few main", None, stream, 2))
    monkeypatch.setattr(sch, "STREAM_ATOMIC_MAX_GROUPS", 0)
    assert not sch.atomic_ape_pays(stream, 1) and sch.atomic_ape_pays(window, 1)


def test_atomic_backward_launch_falls_back_to_the_deterministic_kernels():
    """``dispatch._launch_backward`` with the atomic variant: its own main kernel (grad_ape
    zeroed first, no slab) up to the limit, the deterministic main kernel and slab reduction
    beyond it; the deterministic direction never looks at the fallback."""
    import torch

    from csa_frontend.compressor.kernels import dispatch
    ratio, coff, head_dim = 16, 2, 256
    s = sch.choose_schedule(ratio, coff, head_dim, "bwd")
    calls = []

    def kernel(name):
        return lambda *args: calls.append((name, args[8].shape if name.endswith("main") else None))

    atomic = (kernel("atomic main"), None, s, 2, None)
    exact = dispatch.BackwardKernels(kernel("exact main"), kernel("exact reduce"), s, 2, None)
    cols = coff * head_dim

    def launch(rows, kernels, fallback):
        calls.clear()
        cu = torch.tensor([0, rows * ratio], dtype=torch.int32)
        comp = torch.tensor([0, rows], dtype=torch.int32)
        kv = torch.zeros(rows * ratio, cols, dtype=torch.bfloat16)
        grad_ape = torch.full((ratio, cols), float("nan"))
        dispatch._launch_backward(*kernels, kv, kv, grad_ape, cu, comp, torch.zeros(rows, head_dim), kv, kv,
                                  grad_ape, ratio, coff, head_dim, fallback)
        return [name for name, _ in calls], grad_ape

    row_ctas = sch.stream_row_ctas(s, "bwd", 2)
    assert row_ctas > sch.STREAM_ATOMIC_MAX_GROUPS
    names, grad_ape = launch(sch.STREAM_ATOMIC_MAX_GROUPS, atomic, exact)
    assert names == ["atomic main"] and torch.equal(grad_ape, torch.zeros_like(grad_ape))
    names, grad_ape = launch(sch.STREAM_ATOMIC_MAX_GROUPS + 1, atomic, exact)
    assert names == ["exact main", "exact reduce"] and grad_ape.isnan().all()
    assert calls[0][1][0] == sch.STREAM_ATOMIC_MAX_GROUPS + 1  # one slab per row group
    names, _ = launch(10 * row_ctas, atomic, None)  # no fallback at hand: atomics at any count
    assert names == ["atomic main"]
    names, _ = launch(10 * row_ctas, exact, dispatch.BackwardKernels(*atomic))  # fallback ignored
    assert names == ["exact main", "exact reduce"]


def test_backward_launch_without_grad_ape_skips_the_reduction():
    """``dispatch._launch_backward`` with ``grad_ape`` None (a frozen ape): the deterministic main
    kernel still gets its slabs but no reduction runs; the atomic one adds into zeroed scratch."""
    import torch

    from csa_frontend.compressor.kernels import dispatch
    ratio, coff, head_dim, rows = 16, 2, 256, 40
    s = sch.choose_schedule(ratio, coff, head_dim, "bwd")
    calls = []

    def kernel(name):
        return lambda *args: calls.append((name, tuple(args[8].shape[1:]) if name.endswith("main") else None))

    cols = coff * head_dim
    cu = torch.tensor([0, rows * ratio], dtype=torch.int32)
    comp = torch.tensor([0, rows], dtype=torch.int32)
    kv = torch.zeros(rows * ratio, cols, dtype=torch.bfloat16)
    ape = torch.zeros(ratio, cols)
    for kernels, want in [(dispatch.BackwardKernels(kernel("exact main"), kernel("exact reduce"), s, 2, None),
                           [("exact main", (ratio, cols))]),
                          ((kernel("atomic main"), None, s, 2, None), [("atomic main", (ratio, cols))])]:
        calls.clear()
        dispatch._launch_backward(*kernels, kv, kv, ape, cu, comp, torch.zeros(rows, head_dim), kv, kv, None,
                                  ratio, coff, head_dim)
        assert calls == want


def test_atomic_backward_looks_up_its_fallback_only_where_it_needs_one(monkeypatch):
    """``dispatch._backward_kernels``: the direction's kernels, and the deterministic direction's
    for an atomic variant that may meet too many row groups (default or few-rows schedule), else
    None; each looked up once."""
    from csa_frontend.compressor.kernels import dispatch
    looked_up = []

    def kernels_for(direction, device, ratio, coff, head_dim):
        looked_up.append(direction)
        s = sch.choose_schedule(ratio, coff, head_dim, "bwd")
        few_sched = sch.few_rows_schedule(ratio, coff, head_dim)
        few = None if few_sched is None else ("few main", None, few_sched, 2)
        return dispatch.BackwardKernels(direction, None, s, 2 if s.threads == 256 else 1, few)

    monkeypatch.setattr(dispatch, "_kernels_for", kernels_for)
    kernels, exact = dispatch._backward_kernels(True, None, 16, 2, 256)
    assert kernels.main == "bwd" and exact is None and looked_up == ["bwd"]
    looked_up.clear()
    kernels, exact = dispatch._backward_kernels(False, None, 16, 2, 256)
    assert kernels.main == "bwd_atomic" and exact.main == "bwd" and looked_up == ["bwd_atomic", "bwd"]
    looked_up.clear()
    assert dispatch._backward_kernels(False, None, 128, 2, 512)[1] is None and looked_up == ["bwd_atomic"]
    assert dispatch._backward_kernels(False, None, 4, 2, 512)[1] is None  # window family


@pytest.mark.parametrize("ratio,coff,head_dim,once", [
    (128, 2, 512, True), (128, 1, 128, True), (64, 1, 512, True), (256, 2, 192, True),  # 16+ warp groups
    (16, 2, 256, False), (32, 1, 64, False)])  # 256-thread CTAs of 8 or fewer groups
def test_backward_combines_once_per_cta_from_16_groups(ratio, coff, head_dim, once):
    """The measured choice (benchmark/NOTES.md row 39): CTAs of 16+ warp groups combine their
    per-row partials once; smaller ones in every warp. The few-rows schedule follows the same rule."""
    sched = sch.choose_schedule(ratio, coff, head_dim, "bwd")
    assert sched.family == "stream"
    groups = sch.warp_groups(sched)
    assert groups * max(1, 32 // sched.col_threads) == sched.row_lanes
    assert sch.combines_once_per_cta(sched) is once
    assert once is (groups >= sch.STREAM_BWD_COMBINE_GROUPS)
    few = sch.few_rows_schedule(ratio, coff, head_dim)
    if few is not None:
        assert sch.combines_once_per_cta(few) is (sch.warp_groups(few) >= sch.STREAM_BWD_COMBINE_GROUPS)


@pytest.mark.parametrize("ratio,coff,head_dim", [(16, 2, 192), (16, 2, 256), (32, 2, 512), (128, 1, 128)])
def test_combine_once_only_where_one_warp_spans_the_columns(monkeypatch, ratio, coff, head_dim):
    """Warps 0 and 1 combine for the whole CTA, so they must hold every column thread. Knob-made
    1024-thread CTAs of 2-position chunks give 16+ groups of 64 column threads (r16 c2 d192 had
    wrong grad_kv in the upper columns on the H200 before the rule); those combine in every warp."""
    monkeypatch.setitem(sch.STREAM_CTA_THREADS, "bwd", 1024)
    monkeypatch.setitem(sch.STREAM_CHUNK_VALUES, "bwd", 8)
    sched = sch._stream_schedule(ratio, coff, head_dim, 4, "bwd")
    assert sched.threads == 1024
    assert sch.combines_once_per_cta(sched) is (sched.col_threads <= 32)
    if sched.col_threads > 32:
        assert sch.warp_groups(sched) >= sch.STREAM_BWD_COMBINE_GROUPS  # the case the rule is for


def test_backward_column_clusters_where_they_tile_on_sm90(monkeypatch):
    """``CSA_FRONTEND_STREAM_BWD_CLUSTER``: stream backward launches whose column tiles it
    divides take clusters of that many column tiles on sm_90 and later (2 by default), the others
    (one column tile, every window backward, sm_80 and an unnamed arch) none; 1 turns it off;
    sizes outside the portable 1/2/4/8 are refused by name."""
    r128 = sch.choose_schedule(128, 2, 512, "bwd")
    one_tile = sch.choose_schedule(128, 2, 24, "bwd")
    window = sch.choose_schedule(4, 2, 512, "bwd")
    assert (r128.family, r128.col_tiles, one_tile.family, one_tile.col_tiles, window.family) == (
        "stream", 16, "stream", 1, "window")

    def clusters(arch):
        return [sch.bwd_column_cluster(s, arch) for s in (r128, one_tile, window)]

    assert clusters("sm_90a") == clusters("sm_100a") == [2, 1, 1]
    assert clusters("sm_80") == clusters(None) == [1, 1, 1]
    monkeypatch.setattr(sch, "STREAM_BWD_COLUMN_CLUSTER", 1)
    assert clusters("sm_90a") == [1, 1, 1]
    twelve = sch.choose_schedule(128, 2, 384, "bwd")
    assert twelve.col_tiles == 12
    monkeypatch.setattr(sch, "STREAM_BWD_COLUMN_CLUSTER", 8)
    assert (sch.bwd_column_cluster(r128, "sm_90a"), sch.bwd_column_cluster(twelve, "sm_90a")) == (8, 1)
    monkeypatch.setattr(sch, "STREAM_BWD_COLUMN_CLUSTER", 3)
    with pytest.raises(ValueError, match="CSA_FRONTEND_STREAM_BWD_CLUSTER"):
        sch.bwd_column_cluster(r128, "sm_90a")


def test_backward_grid_sms_knob_lays_only_the_backward_over_fewer_sms(monkeypatch):
    """``CSA_FRONTEND_STREAM_BWD_GRID_SMS``: the stream backward's row CTAs counted on that many
    SMs (still a constant, so grad_ape's order depends on the row count alone); 0 keeps
    STREAM_GRID_SMS; the forward's grid never follows it."""
    bwd = sch.choose_schedule(128, 2, 512, "bwd")
    fwd = sch.choose_schedule(128, 2, 512, "fwd")
    assert bwd.col_tiles == 16
    monkeypatch.setattr(sch, "STREAM_BWD_GRID_SMS", 0)
    default_bwd, default_fwd = sch.stream_row_ctas(bwd, "bwd", 1), sch.stream_row_ctas(fwd, "fwd", 1)
    assert default_bwd == sch.STREAM_GRID_SMS // 16 == 8
    monkeypatch.setattr(sch, "STREAM_BWD_GRID_SMS", 112)
    assert sch.stream_row_ctas(bwd, "bwd", 1) == 7
    assert sch.bwd_rows_per_thread(512, bwd, 1) == 74  # 7 CTAs of at most 74 of the 512 rows
    assert sch.stream_row_ctas(fwd, "fwd", 1) == default_fwd
    assert sch.stream_row_ctas(bwd, "bwd", 1, sms=128) == default_bwd  # an explicit count wins


@pytest.mark.parametrize("ratio,coff,head_dim,full,narrow", [
    (128, 2, 512, 8, 7), (64, 2, 512, 16, 14), (128, 2, 256, 16, 14), (128, 1, 128, 64, 56),
    (16, 2, 256, 128, 112),  # 256-thread CTAs, 2 per SM at these registers
    (256, 2, 512, 4, 4)])  # 32 column tiles: 112 SMs would round 3.5 row CTAs down to 3, so never
def test_long_stream_backwards_lay_their_grid_over_fewer_sms(monkeypatch, ratio, coff, head_dim, full, narrow):
    """STREAM_BWD_LONG_GRID_SMS: a launch of CTAs of at least STREAM_BWD_LONG_GRID_MIN_ROWS rows
    on the full grid takes the 112-SM grid, but only where that scales the row CTAs exactly."""
    monkeypatch.setattr(sch, "STREAM_BWD_GRID_SMS", 0)
    monkeypatch.setattr(sch, "STREAM_BWD_LONG_GRID_SMS", 112)
    s = sch.choose_schedule(ratio, coff, head_dim, "bwd")
    resident = sch.resident_ctas_per_sm(s.threads, 128)
    assert sch.stream_row_ctas(s, "bwd", resident) == full
    edge = full * sch.STREAM_BWD_LONG_GRID_MIN_ROWS
    assert sch.stream_bwd_row_ctas(edge - 1, s, resident) == full  # CTAs of < 16 rows: the full grid
    for n_rows in (edge, 10 ** 6):
        assert sch.stream_bwd_row_ctas(n_rows, s, resident) == narrow
        assert sch.bwd_rows_per_thread(n_rows, s, resident) == -(-n_rows // narrow)
    monkeypatch.setattr(sch, "STREAM_BWD_LONG_GRID_SMS", 0)
    assert sch.stream_bwd_row_ctas(10 ** 6, s, resident) == full
    monkeypatch.setattr(sch, "STREAM_BWD_LONG_GRID_SMS", 112)
    monkeypatch.setattr(sch, "STREAM_BWD_GRID_SMS", 96)  # the A/B knob wins for every launch
    assert sch.stream_bwd_row_ctas(10 ** 6, s, resident) == sch.stream_row_ctas(s, "bwd", resident)
    monkeypatch.setattr(sch, "STREAM_BWD_GRID_SMS", 0)
    for few_sms in (3, 5, 56, 112):  # tests' small grids: never widened to the long grid
        monkeypatch.setattr(sch, "STREAM_GRID_SMS", few_sms)
        assert sch.stream_bwd_row_ctas(10 ** 6, s, resident) == sch.stream_row_ctas(s, "bwd", resident)


def test_few_rows_knob_off_means_never(monkeypatch):
    monkeypatch.setattr(sch, "STREAM_BWD_FEW_ROWS", 0)
    s = sch.choose_schedule(128, 1, 128, "bwd")
    assert not sch.takes_few_rows_schedule(1, s, sch.few_rows_schedule(128, 1, 128))


@pytest.mark.parametrize("ratio,coff,default,few", [
    (64, 1, 512, 256), (128, 1, 512, 256), (64, 2, 512, 256),  # 64-128 positions: 256 threads
    (256, 1, 512, 512), (128, 2, 512, 512), (256, 2, 512, 512),  # wider: the default's 512
    (33, 2, 288, 288), (100, 1, 416, 416)])  # defaults below 512 (not measured): kept
def test_few_rows_width_boundary(ratio, coff, default, few):
    """The measured split (STREAM_BWD_FEW_ROWS_NARROW, 128 positions): narrow windows' few-rows
    launches run 256-thread CTAs where the default has 512, every other keeps the default's."""
    assert sch.choose_schedule(ratio, coff, 512, "bwd").threads == default
    assert sch.few_rows_schedule(ratio, coff, 512).threads == few


def test_combine_knob_off_means_every_warp_combines(monkeypatch):
    monkeypatch.setattr(sch, "STREAM_BWD_COMBINE_GROUPS", 0)
    assert not sch.combines_once_per_cta(sch.choose_schedule(128, 2, 512, "bwd"))


@pytest.mark.parametrize("head_dim,tile", [(64, True), (128, True), (192, True), (256, True), (384, True),
                                           (512, True), (1024, False), (4096, False)])
def test_window_backward_stages_ape_for_narrow_heads(head_dim, tile):
    """The ape tile goes where a CTA holds at least 2 row lanes (measured faster there with the
    row cap and slab budget of NOTES row 104; one lane, d >= 1024, not measured)."""
    sched = sch.choose_schedule(4, 2, head_dim, "bwd")
    assert sched.family == "window"
    assert sch.stages_ape_tile(sched) is tile
    assert (sched.row_lanes >= 2) is tile


def test_ape_tile_knob(monkeypatch):
    sched = sch.choose_schedule(4, 2, 512, "bwd")
    monkeypatch.setattr(sch, "WINDOW_BWD_APE_TILE_LANES", 1)
    assert sch.stages_ape_tile(sched)
    monkeypatch.setattr(sch, "WINDOW_BWD_APE_TILE_LANES", 0)
    assert not sch.stages_ape_tile(sch.choose_schedule(4, 2, 128, "bwd"))
    assert not sch.stages_ape_tile(sch.choose_schedule(128, 2, 128, "bwd"))


# -- the bulk-copy forward ----------------------------------------------------------------------

@pytest.fixture
def bulk_cache():
    sch.bulk_forward_schedule.cache_clear()
    yield
    sch.bulk_forward_schedule.cache_clear()


@pytest.mark.parametrize("ratio,coff,head_dim", [(2, 2, 512), (2, 2, 1024), (2, 2, 768)])
def test_bulk_forward_serves_coff2_wide_heads_on_sm90(bulk_cache, ratio, coff, head_dim):
    """Where it was measured faster (ratio 2, coff 2, head_dim >= 512) on sm_90+, the bulk-copy schedule
    keeps the per-thread forward's vector width, puts every column slice of a row in one CTA and
    fits its stages (>= 3) in a CTA's share of shared memory."""
    base = sch.choose_schedule(ratio, coff, head_dim, "fwd")
    for arch in ("sm_90a", "sm_100a"):
        s = sch.bulk_forward_schedule(ratio, coff, head_dim, arch)
        assert s is not None and s.family == "window" and s.vec == base.vec
        assert s.col_tiles == 1 and s.col_threads == head_dim // s.vec
        assert s.threads <= sch.WINDOW_FWD_BULK_THREADS and s.row_lanes >= 1
        assert 3 <= s.stages <= sch.WINDOW_FWD_BULK_STAGES
        assert sch.bulk_smem_bytes(ratio, coff, head_dim, s) <= sch.WINDOW_FWD_BULK_SMEM
        # a block is a whole number of 16-byte units (cp.async.bulk sizes and addresses)
        assert sch.bulk_block_bytes(ratio, coff, head_dim) % 16 == 0


@pytest.mark.parametrize("ratio,coff,head_dim,arch", [
    (4, 2, 512, "sm_80"), (4, 2, 512, None),  # no cp.async.bulk
    (4, 1, 512, "sm_90a"), (2, 2, 128, "sm_90a"), (2, 2, 256, "sm_90a"),  # measured slower
    (4, 2, 512, "sm_90a"), (1, 2, 512, "sm_90a"), (3, 2, 512, "sm_90a"),  # slower than the checked per-thread one
    (128, 2, 512, "sm_90a"),  # stream family
    (2, 2, 4096, "sm_90a"),  # more column slices than consumer threads
    (2, 2, 514, "sm_90a"),  # token rows of 2056 bytes: not 16-byte units
])
def test_bulk_forward_declines(bulk_cache, ratio, coff, head_dim, arch):
    assert sch.bulk_forward_schedule(ratio, coff, head_dim, arch) is None


def test_bulk_forward_knob_off(bulk_cache, monkeypatch):
    monkeypatch.setattr(sch, "WINDOW_FWD_BULK_STAGES", 0)
    assert sch.bulk_forward_schedule(2, 2, 512, "sm_90a") is None


def test_bulk_forward_stages_shrink_to_fit(bulk_cache, monkeypatch):
    """Less shared memory per CTA: fewer stages, then none below 3."""
    full = sch.bulk_forward_schedule(2, 2, 512, "sm_90a")
    block = sch.bulk_block_bytes(2, 2, 512)
    blocks_at_3 = 3 * full.row_lanes + 1
    monkeypatch.setattr(sch, "WINDOW_FWD_BULK_SMEM", 2 * blocks_at_3 * block)
    sch.bulk_forward_schedule.cache_clear()
    assert sch.bulk_forward_schedule(2, 2, 512, "sm_90a").stages == 3 < full.stages
    monkeypatch.setattr(sch, "WINDOW_FWD_BULK_SMEM", 2 * blocks_at_3 * block - 1)
    sch.bulk_forward_schedule.cache_clear()
    assert sch.bulk_forward_schedule(2, 2, 512, "sm_90a") is None


@pytest.mark.parametrize("ratio,head_dim", [(2, 512), (2, 1024)])
def test_bulk_forward_row_count_boundary(bulk_cache, ratio, head_dim):
    """Launches of at least WINDOW_FWD_BULK_MIN_STAGES stages per CTA take the bulk forward; the
    stages cover every row and the CTAs never exceed the target."""
    s = sch.bulk_forward_schedule(ratio, 2, head_dim, "sm_90a")
    edge = sch.WINDOW_FWD_BULK_MIN_STAGES * sch.WINDOW_FWD_BULK_CTAS * s.row_lanes
    one_stage_less_per_cta = edge - s.row_lanes * sch.WINDOW_FWD_BULK_CTAS
    assert sch.bulk_forward_walk(edge, s) == sch.bulk_stages_per_cta(edge, s) == sch.WINDOW_FWD_BULK_MIN_STAGES
    assert sch.bulk_forward_walk(one_stage_less_per_cta, s) == 0 == sch.bulk_forward_walk(10 ** 9, None)
    for rows in (1, s.row_lanes, edge - 1, edge, edge + 1, 10 ** 6 + 7):
        per = sch.bulk_stages_per_cta(rows, s)
        stages = -(-rows // s.row_lanes)
        ctas = -(-stages // per)
        assert ctas * per >= stages > (ctas - 1) * per and ctas <= sch.WINDOW_FWD_BULK_CTAS


def meta_forward_inputs(ratio, coff, head_dim, n_seg=1):
    """(kv, score, ape, cu_seqlens, cu_seqlens_comp) on the meta device, shaped as a forward
    launch sees them (no tokens), for ``dispatch.forward_call``."""
    import torch
    tokens = torch.empty(0, coff * head_dim, device="meta")
    cu = torch.empty(n_seg + 1, device="meta")
    return tokens, tokens, torch.empty(ratio, coff * head_dim, device="meta"), cu, cu


@pytest.mark.parametrize("ratio,coff,head_dim,routes", [
    (2, 2, 512, {"bulk", "window"}), (4, 2, 512, {"window"}), (128, 2, 128, {"stream"})])
def test_forward_call_routes_by_row_count(bulk_cache, ratio, coff, head_dim, routes):
    """``dispatch.forward_call``, the one place a forward launch picks its kernel and trailing
    argument: the bulk-copy kernel with its stages per CTA from the row count on where the
    planner has one, else the stream forward with its rows per CTA, else the plain window one."""
    import torch

    from csa_frontend.compressor.kernels import dispatch
    sched = sch.choose_schedule(ratio, coff, head_dim, "fwd")
    bulk_sched = sch.bulk_forward_schedule(ratio, coff, head_dim, "sm_90a")
    bulk = None if bulk_sched is None else ("bulk", bulk_sched)
    inputs = meta_forward_inputs(ratio, coff, head_dim)
    seen = set()
    for rows in (1, 4000, 10 ** 6):
        out = torch.empty(rows, head_dim, device="meta")
        fn, args = dispatch.forward_call("own", sched, 1, bulk, None, 132, None, *inputs, out)
        assert args[:6] == inputs + (out,)
        per_cta = sch.bulk_forward_walk(rows, bulk_sched)
        if per_cta:
            assert (fn, args[6:]) == ("bulk", (per_cta,))
            seen.add("bulk")
        elif sched.family == "stream":
            rpc = sch.fwd_rows_per_cta(rows, sched, 1, 132)
            assert (fn, args[6:]) == ("own", (rpc, int(sch.fwd_interleaved(rows, 1, coff, rpc))))
            seen.add("stream")
        else:
            assert (fn, args[6:]) == ("own", ())
            seen.add("window")
    assert seen == routes


@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 2, 128), (24, 2, 256), (16, 2, 256), (4, 2, 128)])
def test_forward_call_takes_the_one_segment_stream_forward(ratio, coff, head_dim):
    """A pipelined stream forward's pack of exactly one segment runs the one-segment kernel with
    its own CTAs per SM (``compile_forward_one_segment``); packs of 0 or 2+ segments, every
    window forward and the online stream forward (r16 c2) run the default kernel."""
    import torch

    from csa_frontend.compressor.kernels import dispatch
    sched = sch.choose_schedule(ratio, coff, head_dim, "fwd")
    one = ("one", sched, 3)
    rows = 4000  # r16: 31 rows per CTA at 1 CTA per SM, 16 at 3
    out = torch.empty(rows, head_dim, device="meta")
    for n_seg in (0, 1, 2, 7):
        inputs = meta_forward_inputs(ratio, coff, head_dim, n_seg)
        fn, args = dispatch.forward_call("own", sched, 1, None, None, 132, one, *inputs, out)
        if sched.family != "stream" or sched.online:
            assert (fn, args) == ("own", inputs + (out,))
        else:
            rpc = sch.fwd_rows_per_cta(rows, sched, 3 if n_seg == 1 else 1, 132)
            walk = int(sch.fwd_interleaved(rows, n_seg, coff, rpc))
            assert (fn, args[6:]) == ("one" if n_seg == 1 else "own", (rpc, walk))


def test_serial_forward_takes_small_launches(monkeypatch):
    """The serial forward serves every configuration and takes a launch exactly when its output
    has at most ``serial_forward_outputs`` of its family's forward elements: SERIAL_FWD_MAX_OUTPUTS
    for the register window, below 8192 for the stream family; 0 turns it off for both."""
    assert sch.serial_forward_outputs("window") == sch.SERIAL_FWD_MAX_OUTPUTS == 4096
    assert sch.serial_forward_outputs("stream") == 8191
    for ratio, coff, head_dim in [(1, 1, 1), (4, 2, 128), (128, 2, 4096), (256, 2, 65), (33, 1, 66), (128, 2, 128)]:
        s = sch.serial_forward_schedule(ratio, coff, head_dim)
        assert s.family == "serial" and s.vec == 1 and s.col_threads * s.col_tiles >= head_dim > (
            s.col_tiles - 1) * s.col_threads
        family = sch.choose_schedule(ratio, coff, head_dim, "fwd").family
        limit = sch.serial_forward_outputs(family)
        rows = limit // head_dim
        if rows:
            assert sch.takes_serial_forward(rows, head_dim, s, family)
        assert not sch.takes_serial_forward(rows + 1, head_dim, s, family)
        assert not sch.takes_serial_forward(limit + 1, 1, s, family)
        assert not sch.takes_serial_forward(rows, head_dim, None, family)
    # the SPEC's smallest ratio-128 row (64 rows of 128) stays on the stream forward
    r128 = sch.serial_forward_schedule(128, 2, 128)
    assert sch.takes_serial_forward(63, 128, r128, "stream") and not sch.takes_serial_forward(64, 128, r128, "stream")
    monkeypatch.setattr(sch, "SERIAL_FWD_MAX_OUTPUTS", 0)
    assert sch.serial_forward_schedule(4, 2, 128) is None
    assert sch.serial_forward_outputs("stream") == sch.serial_forward_outputs("window") == 0


@pytest.mark.parametrize("ratio,coff,head_dim", [(2, 2, 512), (4, 2, 128), (128, 2, 128)])
def test_forward_call_takes_serial_below_the_limit(bulk_cache, ratio, coff, head_dim):
    """``dispatch.forward_call`` runs the serial kernel (no trailing argument) for launches of at
    most ``serial_forward_outputs`` elements of the family and the family's route above."""
    import torch

    from csa_frontend.compressor.kernels import dispatch
    sched = sch.choose_schedule(ratio, coff, head_dim, "fwd")
    bulk_sched = sch.bulk_forward_schedule(ratio, coff, head_dim, "sm_90a")
    bulk = None if bulk_sched is None else ("bulk", bulk_sched)
    serial = ("serial", sch.serial_forward_schedule(ratio, coff, head_dim))
    inputs = meta_forward_inputs(ratio, coff, head_dim)
    edge = sch.serial_forward_outputs(sched.family) // head_dim
    for rows in (1, edge, edge + 1, 10 ** 6):
        out = torch.empty(rows, head_dim, device="meta")
        fn, args = dispatch.forward_call("own", sched, 1, bulk, serial, 132, None, *inputs, out)
        with_serial_off = dispatch.forward_call("own", sched, 1, bulk, None, 132, None, *inputs, out)
        if rows <= edge:
            assert (fn, args) == ("serial", inputs + (out,))
        else:
            assert fn != "serial" and (fn, args) == with_serial_off


@pytest.mark.L0
def test_online_forward_serves_short_stream_windows(online_forward, monkeypatch):
    """With the online forward on, the stream forward walks windows of at most
    ``STREAM_FWD_ONLINE_WINDOW`` positions per thread (``online``, in chunks of
    ``STREAM_FWD_ONLINE_CHUNK`` positions); longer windows, the backward and the register-window family
    keep theirs; a window limit of 0 turns it off, and head dims past
    ``STREAM_FWD_ONLINE_MAX_HEAD_DIM`` keep the pipeline."""
    for ratio in range(1, 257):
        for coff in (1, 2):
            for head_dim in (3, 64, 130, 512):
                for direction in ("fwd", "bwd"):
                    s = sch.choose_schedule(ratio, coff, head_dim, direction)
                    short = coff * ratio <= sch.STREAM_FWD_ONLINE_WINDOW
                    want = s.family == "stream" and direction == "fwd" and short
                    assert s.online == want, (ratio, coff, head_dim, direction, s)
                    assert not want or s.chunk == sch.STREAM_FWD_ONLINE_CHUNK
    assert sch.choose_schedule(16, 2, 256, "fwd").online
    monkeypatch.setattr(sch, "STREAM_FWD_ONLINE_WINDOW", 0)
    assert not sch._stream_schedule(16, 2, 256, 4, "fwd").online
    monkeypatch.setattr(sch, "STREAM_FWD_ONLINE_WINDOW", 32)
    monkeypatch.setattr(sch, "STREAM_FWD_ONLINE_MAX_HEAD_DIM", 256)
    assert sch._stream_schedule(8, 2, 256, 4, "fwd").online and not sch._stream_schedule(8, 2, 257, 4, "fwd").online


@pytest.mark.L0
def test_online_forward_is_on_by_default():
    """Unless the environment says otherwise, stream forwards of windows up to the measured limit
    and head dims up to 256 take the online forward; longer windows and wider rows the pipeline."""
    if "CSA_FRONTEND_STREAM_FWD_ONLINE" in os.environ:
        pytest.skip("set by the environment")
    if "CSA_FRONTEND_STREAM_FWD_ONLINE_MAX_HEAD_DIM" in os.environ:
        pytest.skip("set by the environment")
    assert sch.STREAM_FWD_ONLINE_WINDOW == sch.STREAM_FWD_ONLINE_MEASURED_WINDOW == 32
    sch.choose_schedule.cache_clear()
    assert sch.choose_schedule(16, 2, 256, "fwd").online and sch.choose_schedule(32, 1, 128, "fwd").online
    assert sch.choose_schedule(8, 2, 256, "fwd").online
    assert not sch.choose_schedule(17, 2, 256, "fwd").online and not sch.choose_schedule(33, 1, 128, "fwd").online
    # d512 and wider keep the pipeline
    assert sch.choose_schedule(8, 2, 512, "fwd").family == "stream" and not sch.choose_schedule(8, 2, 512, "fwd").online
    assert not sch.choose_schedule(32, 1, 4096, "fwd").online


def test_row_stealing_is_planned_only_where_the_kernel_can_take_it(monkeypatch):
    """``WINDOW_BWD_STEAL``: off by default; set, the window backward's schedule carries it where
    its CTA is whole warps (claims are per warp) at vec >= 2 (the cp.async walk), never the
    forward or the stream family."""
    assert all(sch.choose_schedule(r, c, d, "bwd").steal == 0 for r, c, d in [(4, 2, 512), (4, 1, 128), (1, 2, 16)])
    monkeypatch.setattr(sch, "WINDOW_BWD_STEAL", 2)
    sch.choose_schedule.cache_clear()
    try:
        assert sch.choose_schedule(4, 2, 512, "bwd").steal == 2
        assert sch.choose_schedule(4, 2, 512, "fwd").steal == 0
        assert sch.choose_schedule(3, 2, 65, "bwd").steal == 0  # odd head_dim: vec 1, no cp.async
        odd = sch.choose_schedule(3, 1, 130, "bwd")  # 65 column threads x 3 row lanes: 195 threads
        assert odd.family == "window" and odd.threads % 32 and odd.steal == 0
        assert sch.choose_schedule(128, 2, 512, "bwd").family == "stream"
        assert sch.choose_schedule(128, 2, 512, "bwd").steal == 0
    finally:
        sch.choose_schedule.cache_clear()


def test_row_stealing_room_for_stolen_rows():
    """The slabs' worth of room a stealing backward allocates after its slabs holds every back
    slot's values of every thread (``WindowBackward.parts_view``), and launches past the claim
    word's 16-bit fields are refused with a named error."""
    from csa_frontend.compressor.kernels import dispatch
    sched = dataclasses.replace(sch.choose_schedule(4, 2, 512, "bwd"), steal=2)
    extra = dispatch.stolen_parts_slabs(sched, 256, 4, 2, 512)
    values = sched.col_tiles * 256 * 2 * (4 * 2 * sched.vec) * sched.threads
    assert extra * 4 * 2 * 512 >= values > (extra - 1) * 4 * 2 * 512
    with pytest.raises(RuntimeError, match="row stealing"):
        dispatch.steal_workspace(torch.device("cpu"), sched, 1 << 16, 4)
    with pytest.raises(RuntimeError, match="row stealing"):
        dispatch.steal_workspace(torch.device("cpu"), sched, 4, 1 << 15)
