"""Reliability on CUDA (issue 6): on-device offset validation, thread safety and the compile
cache, resource hygiene, special values, a second GPU, and extents at the int32 limit.
Skipped without CUDA; the CPU halves live in ``test_reliability.py``."""
import dataclasses
import math

import pytest
import torch

import csa_frontend.compressor.api as api
from csa_frontend import (CSACompressorForward, csa_compress, csa_compressor_backward_wrapper,
                          csa_compressor_forward_wrapper)
from csa_frontend.compressor.kernels import dispatch
from csa_frontend.compressor.kernels.schedule import (bulk_forward_schedule, choose_schedule, row_bucket_schedule,
                                                     serial_forward_schedule)
from csa_frontend.compressor.reference import build_windows, reference_backward, reference_forward
from csa_frontend.compressor.plan import INT32_LIMIT
from csa_testing import (BAD_OFFSETS, THREAD_CONFIGS, assert_contract, assert_like_reference,
                         assert_offsets_rejected, bad_offset_pack, compile_log_descriptions,
                         concurrent_wrapper_calls, execute_backward, execute_forward, leaves, make_pack,
                         offsets)

pytestmark = pytest.mark.gpu

GiB = 1 << 30


def _run_wrappers(pack, **kw):
    """(out, grad_kv, grad_score, grad_ape) of both wrappers, total_comp given (no sync)."""
    out = csa_compressor_forward_wrapper(*pack.inputs, ratio=pack.ratio, coff=pack.coff,
                                         total_comp=pack.total_comp, **kw)["out"]
    return (out, *csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=pack.ratio, coff=pack.coff,
                                                  **kw))


# -- validation of the offsets' contents -----------------------------------------------------------

@pytest.mark.L0
@pytest.mark.parametrize("how", ["argument", "env"])
@pytest.mark.parametrize("cu_edits,comp_edits,total_comp,message", BAD_OFFSETS)
def test_validation_rejects_bad_offsets_on_device(monkeypatch, how, cu_edits, comp_edits, total_comp, message):
    """validate=True (or CSA_FRONTEND_VALIDATE=1) reads CUDA offsets and names the first bad index
    before any kernel runs; the caller's buffers stay untouched."""
    pack = bad_offset_pack(cu_edits, comp_edits, total_comp, "cuda")
    if how == "env":
        monkeypatch.setenv("CSA_FRONTEND_VALIDATE", "1")
    assert_offsets_rejected(pack, True if how == "argument" else None, message)


@pytest.mark.L0
def test_validated_calls_equal_unvalidated_ones():
    pack = make_pack([300, 0, 77, 1024], 4, 2, 128, extra_tokens=3, extra_rows=2, device="cuda")
    for got, want in zip(_run_wrappers(pack, validate=True), _run_wrappers(pack)):
        assert torch.equal(got, want)


# -- thread safety and the compile cache -------------------------------------------------------------

@pytest.fixture
def fresh_kernel_cache(monkeypatch):
    """An empty process-wide kernel cache for this test (the previous one comes back afterwards),
    so compiles can be counted whatever other tests compiled before."""
    for name in ("_cache", "_by_device"):
        monkeypatch.setattr(dispatch, name, type(getattr(dispatch, name))())


def _keys_by_config():
    """{(direction, ratio, coff, head_dim): [keys]} of the kernel cache, checking each key's layout
    (direction, arch, ratio, coff, head_dim, schedule) against the configuration it names
    (direction "fwd", "bwd" or "bwd_atomic", the deterministic=False variant of "bwd"; the
    stream forward for one-segment packs, "fwd_one_segment", is grouped with "fwd")."""
    arch = dispatch.arch_of(torch.device("cuda"))
    grouped = {}
    for key in dispatch.cache_keys():
        direction, key_arch, ratio, coff, head_dim, sched = key
        if direction == "fwd_one_segment":
            direction = "fwd"
        if direction == "fwd":  # the bulk-copy forward (where the planner has one) and the serial one compile with it
            planned = {choose_schedule(ratio, coff, head_dim, "fwd"),
                       bulk_forward_schedule(ratio, coff, head_dim, arch),
                       serial_forward_schedule(ratio, coff, head_dim)}
        else:  # the backward's row-count bucket compiles with it
            planned = {choose_schedule(ratio, coff, head_dim, "bwd"), row_bucket_schedule(ratio, coff, head_dim)}
        assert key_arch == arch and sched in planned, key
        grouped.setdefault((direction, ratio, coff, head_dim), []).append(key)
    return grouped


