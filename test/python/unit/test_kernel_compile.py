"""Every shipped kernel variant compiles for sm_90a, sm_100a and sm_80 on a CPU-only machine.

The configurations are picked to reach each code path: register window with vec 8/4/2/1,
the serial forward of small launches (every configuration),
coff 1/2, several column tiles; stream family with the threads < columns combine, ragged
last chunks and vec 4/2/1; the deterministic backward with its slab reduction and the atomic
one. A kernel that stops compiling fails CI before anyone reaches a GPU.
"""
import re
import warnings

import pytest

pytest.importorskip("cutlass")

from cutlass.base_dsl.ast_helpers import DSLOptimizationWarning  # noqa: E402

from csa_frontend.compressor.kernels import dispatch  # noqa: E402
from csa_frontend.compressor.kernels.schedule import (  # noqa: E402
    LOOKUP_ONE_ROUND, bulk_forward_schedule, choose_schedule, few_rows_schedule, row_bucket_schedule,
    serial_forward_schedule, wide_rows_schedule)

CONFIGS = [  # (ratio, coff, head_dim)
    (4, 2, 128), (4, 1, 512), (1, 2, 64), (3, 2, 65), (4, 2, 4096), (8, 2, 128),
    (16, 2, 256), (128, 2, 512), (256, 2, 65), (200, 2, 192), (33, 1, 66), (4, 2, 512), (2, 2, 1024), (4, 2, 2),
    (16, 1, 128),  # the longest forward window in registers (16 positions at vec 2); its backward streams
    (37, 2, 128),  # a 320-thread coff-2 stream backward, compiled with the interleaved walk
    (15, 2, 256),  # a 256-thread coff-2 stream backward, compiled with the interleaved walk
]
ARCHS = ["sm_90a", "sm_100a", "sm_80"]


def compile_all(ratio, coff, head_dim, arch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DSLOptimizationWarning)
        fwd, fwd_sched, _ = dispatch.compile_forward(ratio=ratio, coff=coff, head_dim=head_dim, arch=arch)
        main, reduce, bwd_sched, _ = dispatch.compile_backward(ratio=ratio, coff=coff, head_dim=head_dim, arch=arch)
        atomic, no_reduce, _, _ = dispatch.compile_backward(ratio=ratio, coff=coff, head_dim=head_dim, arch=arch,
                                                         deterministic=False)
    # the DSL warns of trace-time loops long enough to make compiles slow (seconds per kernel)
    slow = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if issubclass(w.category, DSLOptimizationWarning)]
    assert not slow, slow
    assert fwd is not None and main is not None and reduce is not None and atomic is not None
    assert no_reduce is None
    assert fwd_sched == choose_schedule(ratio, coff, head_dim, "fwd")
    assert bwd_sched == choose_schedule(ratio, coff, head_dim, "bwd")
    # the row-count bucket's kernels were compiled with them (a small or long pack never
    # compiles later)
    bucket = row_bucket_schedule(ratio, coff, head_dim)
    for direction in ("bwd", "bwd_atomic"):
        assert ((direction, arch, ratio, coff, head_dim, bucket) in dispatch.cache_keys()) == (bucket is not None)
    # and the bulk-copy forward with the forward (sm_90+ only)
    bulk = bulk_forward_schedule(ratio, coff, head_dim, arch)
    assert (("fwd", arch, ratio, coff, head_dim, bulk) in dispatch.cache_keys()) == (bulk is not None)
    assert bulk is None or arch != "sm_80"
    # and the serial forward of small launches, for every configuration
    serial = serial_forward_schedule(ratio, coff, head_dim)
    assert serial is not None and ("fwd", arch, ratio, coff, head_dim, serial) in dispatch.cache_keys()
    # and the stream forward of one-segment packs (its lookup by the search)
    one_segment = ("fwd_one_segment", arch, ratio, coff, head_dim, fwd_sched) in dispatch.cache_keys()
    assert one_segment == (fwd_sched.family == "stream" and not fwd_sched.online and LOOKUP_ONE_ROUND["stream_fwd"] > 0)


@pytest.mark.L0
def test_bulk_forward_is_covered():
    for arch in ("sm_90a", "sm_100a"):
        assert any(bulk_forward_schedule(*c, arch) is not None for c in CONFIGS)


