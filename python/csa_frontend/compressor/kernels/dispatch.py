"""Compile cache and launch glue between torch tensors and the CuTe kernels.

Kernels are compiled through TVM-FFI against symbolic token / row / segment counts, so one
compiled function per static configuration serves every pack (the stream backward has two,
one per row-count bucket; every forward has the serial one for small launches, the coff-2
wide-head forward on sm_90+ the bulk-copy one too, and the stream forward one for packs of one
segment; each set compiled together); calls then pass torch tensors straight through (no
per-call DLPack wrapping) on the environment (current torch) stream.
The cache is process-wide, keyed on exactly the static facts, and guarded by a lock so
concurrent first calls compile once.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import torch

from .cubin import registers
from .schedule import (
    ASSUMED_REGISTERS,
    LOOKUP_ONE_ROUND,
    PDL,
    Schedule,
    ape_split,
    atomic_ape_pays,
    bulk_forward_schedule,
    bulk_forward_walk,
    bwd_column_cluster,
    bwd_interleaved,
    bwd_row_groups,
    bwd_rows_per_thread,
    choose_schedule,
    few_rows_limit,
    fwd_interleaved,
    fwd_rows_per_cta,
    resident_ctas_per_sm,
    row_bucket_schedule,
    serial_forward_schedule,
    slab_bytes,
    sm90_or_later,
    stream_row_ctas,
    takes_serial_forward,
    takes_wide_rows_schedule,
    zero_fill_ctas,
)

log = logging.getLogger("csa_frontend")

#: Architectures whose code generation CI checks; sm_90a is the one validated on hardware.
SUPPORTED_ARCHS = ("sm_80", "sm_90a", "sm_100a")

#: Compiled configurations kept, least recently compiled-or-used evicted first. A training job
#: uses a handful; the bound only matters for sweeps over many configurations.
KERNEL_CACHE_SIZE = 256

_cache: "OrderedDict[Tuple, Callable]" = OrderedDict()
_lock = threading.RLock()


def arch_of(device: torch.device) -> str:
    from ..plan import arch_from_capability

    return arch_from_capability(torch.cuda.get_device_capability(device))


def unsupported_reason(ratio: int, coff: int, head_dim: int, arch: Optional[str] = None) -> Optional[str]:
    if arch is not None and arch not in SUPPORTED_ARCHS:
        return f"arch: fused kernels are built for {SUPPORTED_ARCHS}, got {arch}"
    return None


def cache_keys():
    """The static configurations compiled so far: ``(direction, arch, ratio, coff, head_dim,
    schedule)`` with direction in {fwd, fwd_one_segment, bwd, bwd_atomic} (for tests and
    diagnostics)."""
    with _lock:
        return list(_cache)


def clear_cache() -> None:
    """Forget every compiled kernel (the next call of each configuration compiles again)."""
    with _lock:
        _cache.clear()
        _by_device.clear()


def _compiled(key: Tuple, build: Callable[[], Callable]) -> Callable:
    with _lock:
        fn = _cache.get(key)
        if fn is not None:
            _cache.move_to_end(key)
            return fn
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"csa_frontend: kernel {key} would compile during CUDA-graph capture; "
                "call compile() or run once before capturing")
        t = time.perf_counter()
        fn = build()
        log.info("compiled %s in %.2f s", key, time.perf_counter() - t)
        _cache[key] = fn
        while len(_cache) > KERNEL_CACHE_SIZE:
            _, evicted = _cache.popitem(last=False)
            for k in [k for k, v in _by_device.items() if v[0] is evicted]:
                del _by_device[k]
    return fn


def _fake_tensors(ratio: int, coff: int, head_dim: int):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    cols = coff * head_dim
    n_tok, n_rows, n_off, n_grp = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()

    def mat(dtype, rows, width):
        return make_fake_compact_tensor(dtype, (rows, width), stride_order=(1, 0), assumed_align=16)

    return dict(
        kv=mat(cutlass.BFloat16, n_tok, cols),
        ape=mat(cutlass.Float32, ratio, cols),
        cu=make_fake_compact_tensor(cutlass.Int32, (n_off,), assumed_align=4),
        out=mat(cutlass.BFloat16, n_rows, head_dim),
        slab=make_fake_compact_tensor(cutlass.Float32, (n_grp, ratio, cols), stride_order=(2, 1, 0),
                                      assumed_align=16),
    )


def _options(arch: Optional[str], cubin_dir: Optional[str] = None) -> str:
    """Compile options; with ``cubin_dir`` the cubin is kept (written there, or to the DSL's own
    dump directory where ``cubin_dir`` is empty)."""
    opts = "--enable-tvm-ffi"
    if arch:
        opts += f" --gpu-arch={arch}"
    if cubin_dir is not None:
        opts += " --keep-cubin" + (f" --dump-dir={cubin_dir}" if cubin_dir else "")
    return opts


def _compile_resident(op, *args, arch: Optional[str]):
    """(compiled ``op``, CTAs of it an SM holds at once), the latter from the registers in its
    cubin (``ASSUMED_REGISTERS`` where the cubin has no count). The stream kernels size their
    grids by it (``schedule.stream_row_ctas``)."""
    import contextlib
    import tempfile

    import cutlass.cute as cute

    # a developer dumping artifacts (CUTE_DSL_KEEP, CUTE_DSL_DUMP_DIR): theirs stay where they
    # asked ("": the DSL's dump directory), the cubin joins them
    where = (contextlib.nullcontext("") if os.environ.get("CUTE_DSL_KEEP")
             else tempfile.TemporaryDirectory(prefix="csa_frontend_cubin_"))
    with where as cubin_dir:
        fn = cute.compile(op, *args, options=_options(arch, cubin_dir))
        regs = registers(getattr(fn, "__cubin__", None))
    if regs is None:
        log.warning("%s: no register count in its cubin; its grid assumes %d registers per thread",
                    type(op).__name__, ASSUMED_REGISTERS)
    return fn, resident_ctas_per_sm(op.sched.threads, regs or ASSUMED_REGISTERS)


def uses_pdl(arch: Optional[str]) -> bool:
    """Programmatic dependent launch (``griddepcontrol``) needs sm_90 or later; an unnamed
    arch gets none."""
    return PDL and sm90_or_later(arch)


def _build_forward(ratio: int, coff: int, head_dim: int, sched: Schedule, arch: Optional[str],
                   lookup_loads: Optional[int] = None):
    """(compiled forward, its schedule, CTAs per SM: the stream forward's residency, else 0).
    ``lookup_loads``: the stream forward's row lookup, where not ``LOOKUP_ONE_ROUND``'s."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from .online_fwd import OnlineForward
    from .serial_fwd import SerialForward
    from .stream_fwd import StreamForward
    from .window_fwd import WindowForward
    from .window_fwd_bulk import WindowForwardBulk

    f = _fake_tensors(ratio, coff, head_dim)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    args = (f["kv"], f["kv"], f["ape"], f["cu"], f["cu"], f["out"])
    pdl = uses_pdl(arch)
    if sched.stages:
        fn = cute.compile(WindowForwardBulk(ratio, coff, head_dim, sched, pdl=pdl), *args, cutlass.Int32(1),
                          stream, options=_options(arch))
        return fn, sched, 0
    if sched.family in ("window", "serial") or sched.online:
        # launched by output rows alone (the online stream forward sizes no resident grid)
        family = OnlineForward if sched.online else {"window": WindowForward, "serial": SerialForward}[sched.family]
        fn = cute.compile(family(ratio, coff, head_dim, sched, pdl=pdl, lookup_loads=lookup_loads), *args, stream,
                          options=_options(arch))
        return fn, sched, 0
    one = cutlass.Int32(1)
    fn, per_sm = _compile_resident(StreamForward(ratio, coff, head_dim, sched, pdl=pdl, lookup_loads=lookup_loads),
                                   *args, one, one, stream, arch=arch)
    return fn, sched, per_sm


def _build_backward(ratio: int, coff: int, head_dim: int, sched: Schedule, arch: Optional[str],
                    atomic: bool = False):
    """(main kernel, slab reduction or None for the atomic variant, schedule, CTAs of the main
    kernel per SM: the stream family's residency, else 0)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from .ape_reduce import ApeReduce
    from .stream_bwd import StreamBackward
    from .window_bwd import StealingWindowBackward, WindowBackward

    f = _fake_tensors(ratio, coff, head_dim)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    family = (StealingWindowBackward if sched.steal else WindowBackward) if sched.family == "window" else StreamBackward
    op = family(ratio, coff, head_dim, sched, atomic, pdl=uses_pdl(arch), vector_atomics=sm90_or_later(arch),
                column_cluster=bwd_column_cluster(sched, arch))
    one = cutlass.Int32(1)
    work = (make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4),) if sched.steal else ()
    args = (f["kv"], f["kv"], f["ape"], f["cu"], f["cu"], f["out"], f["kv"], f["kv"], f["slab"], *work, one, one, one,
            one, stream)
    if sched.family == "stream":
        main, per_sm = _compile_resident(op, *args, arch=arch)
    else:
        main, per_sm = cute.compile(op, *args, options=_options(arch)), 0
    if atomic:
        return main, None, sched, per_sm
    reduce = cute.compile(ApeReduce(op.pdl), f["slab"], f["ape"], one, stream, options=_options(arch))
    return main, reduce, sched, per_sm


def _compile_forward_schedule(ratio: int, coff: int, head_dim: int, arch: Optional[str], sched):
    """(compiled forward, schedule, CTAs per SM) of one forward schedule, or None where the
    planner gave none."""
    if sched is None:
        return None
    key = ("fwd", arch, ratio, coff, head_dim, sched)
    return _compiled(key, lambda: _build_forward(ratio, coff, head_dim, sched, arch))


def compile_forward(*, ratio: int, coff: int, head_dim: int, arch: Optional[str] = None):
    """(compiled forward, schedule, CTAs per SM) of the default schedule. The bulk-copy forward
    (``bulk_forward_schedule``), where the planner has one for ``arch``, the serial forward of
    small launches (``serial_forward_schedule``) and the stream forward of one-segment packs
    (``compile_forward_one_segment``) are compiled too, so no pack ever compiles later."""
    fwd = _compile_forward_schedule(ratio, coff, head_dim, arch, choose_schedule(ratio, coff, head_dim, "fwd"))
    compile_forward_bulk(ratio=ratio, coff=coff, head_dim=head_dim, arch=arch)
    compile_forward_serial(ratio=ratio, coff=coff, head_dim=head_dim, arch=arch)
    compile_forward_one_segment(ratio=ratio, coff=coff, head_dim=head_dim, arch=arch)
    return fwd


def compile_forward_one_segment(*, ratio: int, coff: int, head_dim: int, arch: Optional[str] = None):
    """(compiled stream forward for packs of one segment, schedule, CTAs per SM), or None where
    the default forward serves them too (window family, online stream forward; stream lookups by the search). A
    one-segment pack's rows need no lookup round, and the one-round lookup's code alone (2-6
    more registers) cost those forwards up to 0.4 us on the H200 (NOTES row 117), so they keep
    the search."""
    sched = choose_schedule(ratio, coff, head_dim, "fwd")
    if sched.family != "stream" or sched.online or not LOOKUP_ONE_ROUND["stream_fwd"]:
        return None
    key = ("fwd_one_segment", arch, ratio, coff, head_dim, sched)
    return _compiled(key, lambda: _build_forward(ratio, coff, head_dim, sched, arch, lookup_loads=0))


def compile_forward_serial(*, ratio: int, coff: int, head_dim: int, arch: Optional[str] = None):
    """(compiled serial forward, schedule, 0), or None where it is off."""
    return _compile_forward_schedule(ratio, coff, head_dim, arch, serial_forward_schedule(ratio, coff, head_dim))


def compile_forward_bulk(*, ratio: int, coff: int, head_dim: int, arch: Optional[str] = None):
    """(compiled bulk-copy forward, schedule, 0), or None where the planner has none for ``arch``."""
    return _compile_forward_schedule(ratio, coff, head_dim, arch, bulk_forward_schedule(ratio, coff, head_dim, arch))


def compile_backward(*, ratio: int, coff: int, head_dim: int, arch: Optional[str] = None,
                     deterministic: bool = True):
    """The deterministic backward, or with ``deterministic=False`` the atomic grad_ape variant:
    (main kernel, slab reduction or None, schedule, CTAs of the main kernel per SM) of the
    default schedule. The row-count bucket's kernels (``row_bucket_schedule``: few-rows stream
    or wide register window), where the planner has them, are compiled too, so no row count
    ever compiles later (``compile_backward_bucket``); and for the atomic variant the
    deterministic kernels where a launch could have too many row groups to add atomically
    (``atomic_may_fall_back``)."""
    sched = choose_schedule(ratio, coff, head_dim, "bwd")
    kernels = _compile_backward_schedule(ratio, coff, head_dim, arch, deterministic, sched)
    bucket = compile_backward_bucket(ratio=ratio, coff=coff, head_dim=head_dim, arch=arch, deterministic=deterministic)
    if not deterministic and atomic_may_fall_back(kernels, bucket):
        compile_backward(ratio=ratio, coff=coff, head_dim=head_dim, arch=arch)
    return kernels


def atomic_may_fall_back(*variants) -> bool:
    """Whether a launch of any of the atomic backward's ``(main, reduce, schedule, CTAs per SM)``
    variants (None: absent) could meet more row groups than ``atomic_ape_pays`` allows, so it
    needs the deterministic kernels at hand. A stream launch has at most ``stream_row_ctas``
    groups (its rows per CTA cover the rows over that many CTAs)."""
    return any(v is not None and v[2].family == "stream"
               and not atomic_ape_pays(v[2], stream_row_ctas(v[2], "bwd", v[3])) for v in variants)


def compile_backward_bucket(*, ratio: int, coff: int, head_dim: int, arch: Optional[str] = None,
                            deterministic: bool = True):
    """The backward's kernels for its row-count bucket (``row_bucket_schedule``: launches of few
    rows per CTA in the stream family, long ones in the register window), or None where the
    planner has no such schedule for this configuration."""
    sched = row_bucket_schedule(ratio, coff, head_dim)
    if sched is None:
        return None
    return _compile_backward_schedule(ratio, coff, head_dim, arch, deterministic, sched)


def _compile_backward_schedule(ratio, coff, head_dim, arch, deterministic, sched):
    key = ("bwd" if deterministic else "bwd_atomic", arch, ratio, coff, head_dim, sched)
    return _compiled(key, lambda: _build_backward(ratio, coff, head_dim, sched, arch, not deterministic))


class _on_stream:
    """Run on ``device`` and ``stream``; only entered when either differs from the current one."""

    def __init__(self, device: torch.device, stream: Optional[torch.cuda.Stream]):
        self.ctx = [torch.cuda.device(device)]
        if stream is not None:
            self.ctx.append(torch.cuda.stream(stream))

    def __enter__(self):
        for c in self.ctx:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctx):
            c.__exit__(*exc)


#: (direction, device index, ratio, coff, head_dim) -> (compiled kernels, their direct entry
#: points); skips the arch query
#: and key building on the hot path (host time per call is what eager training loops feel).
_by_device: Dict[Tuple, object] = {}


def _direct_entry(fn):
    """The positional TVM-FFI function under a compiled kernel's keyword-argument wrapper.

    Every call here passes all arguments positionally, so the wrapper's Python layer (~1-2 us
    per call) adds nothing; the entry point's own argument checks stay. Falls back to the
    wrapper whenever the DSL's object does not offer that function plainly."""
    raw = getattr(fn, "__tvm_ffi_object__", None)
    execution_args = getattr(fn, "execution_args", None)
    if raw is None or execution_args is None or getattr(execution_args, "has_pointer_address_arg_specs", True):
        return fn
    try:
        direct = raw()
    except Exception:
        return fn
    return direct if callable(direct) else fn