def _expected_keys(configs):
    return {(direction, *cfg) for cfg in configs for direction in ("fwd", "bwd")}


@pytest.mark.L1
def test_concurrent_mixed_configurations_compile_each_once(fresh_kernel_cache, csa_log):
    """8 threads (half of them on side streams of their own) race on 4 configurations, one of the
    stream family: every result meets the contract and every kernel compiled exactly once."""
    for pack, out, grads in concurrent_wrapper_calls("cuda", side_streams=True):
        assert_like_reference(pack, out, grads)
    grouped = _keys_by_config()
    assert set(grouped) == _expected_keys(THREAD_CONFIGS)
    arch = dispatch.arch_of(torch.device("cuda"))
    for (direction, *cfg), per_config in grouped.items():  # one key per direction and schedule
        if direction == "fwd":
            extra = ((bulk_forward_schedule(*cfg, arch) is not None) + (serial_forward_schedule(*cfg) is not None)
                     + (dispatch.compile_forward_one_segment(ratio=cfg[0], coff=cfg[1], head_dim=cfg[2], arch=arch)
                        is not None))
        else:
            extra = row_bucket_schedule(*cfg) is not None
        assert len(per_config) == 1 + extra, (direction, cfg, per_config)
    keys = [key for per_config in grouped.values() for key in per_config]
    for key in keys:  # the kernel layer logs each compile with its key
        compiles = [r for r in csa_log.records if isinstance(r.args, tuple) and key in r.args]
        assert len(compiles) == 1, f"{key} compiled {len(compiles)} times"
    built = compile_log_descriptions(csa_log.records)
    assert len(built) == len(set(built)) == 2 * len(THREAD_CONFIGS), built


@pytest.mark.L1
def test_compiled_cache_keys_are_the_static_configuration(fresh_kernel_cache):
    """N distinct configurations make N keys per direction; new token, segment and row counts
    (padding, empty packs) make none, neither in the kernel cache nor in the operator cache."""
    configs = [(2, 1, 64), (2, 2, 64), (5, 1, 32)]
    for n, (ratio, coff, head_dim) in enumerate(configs, 1):
        _run_wrappers(make_pack([4 * ratio + 1, 2 * ratio], ratio, coff, head_dim, device="cuda"))
        assert set(_keys_by_config()) == _expected_keys(configs[:n])
    keys, ops = dispatch.cache_keys(), len(api._op_cache)
    for ratio, coff, head_dim in configs:
        for lengths, extra_rows in (([1000, 0, 3, 77], 5), ([ratio - 1], 0), ([7 * ratio] * 40, 1)):
            _run_wrappers(make_pack(lengths, ratio, coff, head_dim, extra_tokens=2, extra_rows=extra_rows,
                                    device="cuda"))
    assert dispatch.cache_keys() == keys and len(api._op_cache) == ops
    ratio, coff, head_dim = configs[0]
    for lengths in ([9 * ratio], [3 * ratio, 5]):  # the atomic grad_ape variant: one more key, once
        pack = make_pack(lengths, ratio, coff, head_dim, device="cuda")
        csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=ratio, coff=coff, deterministic=False)
    added = set(dispatch.cache_keys()) - set(keys)
    assert {key[0] for key in added} == {"bwd_atomic"} and {key[2:5] for key in added} == {configs[0]}