@pytest.mark.L0
def test_families_are_covered():
    assert any(few_rows_schedule(*c) is not None for c in CONFIGS)
    assert any(wide_rows_schedule(*c) is not None for c in CONFIGS)
    families = {(choose_schedule(*c, d).family, d) for c in CONFIGS for d in ("fwd", "bwd")}
    assert families == {("window", "fwd"), ("window", "bwd"), ("stream", "fwd"), ("stream", "bwd")}
    vecs = {choose_schedule(*c, "fwd").vec for c in CONFIGS} | {choose_schedule(*c, "bwd").vec for c in CONFIGS}
    assert {1, 2, 4, 8} <= vecs


@pytest.mark.L0
def test_compiles_sm90a_smoke():
    compile_all(4, 2, 128, "sm_90a")


@pytest.mark.L1
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ratio,coff,head_dim", CONFIGS)
def test_compiles(ratio, coff, head_dim, arch):
    compile_all(ratio, coff, head_dim, arch)


@pytest.mark.L1
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ratio,coff,head_dim", [(16, 2, 256), (9, 2, 3), (32, 1, 4096)])
def test_compiles_with_the_online_forward(online_forward, ratio, coff, head_dim, arch):
    """The online stream forward compiles with the rest, on every arch, also past its default
    head-dim limit (the fixture lifts it: d4096)."""
    assert choose_schedule(ratio, coff, head_dim, "fwd").online
    compile_all(ratio, coff, head_dim, arch)


@pytest.mark.L1
def test_cache_is_keyed_on_static_configuration():
    before = set(dispatch.cache_keys())
    compile_all(5, 1, 40, "sm_90a")
    added = set(dispatch.cache_keys()) - before
    # the forward, its serial variant for small launches, and the two backwards
    assert sorted(k[0] for k in added) == ["bwd", "bwd_atomic", "fwd", "fwd"]
    assert {k[-1].family for k in added if k[0] == "fwd"} == {"window", "serial"}
    compile_all(5, 1, 40, "sm_90a")  # same configuration: nothing new
    assert set(dispatch.cache_keys()) - before == added


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim,falls_back", [(16, 2, 256, True), (64, 1, 512, False)])
def test_atomic_backward_compiles_its_fallback(monkeypatch, ratio, coff, head_dim, falls_back):
    """compile_backward(deterministic=False) brings the deterministic kernels (default and
    few-rows) along exactly where a launch may have too many row groups to add grad_ape
    atomically (``schedule.atomic_ape_pays``), so CUDA-graph capture never compiles them."""
    import collections
    monkeypatch.setattr(dispatch, "_cache", collections.OrderedDict())
    dispatch.compile_backward(ratio=ratio, coff=coff, head_dim=head_dim, arch="sm_90a", deterministic=False)
    kinds = sorted(k[0] for k in dispatch.cache_keys() if k[2:5] == (ratio, coff, head_dim))
    variants = 1 + (row_bucket_schedule(ratio, coff, head_dim) is not None)
    assert kinds == (["bwd"] * variants if falls_back else []) + ["bwd_atomic"] * variants


@pytest.mark.L0
def test_direct_entry_only_replaces_a_plain_positional_function():
    """The launch path calls the positional TVM-FFI function under a compiled kernel's keyword
    wrapper, and keeps the wrapper whenever that function is absent (no CUDA driver) or the
    wrapper converts arguments (raw pointer slots). The GPU suite checks the real kernels."""
    from types import SimpleNamespace

    def compiled(inner, pointer_slots=False):
        return SimpleNamespace(__tvm_ffi_object__=lambda: inner,
                               execution_args=SimpleNamespace(has_pointer_address_arg_specs=pointer_slots))

    inner = lambda *args: args  # noqa: E731
    assert dispatch._direct_entry(compiled(inner)) is inner
    for kept in (compiled(None), compiled(inner, pointer_slots=True), SimpleNamespace(), inner):
        assert dispatch._direct_entry(kept) is kept


SWEEP_RATIOS = [5, 9, 17, 33, 64, 100, 129, 200, 256]
SWEEP_HEAD_DIMS = [64, 65, 66, 192, 4096]


@pytest.mark.L1
@pytest.mark.parametrize("head_dim", SWEEP_HEAD_DIMS)
@pytest.mark.parametrize("coff", [1, 2])
@pytest.mark.parametrize("ratio", SWEEP_RATIOS)
def test_planner_schedules_compile_for_sm90a(ratio, coff, head_dim):
    """The planner's schedules across window widths (chunks dividing the ratio or not, 256- and
    512-thread forward CTAs, padded chunk counts) and head dims (vec 4/2/1, 128 column tiles):
    each compiles for sm_90a, forward and both backwards."""
    compile_all(ratio, coff, head_dim, "sm_90a")


