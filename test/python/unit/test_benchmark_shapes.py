"""The benchmark tools on CPU: the ``--shapes`` items (indices into its SHAPES table or explicit
shapes), the tail probe's reduction swap, the rotated copies, the ptxas report parser, the
stream-grid A/B's variants, the size sweep's fit, the targets check, the contract-risk model,
the profiling driver's shape check, the SM-layout probe's analysis and the CTA-clock summary."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmark", "csa"))
import bench_csa_compressor as bench  # noqa: E402
import window_registers  # noqa: E402


@pytest.mark.L0
def test_index_and_explicit_shapes():
    assert bench.parse_shape("3") == bench.SHAPES[3]
    assert bench.parse_shape("1x16384x4x2x512") == (1, 16384, 4, 2, 512)
    assert bench.shape_name(bench.parse_shape("64x1000x4x2x128")) == "64x1000 r4 c2 d128"


@pytest.mark.L0
def test_named_shape_sets():
    assert bench.select_shapes("all") == bench.SHAPES
    assert all(s[2] <= 8 for s in bench.select_shapes("r4")) and (3, 8192, 4, 2, 512) in bench.select_shapes("r4")
    families = bench.select_shapes("families")
    # both sides of each family boundary the planner draws (NOTES row 89)
    sides = {(1, 32768, 4, 2, 512), (1, 32768, 8, 2, 512), (1, 32768, 12, 1, 512), (1, 32768, 13, 1, 512)}
    assert sides <= set(families)
    assert (1, 16384, 48, 2, 256) in bench.select_shapes("midratio")
    assert bench.select_shapes("3,1x16384x4x2x512") == [bench.SHAPES[3], (1, 16384, 4, 2, 512)]


@pytest.mark.L0
@pytest.mark.parametrize("item", ["1x2x3", "1x2x3x4x5x6"])
def test_malformed_shape_names_the_item(item):
    with pytest.raises(SystemExit, match=item):
        bench.parse_shape(item)


@pytest.mark.L0
def test_report_shows_the_same_bytes_copy_only_when_measured():
    import report

    row = {"shape": "1x8192 r4 c2 d128", "fwd_floor_us": 2.0, "fwd_fused_us": 4.0, "fwd_fused_pct_floor": 50.0,
           "bwd_floor_us": 4.0, "bwd_fused_us": 8.0, "bwd_fused_pct_floor": 50.0}
    without = report.table({"results": [row]}).splitlines()[-1]
    with_copy = report.table({"results": [dict(row, fwd_copy_us=2.5, fwd_copy_pct_floor=80.0, bwd_copy_us=5.0,
                                               bwd_copy_pct_floor=80.0)]}).splitlines()[-1]
    assert "| - | 5.4/13.4 |" in without
    assert "| 2.5/5.0 (80%/80%) | 5.4/13.4 |" in with_copy


@pytest.mark.L0
def test_tail_probe_skips_only_the_reductions():
    """probe_ape_tail.py times the backward with both schedules' slab reductions swapped for
    no-ops: the main kernels and schedules must be the dispatcher's own."""
    import probe_ape_tail as probe

    main, sched, per_sm, few = object(), object(), 2, (object(), object(), object(), 3)
    got = probe.without_reduction(main, object(), sched, per_sm, few)
    assert got[0] is main and got[2] is sched and got[3] == per_sm and got[1] is probe.no_op
    assert got[4][0] is few[0] and got[4][2] is few[2] and got[4][3] == few[3] and got[4][1] is probe.no_op
    assert probe.without_reduction(main, object(), sched, per_sm, None)[4] is None