# -- resource hygiene --------------------------------------------------------------------------------

@pytest.mark.L1
def test_ten_thousand_calls_leave_device_memory_flat():
    packs = [make_pack(lengths, 4, 2, 128, extra_rows=1, seed=i, device="cuda")
             for i, lengths in enumerate(([300, 77], [1024, 0, 5], [64] * 9))]
    side = torch.cuda.Stream()

    def calls(n):
        for i in range(n):
            pack = packs[i % len(packs)]
            stream = side if i % 5 == 4 else None  # some launch on a side stream (record_stream path)
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())
            if i % 2:
                csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=4, stream=stream)
            else:
                csa_compressor_forward_wrapper(*pack.inputs, ratio=4, total_comp=pack.total_comp, stream=stream)
        torch.cuda.synchronize()

    calls(48)  # compiles, and lets the caching allocator reach its steady state
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    keys, ops = dispatch.cache_keys(), len(api._op_cache)
    calls(10_000)
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.memory_reserved() <= reserved + (64 << 20)  # one leaked output per call would be GiBs
    assert dispatch.cache_keys() == keys and len(api._op_cache) == ops


# -- special values --------------------------------------------------------------------------------

SPECIAL_CONFIGS = [(4, 2, 128), (3, 1, 64), (64, 2, 128)]  # register-window x2, stream family
SPECIALS = [(name, value) for name in ("kv", "score", "ape") for value in (math.nan, math.inf, -math.inf)]


def _special_pack(ratio, coff, head_dim):
    """Segments with a tail, an empty one, one shorter than ratio, a long one; spare tokens past
    cu_seqlens[-1] and padding rows."""
    r = ratio
    return make_pack([3 * r + 1, 0, max(r - 1, 1), 5 * r, 2 * r + 1], r, coff, head_dim, extra_tokens=3,
                     extra_rows=2, seed=r + coff, device="cuda")


def _token_sites(pack):
    """(token, column) sites: consumed ones (own half, previous half, token 0 which every padding row
    reads too) and never-consumed ones (a tail token, a segment shorter than ratio, the first half
    of a segment's last block, a token past cu_seqlens[-1])."""
    r, d = pack.ratio, pack.head_dim
    own = d if pack.coff == 2 else 0
    cu = pack.cu_seqlens.tolist()
    long_start = cu[3]
    return [(long_start + 2 * r + 1, own + 5), (long_start + 2 * r + 1, 6), (0, own + 7), (cu[1] - 1, own + 8),
            (cu[2], own + 9), (long_start + 4 * r + 1, 10), (pack.kv.shape[0] - 1, own + 11)]


def _ape_sites(pack):
    own = pack.head_dim if pack.coff == 2 else 0
    return [(1, own + 5), (0, 9), (pack.ratio - 1, own + 12)]


def _window_slots(pack, row):
    """[(token, column)] of output row ``row``'s window (column 0), for a row of the long segment."""
    r, d = pack.ratio, pack.head_dim
    cu, comp = pack.cu_seqlens.tolist(), pack.cu_seqlens_comp.tolist()
    first = cu[3] + (row - comp[3]) * r
    own = [(first + k, d if pack.coff == 2 else 0) for k in range(r)]
    return own + ([(first - r + k, 0) for k in range(r)] if pack.coff == 2 else [])


def _with_specials(pack, name, value, sites):
    t = getattr(pack, name).clone()
    mask = torch.zeros(t.shape, dtype=torch.bool)
    for site in sites:
        t[site] = value
        mask[site] = True
    return dataclasses.replace(pack, **{name: t}), mask