@pytest.mark.L0
@pytest.mark.parametrize("arch,pdl", [("sm_80", False), ("sm_90a", True), ("sm_100a", True), (None, False)])
def test_programmatic_dependent_launch_only_from_sm90(arch, pdl):
    """griddepcontrol needs sm_90+: older or unnamed targets get plain launches (the sm_80
    compiles in test_compiles would fail in ptxas otherwise)."""
    assert dispatch.uses_pdl(arch) == (pdl and dispatch.PDL)


def kernel_ptx(build, monkeypatch, tmp_path):
    """PTX of every kernel one ``dispatch._build_*`` call compiles (the DSL also writes it to a
    file, hence ``tmp_path``)."""
    options = dispatch._options
    monkeypatch.setattr(dispatch, "_options",
                        lambda arch, cubin_dir=None: f"{options(arch, cubin_dir)} --keep-ptx --dump-dir={tmp_path}")
    return [str(fn.artifacts.PTX) for fn in build() if fn is not None and hasattr(fn, "artifacts")]


def main_kernel_ptx(build, ratio, coff, head_dim, sched, monkeypatch, tmp_path):
    """PTX of the main kernel alone of one ``dispatch._build_forward``/``_build_backward`` call
    for sm_90a (the first kernel it compiles)."""
    texts = kernel_ptx(lambda: build(ratio, coff, head_dim, sched, "sm_90a")[:1], monkeypatch, tmp_path)
    assert len(texts) == 1
    return texts[0]


def planned_kernel_ptx(ratio, coff, head_dim, direction, monkeypatch, tmp_path):
    """``main_kernel_ptx`` of the planner's default schedule for ``direction``."""
    build = dispatch._build_backward if direction == "bwd" else dispatch._build_forward
    sched = choose_schedule(ratio, coff, head_dim, direction)
    return main_kernel_ptx(build, ratio, coff, head_dim, sched, monkeypatch, tmp_path)


def entries(ptx):
    """(name, body) of each kernel entry in a PTX text."""
    parts = re.split(r"\.visible \.entry ", ptx)[1:]
    return [(part.split("(", 1)[0], part) for part in parts]


FIRST_GLOBAL_ACCESS = re.compile(r"\b(ld\.global|st\.global|cp\.async|atom\.global|red\.global)")


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 128), (4, 1, 512), (128, 2, 512), (16, 2, 256),
                                               (2, 2, 512)])
def test_dependent_launches_wait_before_touching_memory(ratio, coff, head_dim, monkeypatch, tmp_path):
    """Every kernel is launched as a programmatic dependent on sm_90+, so it may start while the
    previous grid on the stream still runs: each must wait (``griddepcontrol.wait``) before its
    first global load, store or copy, or it would read stale inputs. Checked on the PTX of the
    forward (and the bulk-copy forward, where there is one), the backward and the slab reduction
    of both families."""
    if not dispatch.PDL:
        pytest.skip("CSA_FRONTEND_PDL=0: plain launches")
    fwd_sched = choose_schedule(ratio, coff, head_dim, "fwd")
    bwd_sched = choose_schedule(ratio, coff, head_dim, "bwd")
    bulk = bulk_forward_schedule(ratio, coff, head_dim, "sm_90a")
    ptx = kernel_ptx(lambda: dispatch._build_forward(ratio, coff, head_dim, fwd_sched, "sm_90a")[:1]
                     + (dispatch._build_forward(ratio, coff, head_dim, bulk, "sm_90a")[:1] if bulk else ())
                     + dispatch._build_backward(ratio, coff, head_dim, bwd_sched, "sm_90a")[:2],
                     monkeypatch, tmp_path)
    kernels = [entry for text in ptx for entry in entries(text)]
    assert len(kernels) == 3 + (bulk is not None), [name for name, _ in kernels]
    for name, body in kernels:
        wait = body.find("griddepcontrol.wait")
        first = FIRST_GLOBAL_ACCESS.search(body)
        assert wait >= 0, f"{name}: no griddepcontrol.wait"
        assert first is not None and wait < first.start(), f"{name}: global access before the wait"