@pytest.mark.L0
def test_stream_grid_ab_variants(monkeypatch):
    """stream_grid_ab.py's variants set the planner's grid sizing, and ``wave`` is the default."""
    import stream_grid_ab as ab
    from csa_frontend.compressor.kernels import schedule

    monkeypatch.setattr(schedule, "STREAM_RESIDENT", dict(schedule.STREAM_RESIDENT))
    monkeypatch.setattr(schedule, "STREAM_GRID_SMS", schedule.STREAM_GRID_SMS)
    monkeypatch.setattr(schedule, "STREAM_SHARED_RESIDENT", schedule.STREAM_SHARED_RESIDENT)
    default = (dict(schedule.STREAM_RESIDENT), schedule.STREAM_GRID_SMS)
    ab.apply_variant("shared")
    assert schedule.STREAM_SHARED_RESIDENT is True and schedule.STREAM_RESIDENT == {"fwd": 1, "bwd": 1}
    ab.apply_variant("targets")
    assert schedule.STREAM_RESIDENT == {"fwd": 0, "bwd": 0}
    monkeypatch.setattr(schedule, "STREAM_FWD_GRID_SMS", schedule.STREAM_FWD_GRID_SMS)
    monkeypatch.setattr(schedule, "STREAM_BWD_LONG_GRID_SMS", schedule.STREAM_BWD_LONG_GRID_SMS)
    ab.apply_variant("sms132")
    assert schedule.STREAM_RESIDENT == {"fwd": 1, "bwd": 1} and schedule.STREAM_GRID_SMS == 132
    assert schedule.STREAM_FWD_GRID_SMS == 132
    assert schedule.STREAM_BWD_LONG_GRID_SMS == 0  # every backward launch on the variant's SMs
    monkeypatch.setattr(ab.dispatch, "fwd_rows_per_cta", ab.dispatch.fwd_rows_per_cta)
    sched = schedule.choose_schedule(128, 1, 128, "fwd")
    wave_rpc = ab.FWD_ROWS_PER_CTA(1000, sched, 2)
    ab.apply_variant("rpc+2")
    assert ab.dispatch.fwd_rows_per_cta(1000, sched, 2) == wave_rpc + 2
    assert ab.dispatch.fwd_rows_per_cta(1000, sched, 2, 132) == ab.FWD_ROWS_PER_CTA(1000, sched, 2, 132) + 2
    ab.apply_variant("rpc-100")
    assert ab.dispatch.fwd_rows_per_cta(1000, sched, 2) == 1
    ab.apply_variant("wave")
    assert (schedule.STREAM_RESIDENT, schedule.STREAM_GRID_SMS) == default
    assert schedule.STREAM_SHARED_RESIDENT is ab.SHARED and schedule.STREAM_FWD_GRID_SMS == ab.FWD_GRID_SMS
    assert schedule.STREAM_BWD_LONG_GRID_SMS == ab.LONG_GRID_SMS
    assert ab.dispatch.fwd_rows_per_cta is ab.FWD_ROWS_PER_CTA


@pytest.mark.L0
def test_rotated_copies_exceed_the_l2():
    """Small shapes rotate over up to 8 input sets so a call never finds its inputs in the L2;
    shapes whose one set is 3x the L2 take one."""
    assert bench.rotated_copies((1, 8192, 128, 2, 128)) == 8
    assert bench.rotated_copies((1, 65536, 64, 1, 512)) == 1
    for shape in bench.SHAPES:
        seg, seqlen, ratio, coff, d = shape
        per_set = bench.traffic_bytes(seg * seqlen, seg * seqlen // ratio, coff, d, "bwd")
        copies = bench.rotated_copies(shape)
        assert copies == 8 or copies * per_set >= 3 * bench.L2_BYTES


@pytest.mark.L0
def test_window_registers_reads_ptxas():
    verbose = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
               "ptxas info    : Function properties for k\n"
               "    0 bytes stack frame, 12 bytes spill stores, 20 bytes spill loads\n"
               "ptxas info    : Used 255 registers, used 1 barriers\n")
    assert window_registers.parse_ptxas(verbose) == {"registers": 255, "spill_bytes": 32}


@pytest.mark.L0
def test_size_sweep_fits_fixed_cost_and_rate():
    """size_sweep.py splits a series of times into a per-call cost and a streaming rate."""
    import size_sweep

    nbytes = [52e6, 104e6, 208e6, 416e6]
    times = [3.0 + b / 4.2e6 for b in nbytes]  # 3 us per call + bytes at 4.2 TB/s (4.2e6 bytes per us)
    fixed, rate = size_sweep.fit_line(nbytes, times)
    assert fixed == pytest.approx(3.0) and rate == pytest.approx(4.2)
    fixed, rate = size_sweep.fit_line([1e6, 2e6], [5.0, 5.0])
    assert fixed == pytest.approx(5.0) and rate == float("inf")
    with pytest.raises(ValueError, match="two or more distinct sizes"):
        size_sweep.fit_line([1e6, 1e6], [1.0, 2.0])
    assert size_sweep.parse_config("4x2x512") == (4, 2, 512)
    with pytest.raises(SystemExit, match="4x2"):
        size_sweep.parse_config("4x2")