def _taint(pack, token_mask, ape_mask):
    """Where a special value may show up: output (row, column)s whose window reads one, the gradient
    slots of those windows (rows that receive gradients only), and grad_ape's matching entries."""
    r, coff, d = pack.ratio, pack.coff, pack.head_dim
    win = build_windows(pack.cu_seqlens, pack.cu_seqlens_comp, r, coff, pack.total_comp, torch.device("cpu"))
    half = win.half.expand_as(win.token)
    hit = token_mask.view(-1, coff, d)[win.token, half] | ape_mask.view(r, coff, d)[win.ape_row, win.half][None]
    out_taint = (hit & win.valid[:, :, None]).any(1)                                   # (rows, d)
    used = win.used_rows
    spread = out_taint[:used, None, :] & win.valid[:used, :, None]                     # (used, W, d)
    rows, pos, cols = spread.nonzero(as_tuple=True)
    grad_taint = torch.zeros(token_mask.shape[0], coff, d, dtype=torch.bool)
    grad_taint[win.token[:used][rows, pos], win.half[pos], cols] = True
    ape_taint = torch.zeros(r, coff, d, dtype=torch.bool)
    pos, cols = spread.any(0).nonzero(as_tuple=True)
    ape_taint[win.ape_row[pos], win.half[pos], cols] = True
    return out_taint, grad_taint.view(token_mask.shape), ape_taint.view(ape_mask.shape)


def _check_specials(pack, token_mask, ape_mask):
    """The contract against the reference, NaN for NaN; and every element whose window holds no
    special value is finite. Returns (out, grad_kv, grad_score, grad_ape)."""
    results = _run_wrappers(pack)
    assert_like_reference(pack, results[0], results[1:])
    out_taint, grad_taint, ape_taint = _taint(pack, token_mask, ape_mask)
    for name, t, taint in zip(("out", "grad_kv", "grad_score", "grad_ape"), results,
                              (out_taint, grad_taint, grad_taint, ape_taint)):
        assert bool(torch.isfinite(t.cpu()[~taint]).all()), f"{name}: a special value leaked into an unrelated element"
    return results


def _special_marks(cfg, name, value):
    smoke = cfg == (4, 2, 128) and (name, value) in (("kv", math.nan), ("score", math.inf))
    return pytest.mark.L0 if smoke else pytest.mark.L1


@pytest.mark.parametrize("ratio,coff,head_dim,name,value", [
    pytest.param(*cfg, name, value, marks=_special_marks(cfg, name, value), id=f"r{cfg[0]}c{cfg[1]}d{cfg[2]}-{name}-{value}")
    for cfg in SPECIAL_CONFIGS for name, value in SPECIALS])
def test_special_values_propagate_like_the_reference(ratio, coff, head_dim, name, value):
    pack = _special_pack(ratio, coff, head_dim)
    sites = _ape_sites(pack) if name == "ape" else _token_sites(pack)
    pack, mask = _with_specials(pack, name, value, sites)
    no_tokens = torch.zeros(pack.kv.shape, dtype=torch.bool)
    no_ape = torch.zeros(pack.ape.shape, dtype=torch.bool)
    _check_specials(pack, no_tokens if name == "ape" else mask, mask if name == "ape" else no_ape)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", SPECIAL_CONFIGS)
def test_window_of_minus_infinity_scores_gives_nan(ratio, coff, head_dim):
    """Every score of one row's window is -inf: NaN in that (row, column) as eager gives, and in its
    gradients; nothing else."""
    pack = _special_pack(ratio, coff, head_dim)
    row = int(pack.cu_seqlens_comp[3]) + 2
    pack, mask = _with_specials(pack, "score", -math.inf, _window_slots(pack, row))
    out = _check_specials(pack, mask, torch.zeros(pack.ape.shape, dtype=torch.bool))[0]
    assert bool(out[row, 0].isnan()) and int(out.isnan().sum()) == 1


# -- a second GPU ----------------------------------------------------------------------------------