@pytest.mark.L1
def test_no_dependent_launch_before_sm90(monkeypatch, tmp_path):
    sched = choose_schedule(4, 2, 128, "bwd")
    ptx = kernel_ptx(lambda: dispatch._build_backward(4, 2, 128, sched, "sm_80")[:2], monkeypatch, tmp_path)
    assert ptx and not any("griddepcontrol" in text for text in ptx)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 128), (4, 1, 512)])
def test_window_backward_pipeline_depth_knob_compiles(ratio, coff, head_dim, monkeypatch):
    """CSA_FRONTEND_WINDOW_BWD_STAGES beyond the default 2 (a tuning knob: the staging ring and
    the cp.async waits follow the stage count) still compiles; built uncached, as the cache key
    does not carry the knob (it is read once at import)."""
    from csa_frontend.compressor.kernels import schedule
    monkeypatch.setitem(schedule.WINDOW_BWD_STAGES, f"c{coff}", 3)
    sched = choose_schedule(ratio, coff, head_dim, "bwd")
    assert sched.family == "window"
    main, reduce, *_ = dispatch._build_backward(ratio, coff, head_dim, sched, "sm_90a")
    assert main is not None and reduce is not None


@pytest.mark.L1
def test_column_cluster_knob_changes_the_launch_not_the_kernel(monkeypatch, tmp_path):
    """``CSA_FRONTEND_STREAM_BWD_CLUSTER`` is a launch attribute: the stream backward compiles
    with clusters (the sm_90a default) and without, to the same PTX; sm_80 launches none."""
    from csa_frontend.compressor.kernels import schedule
    sched = choose_schedule(128, 2, 512, "bwd")

    def clustered_then_unclustered():
        assert schedule.bwd_column_cluster(sched, "sm_90a") == 2
        clustered = dispatch._build_backward(128, 2, 512, sched, "sm_90a")[0]
        monkeypatch.setattr(schedule, "STREAM_BWD_COLUMN_CLUSTER", 1)
        return clustered, dispatch._build_backward(128, 2, 512, sched, "sm_90a")[0]

    clustered, unclustered = kernel_ptx(clustered_then_unclustered, monkeypatch, tmp_path)
    assert clustered == unclustered
    from csa_frontend.compressor.kernels.stream_bwd import StreamBackward
    assert StreamBackward(128, 2, 512, sched, column_cluster=2).launch_cluster() == (1, 2, 1)
    assert StreamBackward(128, 2, 512, sched).launch_cluster() is None
    built = []  # the kernel objects dispatch builds per arch (atomic: no reduction compiled)
    monkeypatch.setattr(schedule, "STREAM_BWD_COLUMN_CLUSTER", 2)
    monkeypatch.setattr(dispatch, "_compile_resident", lambda op, *a, arch: (built.append(op), (None, 0))[1])
    for arch, want in (("sm_90a", (1, 2, 1)), ("sm_80", None)):
        dispatch._build_backward(128, 2, 512, sched, arch, atomic=True)
        assert built[-1].launch_cluster() == want


EXACT_RECIPROCAL = re.compile(r"\b(?:rcp|div)\.rn\.f32\b")


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 128), (4, 1, 512), (8, 1, 64)])
def test_exact_reciprocals_where_they_were_measured(ratio, coff, head_dim, monkeypatch, tmp_path):
    """The register-window backward takes each column's ``1 / den`` as ``div.rn``'s inline fast
    path (``rcp_of_den``: one ``rcp.approx.ftz`` per column, no ``rcp.rn`` and its slow-path
    branch), which was 0.5-2% faster on the H200; the forward's exact fallback keeps ``rcp.rn``,
    whose branch keeps that rarely taken path out of the common one (inlined, the r4 forwards
    were 12-16% slower). ``CSA_FRONTEND_EXACT_RCP=ieee`` gives the backward ``rcp.rn`` back."""
    from csa_frontend.compressor.kernels import common

    bwd = choose_schedule(ratio, coff, head_dim, "bwd")
    fwd = choose_schedule(ratio, coff, head_dim, "fwd")
    assert bwd.family == fwd.family == "window"

    def ptx_of(build, sched):
        return main_kernel_ptx(build, ratio, coff, head_dim, sched, monkeypatch, tmp_path)

    backward = ptx_of(dispatch._build_backward, bwd)
    assert not EXACT_RECIPROCAL.search(backward)
    assert backward.count("rcp.approx.ftz.f32") == bwd.vec
    forward = ptx_of(dispatch._build_forward, fwd)
    assert len(EXACT_RECIPROCAL.findall(forward)) == fwd.vec
    monkeypatch.setattr(common, "EXACT_RCP_INLINE", False)
    ieee = ptx_of(dispatch._build_backward, bwd)
    assert len(EXACT_RECIPROCAL.findall(ieee)) == bwd.vec and "rcp.approx" not in ieee