@pytest.mark.L0
def test_targets_against_spec_floor():
    """targets.py checks a run against SPEC's floor (4.29 TB/s) and the issues' criteria; the
    floors it computes are SPEC section 6's own figures."""
    import targets

    def row(shape, fwd, bwd):
        seg, seqlen, ratio, _, _ = targets.parse_name(shape)
        return {"shape": shape, "tokens": seg * seqlen, "rows": seg * (seqlen // ratio),
                "fwd_fused_us": fwd, "bwd_fused_us": bwd}

    entries = {(e["shape"], e["direction"]): e for e in targets.check({"results": [
        row("3x8192 r4 c2 d512", 28.9, 64.7), row("1x8192 r128 c2 d128", 5.3, 9.0),
        row("4x8192 r16 c2 d256", 19.0, 42.3), row("3x8192 r4 c1 d512", 16.3, 34.6)]})}
    big_fwd = entries[("3x8192 r4 c2 d512", "fwd")]
    assert big_fwd["spec_floor_us"] == pytest.approx(24.9, abs=0.05)  # SPEC section 6's figure
    assert all(ok for ok, _ in big_fwd["criteria"].values())
    ok, limit = entries[("3x8192 r4 c2 d512", "bwd")]["criteria"]["85% of floor"]
    assert not ok and limit == pytest.approx(48.4 / 0.85, abs=0.1)
    small = entries[("1x8192 r128 c2 d128", "bwd")]["criteria"]
    assert set(small) == {"faster than best known", "1.5x best known"} and small["1.5x best known"][0]
    assert set(entries[("4x8192 r16 c2 d256", "fwd")]["criteria"]) == {"80% of floor"}
    assert "85% of floor" not in entries[("3x8192 r4 c1 d512", "fwd")]["criteria"]  # 56.6 MB
    assert "MISSED: 80% of floor needs <= 39.4" in targets.render(list(entries.values()))
    with_copy = dict(row("3x8192 r4 c2 d512", 28.9, 64.7), bwd_copy_us=51.5, fwd_copy_us=28.2)
    lines = targets.render(targets.check({"results": [with_copy]})).splitlines()
    assert lines[0].endswith(" met")  # a met target shows no copy
    assert lines[1].endswith("needs <= 56.9 (same-bytes copy 51.5)")
    # a miss that one decimal would print as equal to its limit gets two, so the two differ on the page
    near = targets.render(targets.check({"results": [row("4x8192 r16 c2 d256", 19.87, 42.3)]})).splitlines()
    assert " 19.87 us " in near[0] and near[0].endswith("needs <= 19.86")
    assert " 42.3 us " in near[1] and near[1].endswith("needs <= 39.4")


@pytest.mark.L0
def test_contract_risk_model():
    """The differing-element allowance steps at multiples of 1000, the Poisson chance is a
    probability that grows with the rate, and the stream family's serial-forward limit (8191
    outputs) is where the worst chance beyond it falls under 0.25% at the worst measured rate."""
    import contract_risk as risk
    from csa_frontend.compressor.kernels import schedule

    assert [risk.allowance(n) for n in (1, 999, 1999, 2000, 8191, 8192)] == [1, 1, 1, 2, 8, 8]
    assert 0.0 <= risk.exceed_chance(5000, 1e-4) < risk.exceed_chance(5000, 3.1e-4) < 1.0
    limit = schedule.STREAM_SERIAL_FWD_MAX_OUTPUTS
    beyond, _ = risk.worst_in(limit + 1, 4 * (limit + 1), 3.1e-4)
    below, at = risk.worst_in(schedule.SERIAL_FWD_MAX_OUTPUTS + 1, limit, 3.1e-4)
    assert beyond < 2.5e-3 < below and at == 4999


@pytest.mark.L0
def test_forward_doubt_model():
    """The checked-forward model of NOTES row 128: its reference sums left to right, the fast
    value rarely rounds differently, and a worst-case bound puts far more elements in doubt
    at a wide window than at a narrow one (the row's conclusion)."""
    import torch

    import model_fwd_doubt as doubt

    x = torch.tensor([[1.0, 2.0 ** -24, 2.0 ** -24]])
    assert doubt.in_order_sum(x).item() == 1.0  # left to right: each tiny term rounds away
    gen = torch.Generator().manual_seed(0)
    narrow = doubt.model(8, 4096, 8, gen)
    wide = doubt.model(256, 4096, 16, gen)
    for flips, in_doubt, _ in (narrow, wide):
        assert 0.0 <= flips < 1e-2 and flips <= in_doubt
    assert wide[1] > 0.1 > 10 * narrow[1]


@pytest.mark.L0
def test_sass_budget_counts_instructions_per_barrier_region():
    """``sass_budget.sass_regions``: opcodes without modifiers or predicates, regions closed by
    each BAR (the barrier counts in the region it ends), labels and comments ignored."""
    import sass_budget

    sass = """
        .text.kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 LDG.E.U16 R20, desc[UR6][R8.64+0x10100] ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
    .L_x_3:
        /*0030*/               @P2 BRA `(.L_x_3) ;
        /*0040*/                   FADD R20, R19, R20 ;
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0060*/                   EXIT ;
    """
    ops, regions = sass_budget.sass_regions(sass)
    assert regions == [3, 3, 1]
    assert ops == {"LDC": 1, "LDG": 1, "BAR": 2, "BRA": 1, "FADD": 1, "EXIT": 1}


@pytest.mark.L0
def test_profile_calls_rejects_a_malformed_shape_before_any_launch(monkeypatch):
    """profile_calls.py (the driver ncu profiles) parses its one shape like ``--shapes`` does,
    so a malformed one stops it before it makes inputs or compiles anything."""
    import profile_calls
    monkeypatch.setattr(sys, "argv", ["profile_calls.py", "--shape", "3x8192x4"])
    with pytest.raises(SystemExit, match="3x8192x4"):
        profile_calls.main()


@pytest.mark.L0
def test_sm_layout_probe_analysis():
    """probe_sm_layout.py: the first wave counts CTAs started together (across a timer wrap), SMs
    that ran one cluster join one group, and CTA durations are summarised per group."""
    import probe_sm_layout as probe

    wrap = probe.TIMER_WRAP
    assert probe.timer_delta(5, wrap - 5) == 10 and probe.timer_delta(wrap - 5, 5) == -10
    assert probe.first_wave([wrap - 1000, 500, 250_000, 10_000]) == 3
    assert probe.first_wave([]) == 0
    launches = [[(0, 0), (1, 0), (2, 1), (3, 1)], [(1, 7), (2, 7), (5, 9)]]
    assert probe.co_located_groups(6, launches) == [[0, 1, 2, 3], [4], [5]]
    records = [(0, 0, 2000), (1, 100, 4100), (4, 0, 1000), (9, wrap - 500, 1500)]
    assert probe.durations_by_group(records, [[0, 1], [4]]) == [(-1, 1, 2.0, 2.0), (0, 2, 3.0, 4.0), (1, 1, 1.0, 1.0)]


@pytest.mark.L0
def test_cta_clocks_groups_launches_and_finds_the_slow_ctas():
    """cta_clocks.py: records split into launches where a CTA repeats, the slowest tenth named
    with the other CTA on its SM, its overlap with the launch before counted, and CTA times by
    placement on the SM and by block-index band."""
    import cta_clocks

    lines = ["noise", "cta_clock 1 0 7 1000 41000", "cta_clock 0 0 7 1200 31200", "cta_clock 2 0 9 900 30900"]
    lines += ["cta_clock 0 0 7 500000 530000", "cta_clock 1 0 9 500000 560000", "cta_clock 2 0 9 500050 520050"]
    clocks = cta_clocks.parse(lines)
    assert len(clocks) == 6 and clocks[0] == cta_clocks.Clock(1, 0, 7, 1000, 41000) and clocks[0].us == 40.0
    first, second = cta_clocks.launches(clocks)
    assert [c.bx for c in first] == [2, 1, 0] and [c.bx for c in second] == [0, 1, 2]
    # a second wave starting long after the first stays in its launch; a repeated CTA starts the next
    waves = cta_clocks.parse(["cta_clock 0 0 1 0 30000", "cta_clock 1 0 1 90000 99000",
                              "cta_clock 0 0 1 99500 130000"])
    assert [[c.bx for c in launch] for launch in cta_clocks.launches(waves)] == [[0, 1], [0]]
    assert cta_clocks.slowest(first) == [clocks[0]]
    text = "\n".join(cta_clocks.report(second, first))
    assert "slow: bx 1 by 0 on SM 9: 60.0 us (same SM: 20.0)" in text
    assert "shared with the launch before: 1 of 1 CTAs, 0 of 1 SMs" in text
    assert "SM finished at us: first 30.0, median 45.0, last 60.0" in text
    # first launch: CTA 2 alone on SM 9; on SM 7 bx 0 (30 us) is the pair's lower index, bx 1 (40) the higher
    placed = "\n".join(cta_clocks.placement(first, bands=2))
    assert "alone 30.0 (1), pair's lower bx 30.0, higher bx 40.0 (1 pairs)" in placed
    assert "by bx band: 0-1: 35.0, 2-2: 30.0" in placed