def _every_route(pack):
    """Outputs of wrappers, classes planned from meta samples, a side stream of the pack's device,
    and csa_compress with autograd, all for ``pack`` (wherever the current device is)."""
    device = pack.kv.device
    results = list(_run_wrappers(pack))
    out = torch.empty(pack.total_comp, pack.head_dim, dtype=torch.bfloat16, device=device)
    meta = [t.to("meta") for t in (*pack.inputs, out)]
    op = CSACompressorForward(*meta, ratio=pack.ratio, coff=pack.coff, device=device)
    op.compile()
    op.execute(*pack.inputs, out)
    grads = execute_backward(pack.inputs, pack.grad_out, [torch.empty_like(t) for t in pack.inputs[:3]],
                             pack.ratio, pack.coff)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    on_side = _run_wrappers(pack, stream=side)
    torch.cuda.current_stream(device).wait_stream(side)
    copies = leaves(pack.kv, pack.score, pack.ape)
    pooled = csa_compress(*copies, pack.cu_seqlens, pack.cu_seqlens_comp, ratio=pack.ratio, coff=pack.coff,
                          total_comp=pack.total_comp)
    (pooled.float() * pack.grad_out.float()).sum().backward()
    return results + [out, *grads] + list(on_side) + [pooled.detach()] + [t.grad for t in copies]


@pytest.mark.L0
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("ratio", [4, 64])
def test_second_gpu_while_the_first_is_current(ratio):
    """Tensors on cuda:1 with cuda:0 current run on cuda:1 (nothing lands on cuda:0) and give the
    bits a run on cuda:0 gives."""
    runs = {}
    for index in (1, 0):
        pack = make_pack([9 * ratio + 3, 0, ratio - 1, 4 * ratio], ratio, 2, 128, extra_tokens=2, extra_rows=2,
                         seed=7, device=f"cuda:{index}")
        with torch.cuda.device(0):
            on_first = torch.cuda.memory_allocated(0)
            runs[index] = _every_route(pack)
            torch.cuda.synchronize(index)
            assert torch.cuda.current_device() == 0
            if index == 1:
                assert torch.cuda.memory_allocated(0) == on_first
        assert all(t.device == pack.kv.device for t in runs[index])
        assert_like_reference(pack, runs[index][0], runs[index][1:4])
    for got, want in zip(runs[1], runs[0]):
        assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.L0
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("ratio", [4, 64])
def test_tensors_split_over_two_gpus_are_refused_after_the_fast_path_is_primed(ratio):
    """The fast path leaves the one-device check to the compiled entry point; a pack whose
    tensors are spread over cuda:0 and cuda:1 must still get the named error, for the wrappers
    and the classes, and nothing may run."""
    pack = make_pack([9 * ratio + 3, 4 * ratio], ratio, 2, 128, seed=3, device="cuda:1")
    kw = dict(ratio=ratio, coff=2)
    out = csa_compressor_forward_wrapper(*pack.inputs, total_comp=pack.total_comp, **kw)["out"]
    grads = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, **kw)
    fwd = CSACompressorForward(*pack.inputs, out, **kw)
    fwd.compile()
    kv, score, ape, cu, comp = pack.inputs
    for index, moved in enumerate((score, ape, cu, comp)):
        inputs = [kv, score, ape, cu, comp]
        inputs[index + 1] = moved.to("cuda:0")
        name = ("score", "ape", "cu_seqlens", "cu_seqlens_comp")[index]
        with pytest.raises(ValueError, match=name):
            csa_compressor_forward_wrapper(*inputs, total_comp=pack.total_comp, **kw)
        with pytest.raises(ValueError, match=name):
            csa_compressor_backward_wrapper(*inputs, pack.grad_out, **kw)
        kept = out.clone()
        with pytest.raises(ValueError, match=name):
            fwd.execute(*inputs, out)
        assert torch.equal(out, kept)
    with pytest.raises(ValueError, match="grad_out"):
        csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out.to("cuda:0"), **kw)
    with pytest.raises(ValueError, match="out"):
        fwd.execute(*pack.inputs, out.to("cuda:0"))
    assert torch.equal(csa_compressor_forward_wrapper(*pack.inputs, total_comp=pack.total_comp, **kw)["out"], out)
    for got, want in zip(csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, **kw), grads):
        assert torch.equal(got, want)