@pytest.mark.L1
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 2, 128), (256, 2, 512), (64, 1, 66), (200, 2, 192), (3, 2, 65)])
def test_lean_serial_forward_compiles(ratio, coff, head_dim, arch, monkeypatch, tmp_path):
    """The serial forward's lean variant (``SERIAL_FWD_LEAN``, the default) compiles on every
    arch, affine loads (ratio a multiple of the lanes) or not: its lanes' maxima meet by
    shuffles, its weights by the exact reciprocal and Markstein's correction (``div.rn`` only
    behind the branch for tiny exponentials); the classic variant has neither."""
    from csa_frontend.compressor.kernels import serial_fwd
    sched = serial_forward_schedule(ratio, coff, head_dim)

    def ptx():
        texts = kernel_ptx(lambda: dispatch._build_forward(ratio, coff, head_dim, sched, arch)[:1], monkeypatch,
                           tmp_path)
        assert len(texts) == 1
        return texts[0]

    monkeypatch.setattr(serial_fwd, "SERIAL_FWD_LEAN", False)
    classic = ptx()
    assert "div.rn.f32" in classic and "shfl.sync.bfly" not in classic and "rcp.approx.ftz.f32" not in classic
    monkeypatch.setattr(serial_fwd, "SERIAL_FWD_LEAN", True)
    lean = ptx()
    # Markstein weights from the exact reciprocal; div.rn stays only for tiny exponentials
    assert "rcp.approx.ftz.f32" in lean and "shfl.sync.bfly" in lean and "div.rn.f32" in lean
    assert serial_fwd.SerialForward(ratio, coff, head_dim, sched).affine() == (ratio % sched.row_lanes == 0)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim,direction", [(4, 2, 512, "bwd"), (4, 1, 128, "bwd"),
                                                           (128, 1, 128, "bwd"), (128, 1, 128, "fwd")])
def test_first_row_lands_before_the_second_is_requested(ratio, coff, head_dim, direction, monkeypatch, tmp_path):
    """The pipelined kernels (register-window backward, stream forward and backward) wait for
    their whole first row (``cp.async.wait_group 0``) before the row loop requests the next one;
    the loop itself waits for all but the newest group. ``CSA_FRONTEND_FIRST_ROW_ALONE=0``
    requests both rows at once (no such wait). A stream kernel that guesses its first row
    (``STREAM_FWD_GUESS``, ``STREAM_BWD_GUESS``) waits once more, only where the guess was wrong,
    before requesting the row again."""
    from csa_frontend.compressor.kernels import stream_bwd, stream_fwd, window_bwd

    family = choose_schedule(ratio, coff, head_dim, direction).family
    assert family == ("window" if ratio <= 4 else "stream")
    guesses = stream_fwd.STREAM_FWD_GUESS if direction == "fwd" else stream_bwd.STREAM_BWD_GUESS
    guessed = family == "stream" and guesses
    wrong_guess = ["0"] if guessed else []

    def waits():
        ptx = planned_kernel_ptx(ratio, coff, head_dim, direction, monkeypatch, tmp_path)
        return re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)

    assert waits() == wrong_guess + ["0", "1"]
    for module in (stream_bwd, stream_fwd, window_bwd):
        monkeypatch.setattr(module, "FIRST_ROW_ALONE", False)
    assert waits() == wrong_guess + ["1"]