class ForwardKernels(NamedTuple):
    """A forward configuration's launch inputs on one device (``_kernels_for``)."""
    fn: Callable
    sched: Schedule
    per_sm: int  # CTAs of ``fn`` an SM holds at once (stream family; else 0)
    bulk: Any  # the bulk-copy forward's (fn, schedule, 0), or None
    serial: Any  # the serial forward's (fn, schedule, 0), or None
    sms: int  # the device's SMs: the stream forward's wave is counted on them
    one_segment: Any  # the stream forward for one-segment packs (fn, schedule, CTAs per SM), or None


class BackwardKernels(NamedTuple):
    """A backward configuration's launch inputs on one device (``_kernels_for``)."""
    main: Callable
    reduce: Any  # the grad_ape slab reduction, or None (atomic variant)
    sched: Schedule
    per_sm: int  # CTAs of ``main`` an SM holds at once (stream family; else 0)
    bucket: Any  # the row-count bucket's (main, reduce, schedule, CTAs per SM), or None


def _kernels_for(direction: str, device: torch.device, ratio: int, coff: int, head_dim: int):
    """The compiled kernels of one configuration (their direct entry points) and its schedule:
    ``ForwardKernels`` for "fwd", ``BackwardKernels`` for "bwd" and "bwd_atomic"."""
    key = (direction, device.index, ratio, coff, head_dim)
    entry = _by_device.get(key)
    if entry is None:
        arch = arch_of(device)
        if direction == "fwd":
            fns = compile_forward(ratio=ratio, coff=coff, head_dim=head_dim, arch=arch)
            bulk = compile_forward_bulk(ratio=ratio, coff=coff, head_dim=head_dim, arch=arch)
            serial = compile_forward_serial(ratio=ratio, coff=coff, head_dim=head_dim, arch=arch)
            one_segment = compile_forward_one_segment(ratio=ratio, coff=coff, head_dim=head_dim, arch=arch)
            variant = lambda f: None if f is None else _direct_entries(f)
            direct = ForwardKernels(*_direct_entries(fns), variant(bulk), variant(serial),
                                    torch.cuda.get_device_properties(device).multi_processor_count,
                                    variant(one_segment))
        else:
            kw = dict(ratio=ratio, coff=coff, head_dim=head_dim, arch=arch, deterministic=direction == "bwd")
            fns = compile_backward(**kw)
            bucket = compile_backward_bucket(**kw)
            direct = BackwardKernels(*_direct_entries(fns), None if bucket is None else _direct_entries(bucket))
        entry = _by_device[key] = (fns, direct)
    return entry[1]