@pytest.mark.L0
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_stream_of_another_device_is_rejected():
    pack = make_pack([9, 6], 4, 2, 64, device="cuda:1")
    other = torch.cuda.Stream(device=0)
    message = r"stream: expected a stream of cuda:1 \(the device of kv\), got one of cuda:0"
    with pytest.raises(ValueError, match=message):
        csa_compressor_forward_wrapper(*pack.inputs, total_comp=pack.total_comp, stream=other)
    out = torch.empty(pack.total_comp, 64, dtype=torch.bfloat16, device="cuda:1")
    op = CSACompressorForward(*pack.inputs, out, ratio=4, coff=2)
    op.compile()
    with pytest.raises(ValueError, match=message):
        op.execute(*pack.inputs, out, current_stream=other)


# -- extents at the int32 limit ------------------------------------------------------------------------

def _need_free_memory(nbytes):
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes:
        pytest.skip(f"needs {nbytes / GiB:.0f} GiB of free device memory, {free / GiB:.0f} GiB free")


def _slice_reference(kv, score, ape, grad_out, cu, comp, row, ratio, coff):
    """(out row, {(token, column): grad_kv, grad_score}) of output ``row`` from the reference run on a
    small pack holding just that row's window: one segment from the previous block (coff 2, not
    a first block) to the end of the row's own block. Rows past cu_seqlens_comp[-1] are padding
    (segment 0's first block) and get no gradients."""
    used = comp[-1]
    segment = 0 if row >= used else max(s for s in range(len(comp) - 1) if comp[s] <= row < comp[s + 1])
    block = 0 if row >= used else row - comp[segment]
    prev = 1 if coff == 2 and block > 0 else 0
    lo, n = cu[segment] + (block - prev) * ratio, (prev + 1) * ratio
    s_cu, s_comp = offsets([n], ratio)
    args = (kv[lo:lo + n], score[lo:lo + n], ape, s_cu.to(kv.device), s_comp.to(kv.device))
    out = reference_forward(*args, ratio, coff)[prev]
    if row >= used:
        return out, None
    gkv, gs, _ = reference_backward(*args, grad_out[row - prev:row + 1], ratio, coff)
    d = kv.shape[1] // coff
    own = slice(d, 2 * d) if coff == 2 else slice(0, d)
    tokens = slice(lo + prev * ratio, lo + n)
    window = [((tokens, own), (slice(prev * ratio, n), own))]
    if prev:
        window.append(((slice(lo, lo + ratio), slice(0, d)), (slice(0, ratio), slice(0, d))))
    return out, [(big, gkv[small], gs[small]) for big, small in window]


def _nan_filled_run(inputs, out, grad_out, ratio, coff):
    """Both classes on NaN-filled outputs; returns (grad_kv, grad_score, grad_ape)."""
    execute_forward(inputs, out, ratio, coff)
    return execute_backward(inputs, grad_out, [torch.full_like(t, math.nan) for t in inputs[:3]], ratio, coff)