def padding_test_gates_the_search(ptx: str) -> bool:
    """Whether the register that the kernel's first global load fills (``cu_seqlens_comp[n_seg]``,
    the padding test) is read before the segment search's first ballot, i.e. the search waits
    for that load."""
    first = re.search(r"ld\.global\.b32\s+(%r\d+),", ptx)
    ballot = ptx.index("vote.sync.ballot")
    assert first and first.end() < ballot
    return re.search(re.escape(first.group(1)) + r"\b", ptx[first.end():ballot]) is not None


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim,direction", [(4, 2, 128, "fwd"), (4, 2, 512, "bwd")])
def test_segment_search_does_not_wait_for_the_padding_test(ratio, coff, head_dim, direction, monkeypatch,
                                                           tmp_path):
    """``LOOKUP_OVERLAPPED`` (default): a row lookup loads ``cu_seqlens_comp[n_seg]`` alongside the
    search's first probe and applies the padding test afterwards, so the search starts one
    round trip earlier; with the knob off the search sits behind the test's branch. (Packs of
    few segments may skip the search, ``LOOKUP_ONE_ROUND``: off here.)"""
    from csa_frontend.compressor.kernels import common, schedule

    monkeypatch.setitem(schedule.LOOKUP_ONE_ROUND, direction, 0)
    sched = choose_schedule(ratio, coff, head_dim, direction)
    assert sched.family == "window" and sched.col_threads % 32 == 0  # the warp-wide search
    assert not padding_test_gates_the_search(planned_kernel_ptx(ratio, coff, head_dim, direction, monkeypatch,
                                                                tmp_path))
    monkeypatch.setattr(common, "LOOKUP_OVERLAPPED", False)
    assert padding_test_gates_the_search(planned_kernel_ptx(ratio, coff, head_dim, direction, monkeypatch, tmp_path))


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim,direction,knob", [(4, 2, 128, "fwd", "fwd"), (4, 2, 512, "bwd", "bwd"),
                                                                (128, 1, 128, "fwd", "stream_fwd"),
                                                                (128, 1, 128, "bwd", "stream_bwd")])
def test_one_round_lookup_only_when_set(ratio, coff, head_dim, direction, knob, monkeypatch, tmp_path):
    """``LOOKUP_ONE_ROUND`` (per direction and family; one load per lane here) hands out the
    segment's offsets by lane-indexed shuffles (``shfl.sync.idx``, at least first token and
    first row) that the search does not emit; the planned default follows the knob's. (The
    online stream forward looks rows up per warp under "fwd": ``test_online_forward_stages_nothing``.)"""
    from csa_frontend.compressor.kernels import schedule

    def shuffles(loads):
        monkeypatch.setitem(schedule.LOOKUP_ONE_ROUND, knob, loads)
        ptx = planned_kernel_ptx(ratio, coff, head_dim, direction, monkeypatch, tmp_path)
        return len(re.findall(r"shfl\.sync\.idx", ptx))

    default = schedule.LOOKUP_ONE_ROUND[knob]
    searched, one_round = shuffles(0), shuffles(1)
    assert one_round >= searched + 2
    assert shuffles(default) >= one_round if default else shuffles(default) == searched


@pytest.mark.L1
@pytest.mark.parametrize("direction,ratio,coff,head_dim", [("fwd", 128, 1, 128), ("fwd", 33, 2, 130), ("bwd", 16, 2, 256),
                                                            ("bwd", 128, 1, 128), ("bwd", 33, 2, 130)])
def test_stream_kernels_request_a_guessed_first_row_before_the_lookup(direction, ratio, coff, head_dim, monkeypatch,
                                                                      tmp_path):
    """``STREAM_FWD_GUESS`` and ``STREAM_BWD_GUESS`` (both default on): the stream
    kernel's first copies go out ahead of its row lookup's ballot (the one-round lookup,
    ``LOOKUP_ONE_ROUND``); without the guess every copy waits for the lookup. (The online
    forward of short windows stages nothing: ``test_online_forward_stages_nothing``.)"""
    from csa_frontend.compressor.kernels import schedule, stream_bwd, stream_fwd
    module, knob = (stream_fwd, "STREAM_FWD_GUESS") if direction == "fwd" else (stream_bwd, "STREAM_BWD_GUESS")

    def copies_before_the_lookup(guess):
        monkeypatch.setattr(module, knob, guess)
        ptx = planned_kernel_ptx(ratio, coff, head_dim, direction, monkeypatch, tmp_path)
        return ptx.index("cp.async.") < ptx.index("vote.sync.ballot")

    assert choose_schedule(ratio, coff, head_dim, direction).family == "stream"
    assert copies_before_the_lookup(True)
    assert not copies_before_the_lookup(False)
    assert copies_before_the_lookup(getattr(schedule, knob))  # the default