def _direct_entries(fns):
    return tuple(_direct_entry(f) if callable(f) else f for f in fns)


#: The current CUDA device index without torch.cuda.current_device()'s lazy-init check (the
#: prepared launchers only exist after a kernel ran, so CUDA is initialised).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _needs_guard(device: torch.device, stream) -> bool:
    return stream is not None or device.index != _current_device()


def forward_call(fn, sched, per_sm, bulk, serial, sms, one_segment, kv, score, ape, cu_seqlens, cu_seqlens_comp,
                 out):
    """(compiled function, its arguments) of one forward launch: the serial kernel for launches
    of few output elements (``takes_serial_forward``), the bulk-copy kernel where the row count
    gives its CTAs enough stages (``bulk_forward_walk``), else the schedule's own (``per_sm``:
    its CTAs per SM, which with the device's ``sms`` size a stream forward's grid), or for a
    pack of one segment ``one_segment`` where given."""
    args = (kv, score, ape, cu_seqlens, cu_seqlens_comp, out)
    rows = out.shape[0]
    if serial is not None and takes_serial_forward(rows, out.shape[1], serial[1], sched.family):
        return serial[0], args
    per_cta = 0 if bulk is None else bulk_forward_walk(rows, bulk[1])
    if per_cta:
        return bulk[0], args + (per_cta,)
    if sched.family == "stream" and not sched.online:
        if one_segment is not None and cu_seqlens.shape[0] == 2:
            fn, _, per_sm = one_segment
        rpc = fwd_rows_per_cta(rows, sched, per_sm, sms)
        coff = kv.shape[1] // out.shape[1]  # kv rows hold coff * head_dim values
        return fn, args + (rpc, int(fwd_interleaved(rows, cu_seqlens.shape[0] - 1, coff, rpc)))
    return fn, args