def check_token_extent(tokens, device):
    """A pack of ``tokens`` tokens (r4 c2 d128): a long segment, a short one, one across the middle
    of kv and one to its end, then one spare token. Every output element is written; rows
    anywhere, the last ones included, match the reference on a slice; never-consumed slots at
    the very end are zeros."""
    ratio, coff, head_dim = 4, 2, 128
    cols = coff * head_dim
    lengths = [1000, 3, tokens // 2 // ratio * ratio]
    lengths.append(tokens - 1 - sum(lengths))
    cu, comp = (t.tolist() for t in offsets(lengths, ratio))
    kv = torch.randn(tokens, cols, dtype=torch.bfloat16, device=device)
    score = torch.randn(tokens, cols, dtype=torch.bfloat16, device=device).mul_(2)
    ape = 0.5 * torch.randn(ratio, cols, device=device)
    cu_t, comp_t = (torch.tensor(v, dtype=torch.int32, device=device) for v in (cu, comp))
    total = comp[-1] + 2
    out = torch.full((total, head_dim), math.nan, dtype=torch.bfloat16, device=device)
    grad_out = torch.randn(total, head_dim, dtype=torch.bfloat16, device=device)
    grads = _nan_filled_run((kv, score, ape, cu_t, comp_t), out, grad_out, ratio, coff)
    for name, t in zip(("out", "grad_kv", "grad_score", "grad_ape"), (out, *grads)):
        assert not bool(t.isnan().any()), f"{name}: elements left unwritten"

    def row_of(token):
        s = max(i for i in range(len(lengths)) if cu[i] <= token)
        return comp[s] + (token - cu[s]) // ratio

    middle = (tokens + 1) // 2  # at the limit, the token whose kv row starts at byte offset 2**31
    rows = {0, comp[1] - 1, comp[3] - 1, total - 1}
    rows |= {row_of(t) for t in (tokens // 4, middle - 1, middle, middle + 5, 3 * tokens // 4, tokens - 8)}
    for row in sorted(rows):
        want, slots = _slice_reference(kv, score, ape, grad_out, cu, comp, row, ratio, coff)
        assert_contract(f"out[{row}]", out[row], want, "window", rounded_sum=True)
        for big, want_kv, want_s in slots or []:
            assert torch.equal(grads[0][big], want_kv) and torch.equal(grads[1][big], want_s), f"row {row}"
    last_full = cu[-1] - (lengths[-1] % ratio)
    for t in grads[:2]:  # the last segment's tail, the spare token and its last block's first half
        assert not bool(t[last_full:].any()) and not bool(t[last_full - ratio:last_full, :head_dim].any())
    return rows


@pytest.mark.L1
def test_token_extent_just_below_the_int32_limit_runs():
    """kv holds 2**31 - 256 elements: 4 GiB, so byte offsets pass 2**31 half way in."""
    _need_free_memory(24 * GiB)  # kv, score, grad_kv, grad_score at 4 GiB each, plus temporaries
    check_token_extent(INT32_LIMIT // 256 - 1, "cuda")


def check_row_extent(rows, device):
    """``rows`` output rows of which all but a few are padding (r4 c2 d128): each padding row
    equals segment 0's first block, and backward ignores their incoming gradients (NaN here)."""
    ratio, coff, head_dim = 4, 2, 128
    pack = make_pack([300, 0, 77, 1024], ratio, coff, head_dim, extra_tokens=3, device=device)
    used = pack.used_rows
    out = torch.full((rows, head_dim), math.nan, dtype=torch.bfloat16, device=device)
    grad_out = torch.full((rows, head_dim), math.nan, dtype=torch.bfloat16, device=device)
    grad_out[:used] = pack.grad_out
    grads = _nan_filled_run(pack.inputs, out, grad_out, ratio, coff)
    small = csa_compressor_forward_wrapper(*pack.inputs, ratio=ratio, total_comp=used + 1)["out"]
    assert torch.equal(out[:used + 1], small)
    assert bool((out[used:] == out[used]).all())
    assert_contract("out", small, reference_forward(*pack.inputs, ratio, coff, used + 1), "window", rounded_sum=True)
    want = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=ratio)
    assert torch.equal(grads[0], want["grad_kv"]) and torch.equal(grads[1], want["grad_score"])
    torch.testing.assert_close(grads[2], want["grad_ape"], rtol=1e-5, atol=1e-5 * float(want["grad_ape"].abs().max()))


@pytest.mark.L1
def test_row_extent_just_below_the_int32_limit_runs():
    """out and grad_out hold 2**31 - 128 elements (4 GiB each)."""
    _need_free_memory(16 * GiB)
    check_row_extent(INT32_LIMIT // 128 - 1, "cuda")