@pytest.mark.L1
@pytest.mark.parametrize("loads", [1, 2, 4])
def test_one_round_tiers_up_to_the_widest(loads, monkeypatch, tmp_path):
    """``LOOKUP_ONE_ROUND`` is the widest round: the forward's lookup has one tier per power of
    two up to it, each with one ballot per load, beside the search's one (the warp-wide vote):
    1 + 2 + ... + ``loads`` + 1 ballots."""
    from csa_frontend.compressor.kernels import schedule

    monkeypatch.setitem(schedule.LOOKUP_ONE_ROUND, "fwd", loads)
    ptx = planned_kernel_ptx(4, 2, 128, "fwd", monkeypatch, tmp_path)
    assert len(re.findall(r"vote\.sync\.ballot", ptx)) == 2 * loads - 1 + 1


@pytest.mark.L1
def test_stagger_knob_sleeps_odd_row_lanes_only_when_set(monkeypatch, tmp_path):
    """``WINDOW_BWD_STAGGER_NS``: 0 (the default) emits no sleep at all; set, one
    ``nanosleep`` of that length, after the first row's wait."""
    from csa_frontend.compressor.kernels import window_bwd

    sched = choose_schedule(4, 2, 512, "bwd")

    def ptx():
        return main_kernel_ptx(dispatch._build_backward, 4, 2, 512, sched, monkeypatch, tmp_path)

    assert "nanosleep" not in ptx()
    monkeypatch.setattr(window_bwd, "WINDOW_BWD_STAGGER_NS", 1500)
    text = ptx()
    assert re.findall(r"nanosleep\.u32\s+(\d+)", text) == ["1500"]
    assert re.search(r"cp\.async\.wait_group\s+0", text).start() < text.index("nanosleep")


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 1, 128), (16, 2, 256), (64, 1, 512), (30, 2, 130)])
def test_stream_backward_stores_its_ape_partials_as_vectors(ratio, coff, head_dim, monkeypatch, tmp_path):
    """The stream backward writes a thread's grad_ape partials of one window position as one
    ``vec``-wide fp32 store (vec scalar stores 4 bytes apart had each warp instruction touch vec
    times the sectors it filled: 4x the slab's bytes through L2 at the end of every CTA). No
    gradient or zero store of the kernel is that wide: grad_kv and grad_score hold ``vec`` bf16."""
    sched = choose_schedule(ratio, coff, head_dim, "bwd")
    assert sched.family == "stream" and sched.vec in (2, 4)
    ptx = planned_kernel_ptx(ratio, coff, head_dim, "bwd", monkeypatch, tmp_path)
    wide = re.findall(rf"st\.global\.v{sched.vec}\.b32\s+\[[^]]+\],\s*\{{\s*%r", ptx)
    assert len(wide) == sched.chunk, (sched, wide)


@pytest.mark.L1
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 1, 128), (16, 2, 256), (100, 2, 66)])
def test_stream_backward_adds_atomic_ape_partials_as_vectors_from_sm90(ratio, coff, head_dim, arch, monkeypatch,
                                                                        tmp_path):
    """The opt-in atomic grad_ape path of the stream backward adds a thread's ``vec`` partials of
    one window position with one ``red.global.add.v{vec}.f32`` on sm_90+ (scalar adds 4 bytes
    apart made each warp instruction touch ``vec`` times the sectors it filled, and contended
    ``vec`` times as often); vector reductions do not exist before sm_90, so sm_80 keeps the
    scalar adds."""
    sched = choose_schedule(ratio, coff, head_dim, "bwd")
    assert sched.family == "stream" and sched.vec in (2, 4)
    texts = kernel_ptx(lambda: dispatch._build_backward(ratio, coff, head_dim, sched, arch, atomic=True)[:1],
                       monkeypatch, tmp_path)
    assert len(texts) == 1
    vector = re.findall(rf"red\.global\.add\.v{sched.vec}\.f32", texts[0])
    scalar = re.findall(r"(?:red|atom)(?:\.[a-z]+)*\.f32\s", texts[0])
    if arch == "sm_90a":
        assert len(vector) == sched.chunk and not scalar, (vector, scalar)
    else:
        assert not vector and len(scalar) == sched.chunk * sched.vec, (vector, scalar)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(16, 2, 256), (32, 1, 66), (9, 2, 3)])