def _launch_forward(*kernels_and_tensors):
    call, args = forward_call(*kernels_and_tensors)
    call(*args)


def forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, *, ratio, coff, head_dim, stream=None):
    if out.shape[0] == 0:
        return
    args = _kernels_for("fwd", kv.device, ratio, coff, head_dim) + (kv, score, ape, cu_seqlens,
                                                                  cu_seqlens_comp, out)
    if _needs_guard(kv.device, stream):
        with _on_stream(kv.device, stream):
            _launch_forward(*args)
    else:
        _launch_forward(*args)


def backward_for_rows(n_rows, main, reduce, sched, per_sm, bucket, slab):
    """(main kernel, slab reduction, schedule, rows per thread or CTA) a backward launch of
    ``n_rows`` rows runs: the default kernels of ``_kernels_for``, or the row-count bucket's
    ``bucket``: the few-rows stream kernels where the default's CTAs would walk few rows
    (``schedule.takes_few_rows_schedule``; the default's rows per CTA are computed once and
    kept where it stays), the wide register window's for long launches
    (``schedule.takes_wide_rows_schedule``). ``slab``: bytes of one grad_ape slab
    (``schedule.slab_bytes``)."""
    if bucket is not None and takes_wide_rows_schedule(n_rows, bucket[2]):
        main, reduce, sched, per_sm = bucket
        return main, reduce, sched, bwd_rows_per_thread(n_rows, sched, per_sm, slab)
    rpt = bwd_rows_per_thread(n_rows, sched, per_sm, slab)
    if bucket is not None and rpt <= few_rows_limit(sched, bucket[2]):
        main, reduce, sched, per_sm = bucket
        rpt = bwd_rows_per_thread(n_rows, sched, per_sm, slab)
    return main, reduce, sched, rpt