def test_online_forward_stages_nothing(online_forward, ratio, coff, head_dim, monkeypatch, tmp_path):
    """The online stream forward (windows of at most ``STREAM_FWD_ONLINE_WINDOW`` positions)
    reads straight from global memory and keeps its softmax partials in registers: no copies
    into shared memory, no shared memory at all, no barrier. As every kernel, it waits for the
    previous grid before its first global access, and with whole warps across the columns its
    row lookup takes the forward's one round (``LOOKUP_ONE_ROUND["fwd"]``, lane shuffles)."""
    from csa_frontend.compressor.kernels import schedule

    sched = choose_schedule(ratio, coff, head_dim, "fwd")
    assert sched.family == "stream" and sched.online
    ptx = planned_kernel_ptx(ratio, coff, head_dim, "fwd", monkeypatch, tmp_path)
    assert "cp.async" not in ptx and "bar.sync" not in ptx and "barrier.sync" not in ptx
    assert not re.search(r"\.shared", ptx)
    assert "ex2.approx" in ptx
    if dispatch.PDL:
        assert ptx.index("griddepcontrol.wait") < FIRST_GLOBAL_ACCESS.search(ptx).start()
    if head_dim // sched.vec >= 32:
        searched = len(re.findall(r"shfl\.sync\.idx", ptx))
        monkeypatch.setitem(schedule.LOOKUP_ONE_ROUND, "fwd", 0)
        assert len(re.findall(r"shfl\.sync\.idx", planned_kernel_ptx(ratio, coff, head_dim, "fwd", monkeypatch,
                                                                       tmp_path))) + 2 <= searched


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 512), (4, 1, 512), (1, 2, 16)])
@pytest.mark.parametrize("deterministic", [True, False])
def test_row_stealing_backward_compiles(ratio, coff, head_dim, deterministic, monkeypatch, tmp_path):
    """``WINDOW_BWD_STEAL`` (off by default): the window backward compiled with its row claims
    and the thief's CAS, and on the deterministic path the flag hand-over (release / acquire);
    the default kernel has none of it."""
    import dataclasses

    from csa_frontend.compressor.kernels import schedule
    sched = choose_schedule(ratio, coff, head_dim, "bwd")
    assert sched.family == "window" and sched.steal == 0
    build = lambda *a: dispatch._build_backward(*a, atomic=not deterministic)
    default = main_kernel_ptx(build, ratio, coff, head_dim, sched, monkeypatch, tmp_path)
    assert "atom.global.cas" not in default and "atom.global.add.u32" not in default
    monkeypatch.setattr(schedule, "WINDOW_BWD_STEAL", 2)
    schedule.choose_schedule.cache_clear()
    try:
        stealing = choose_schedule(ratio, coff, head_dim, "bwd")
    finally:
        schedule.choose_schedule.cache_clear()
    assert stealing == dataclasses.replace(sched, steal=2)
    text = main_kernel_ptx(build, ratio, coff, head_dim, stealing, monkeypatch, tmp_path)
    assert "atom.global.cas.b32" in text and "atom.global.add.u32" in text
    assert ("st.release.gpu.global.b32" in text) == deterministic
    assert ("ld.acquire.gpu.global.b32" in text) == deterministic


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 512), (4, 1, 512), (1, 2, 16)])
def test_l2_prefetch_ahead_backward_compiles(ratio, coff, head_dim, monkeypatch, tmp_path):
    """``WINDOW_BWD_L2_AHEAD`` (off by default): the window backward compiled with its per-step
    L2 bulk prefetches of kv, score and grad_out; the default kernel has none, and a distance
    inside the cp.async pipeline is refused by name."""
    from csa_frontend.compressor.kernels import window_bwd
    sched = choose_schedule(ratio, coff, head_dim, "bwd")
    assert sched.family == "window"
    build = dispatch._build_backward
    prefetch = re.compile(r"cp\.async\.bulk\.prefetch\.L2\.global")
    assert not prefetch.search(main_kernel_ptx(build, ratio, coff, head_dim, sched, monkeypatch, tmp_path))
    monkeypatch.setattr(window_bwd, "WINDOW_BWD_L2_AHEAD", 2)
    assert len(prefetch.findall(main_kernel_ptx(build, ratio, coff, head_dim, sched, monkeypatch, tmp_path))) == 3
    monkeypatch.setattr(window_bwd, "WINDOW_BWD_L2_AHEAD", 1)
    with pytest.raises(ValueError, match="CSA_FRONTEND_WINDOW_BWD_L2_AHEAD"):
        main_kernel_ptx(build, ratio, coff, head_dim, sched, monkeypatch, tmp_path)