def _launch_backward(main, reduce, sched, per_sm, bucket, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out,
                     grad_kv, grad_score, grad_ape, ratio, coff, head_dim, exact=None):
    """One backward launch. ``exact``: for the atomic variant, the deterministic kernels
    (``BackwardKernels``) a launch of too many row groups runs instead (``atomic_ape_pays``).
    ``grad_ape`` None (the caller does not want it, e.g. a frozen ape): the main kernel's
    partials go to scratch and the slab reduction, a dependent launch of 1.6-5.7 us on the
    H200 (NOTES row 123), is not run."""
    n_rows = grad_out.shape[0]
    main, reduce, sched, rpt = backward_for_rows(n_rows, main, reduce, sched, per_sm, bucket,
                                                 slab_bytes(ratio, coff, head_dim))
    groups = bwd_row_groups(n_rows, sched, rpt)
    if reduce is None and exact is not None and not atomic_ape_pays(sched, groups):
        _launch_backward(*exact, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score,
                         grad_ape, ratio, coff, head_dim)
        return
    n_seg = cu_seqlens.shape[0] - 1
    zero_ctas = zero_fill_ctas(n_seg, sched)
    inter = int(bwd_interleaved(n_rows, n_seg, ratio, coff, head_dim, sched, rpt))
    steals = sched.steal > 0  # the planner gives only window backwards a steal
    work = (steal_workspace(kv.device, sched, groups, rpt),) if steals else ()
    if reduce is None:  # atomic variant: CTA sums go straight into grad_ape
        if grad_ape is None:  # zeroed all the same: atomics read what they add to (initcheck)
            sums = torch.zeros((1, ratio, coff * head_dim), dtype=torch.float32, device=kv.device)
        else:
            grad_ape.zero_()
            sums = grad_ape.view(1, ratio, coff * head_dim)
        main(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, sums, *work, rpt, groups,
             zero_ctas, inter)
        return
    extra = stolen_parts_slabs(sched, groups, ratio, coff, head_dim) if steals else 0
    slab = torch.empty((max(groups, 1) + extra, ratio, coff * head_dim), dtype=torch.float32, device=kv.device)
    if groups == 0 and grad_ape is not None:
        slab.zero_()
    main(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, slab, *work,
         rpt, groups, zero_ctas, inter)
    if grad_ape is not None:
        slabs = slab[:max(groups, 1)] if extra else slab
        reduce(slabs, grad_ape, ape_split(slabs.shape[0]))


#: device index -> the row-stealing backward's claim workspace (int32, zero between launches)
_steal_work: Dict[int, torch.Tensor] = {}


def steal_workspace(device: torch.device, sched: Schedule, groups: int, rows: int) -> torch.Tensor:
    """The claim words and flags of a row-stealing window backward launch (``WINDOW_BWD_STEAL``):
    zeroed once per device and grown as needed; every launch leaves it zeroed, so launches on
    one device must not overlap."""
    if groups >= 1 << 16 or rows >= 1 << 15:
        raise RuntimeError(f"csa_frontend: row stealing (CSA_FRONTEND_WINDOW_BWD_STEAL) takes at most 65535 row "
                           f"groups of fewer than 32768 rows per thread; this launch has {groups} of {rows}")
    # words, flags, and a last word that counts steals (``WINDOW_BWD_STEAL_PROBE_US``, tests)
    need = sched.col_tiles * groups * (sched.threads // 32) * (1 + sched.steal) + 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    work = _steal_work.get(index)
    if work is None or work.numel() < need:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # allocated in the graph's pool and zeroed only at replay, it would serve eager calls too
            raise RuntimeError("csa_frontend: row stealing (CSA_FRONTEND_WINDOW_BWD_STEAL) would allocate its "
                               "workspace during CUDA-graph capture; run this backward once before capturing")
        work = torch.zeros(need, dtype=torch.int32, device=device)
        _steal_work[index] = work
    return work


def stolen_parts_slabs(sched: Schedule, groups: int, ratio: int, coff: int, head_dim: int) -> int:
    """Slabs' worth of room after a stealing backward's slabs for its stolen rows' grad_ape
    contributions (``WindowBackward.parts_view``)."""
    values = sched.col_tiles * groups * sched.steal * ratio * coff * sched.vec * sched.threads
    return -(-values // (ratio * coff * head_dim))


def _backward_kernels(deterministic: bool, device: torch.device, ratio: int, coff: int, head_dim: int):
    """(the kernels a backward launches, the deterministic ones an atomic launch may fall back to:
    ``_launch_backward``'s ``exact``, or None where it never does or is deterministic itself),
    each looked up once."""
    kernels = _kernels_for("bwd" if deterministic else "bwd_atomic", device, ratio, coff, head_dim)
    if deterministic or not atomic_may_fall_back(kernels[:4], kernels.bucket):
        return kernels, None
    return kernels, _kernels_for("bwd", device, ratio, coff, head_dim)


def backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, *,
             ratio, coff, head_dim, deterministic=True, stream=None):
    kernels, exact = _backward_kernels(deterministic, kv.device, ratio, coff, head_dim)
    args = (*kernels, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, ratio,
            coff, head_dim, exact)
    if _needs_guard(kv.device, stream):
        with _on_stream(kv.device, stream):
            _launch_backward(*args)
    else:
        _launch_backward(*args)


# -- prepared launchers: the wrappers' fast path -------------------------------------------------
#
# The same launches as forward()/backward() with the per-call lookups done once: the compiled
# kernels, the schedule and the device are bound when the launcher is made. Each launch still
# checks that its device is current (else it takes the guarded route), so a launcher is correct
# whatever the caller's current device.

def prepared_forward(device: torch.device, ratio: int, coff: int, head_dim: int) -> Callable:
    """``launch(kv, score, ape, cu_seqlens, cu_seqlens_comp, out)`` on the current stream."""
    kernels = _kernels_for("fwd", device, ratio, coff, head_dim)
    index = device.index

    def launch(kv, score, ape, cu_seqlens, cu_seqlens_comp, out):
        if out.shape[0] == 0:
            return
        if _current_device() != index:
            return forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio=ratio, coff=coff,
                           head_dim=head_dim)
        _launch_forward(*kernels, kv, score, ape, cu_seqlens, cu_seqlens_comp, out)
    return launch


def prepared_backward(device: torch.device, ratio: int, coff: int, head_dim: int,
                      deterministic: bool = True) -> Callable:
    """``launch(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score,
    grad_ape)`` on the current stream (``grad_ape`` None: not computed)."""
    kernels, exact = _backward_kernels(deterministic, device, ratio, coff, head_dim)
    index = device.index

    def launch(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape):
        args = (*kernels, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape,
                ratio, coff, head_dim, exact)
        if _current_device() != index:
            with _on_stream(kv.device, None):
                _launch_backward(*args)
        else:
            _launch_backward(*args)
    return launch
