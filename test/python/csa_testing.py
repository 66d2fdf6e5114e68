"""Helpers shared by the test suites: random packs, an independent loop-based pooling, error
metrics and the L0/L1 parametrisation."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List

import pytest
import torch

RATIOS = (1, 2, 3, 4, 8, 16, 128, 256)
COFFS = (1, 2)
HEAD_DIMS = (1, 64, 65, 128, 512)
PACK_KINDS = ("one", "ragged", "empty", "short", "padding")

# bf16 keeps 8 significant bits: one rounding of an fp32 value is within 2**-8 relative, and an
# fp32 path may land one bf16 step away from a correctly rounded fp64 value.
BF16_STEP = 2.0**-7


def pack_layout(kind: str, ratio: int):
    """(segment lengths, tokens after cu_seqlens[-1], padding rows) of a pack kind. Sizes are odd
    and scale with the ratio so every kind has a handful of rows at any ratio."""
    r = ratio
    return {
        "one": ([3 * r + r // 2 + 1], 0, 0),                 # one segment with a tail
        "ragged": ([2 * r + 1, 2 * r - 1, 3 * r], 0, 0),     # tails of different lengths
        "empty": ([0, r + 2, 0, 2 * r], 0, 0),               # empty segments, also the first
        "short": ([max(r - 1, 1), 2 * r + 1, max(r // 2, 1)], 0, 0),  # shorter than ratio
        "padding": ([r + 1, 2 * r], 5, 3),                   # spare tokens and static capacity
    }[kind]


@dataclass
class Pack:
    ratio: int
    coff: int
    head_dim: int
    lengths: List[int]
    kv: torch.Tensor
    score: torch.Tensor
    ape: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_comp: torch.Tensor
    grad_out: torch.Tensor
    total_comp: int
    extra: Dict[str, object] = field(default_factory=dict)

    @property
    def inputs(self):
        return self.kv, self.score, self.ape, self.cu_seqlens, self.cu_seqlens_comp

    @property
    def used_rows(self) -> int:
        return int(self.cu_seqlens_comp[-1])

    def to(self, device) -> "Pack":
        moved = {k: getattr(self, k).to(device) for k in
                 ("kv", "score", "ape", "cu_seqlens", "cu_seqlens_comp", "grad_out")}
        return Pack(self.ratio, self.coff, self.head_dim, self.lengths, total_comp=self.total_comp, **moved)


def offsets(lengths, ratio):
    cu = [0]
    comp = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
        comp.append(comp[-1] + n // ratio)
    return torch.tensor(cu, dtype=torch.int32), torch.tensor(comp, dtype=torch.int32)


def make_pack(lengths, ratio: int, coff: int, head_dim: int, extra_tokens: int = 0, extra_rows: int = 0,
              seed: int = 0, device="cpu", score_scale: float = 2.0) -> Pack:
    """Fresh random inputs (never zeros) for a pack of segments of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    cu, comp = offsets(lengths, ratio)
    num_tokens = int(cu[-1]) + extra_tokens
    cols = coff * head_dim
    total_comp = int(comp[-1]) + extra_rows

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    pack = Pack(
        ratio, coff, head_dim, list(lengths),
        kv=randn(num_tokens, cols).bfloat16(),
        score=randn(num_tokens, cols, scale=score_scale).bfloat16(),
        ape=randn(ratio, cols, scale=0.5),
        cu_seqlens=cu, cu_seqlens_comp=comp,
        grad_out=randn(total_comp, head_dim).bfloat16(),
        total_comp=total_comp,
    )
    return pack if str(device) == "cpu" else pack.to(device)


def make_kind(kind: str, ratio: int, coff: int, head_dim: int, seed: int = 0, device="cpu") -> Pack:
    lengths, extra_tokens, extra_rows = pack_layout(kind, ratio)
    return make_pack(lengths, ratio, coff, head_dim, extra_tokens, extra_rows, seed=seed, device=device)


# -- an independent pooling, written from the SPEC text with plain loops ---------------------------

def window_positions(first_token: int, is_first_block: bool, ratio: int, coff: int, head_dim: int, j: int):
    """[(token, column, ape_row)] of output column j, or None for an invalid position."""
    positions = []
    if coff == 2:
        for k in range(ratio):
            positions.append(None if is_first_block else (first_token - ratio + k, j, k))
        for k in range(ratio):
            positions.append((first_token + k, head_dim + j, k))
    else:
        for k in range(ratio):
            positions.append((first_token + k, j, k))
    return positions


def loop_pooling(pack: Pack):
    """float64 forward and backward by plain Python loops over rows, columns and positions.
    Returns out, grad_kv, grad_score, grad_ape (nested lists) and the set of consumed slots."""
    r, coff, d = pack.ratio, pack.coff, pack.head_dim
    kv, score, ape = pack.kv.float().tolist(), pack.score.float().tolist(), pack.ape.tolist()
    g_out = pack.grad_out.float().tolist()
    cu, comp = pack.cu_seqlens.tolist(), pack.cu_seqlens_comp.tolist()
    num_tokens = len(kv)
    out = [[0.0] * d for _ in range(pack.total_comp)]
    grad_kv = [[0.0] * (coff * d) for _ in range(num_tokens)]
    grad_score = [[0.0] * (coff * d) for _ in range(num_tokens)]
    grad_ape = [[0.0] * (coff * d) for _ in range(r)]
    consumed = set()

    rows = []  # (row, first token, first block?, receives gradient?)
    for s in range(len(cu) - 1):
        for b in range((cu[s + 1] - cu[s]) // r):
            rows.append((comp[s] + b, cu[s] + b * r, b == 0, True))
    for row in range(comp[-1], pack.total_comp):
        rows.append((row, 0, True, False))

    for row, first, is_first, grads in rows:
        for j in range(d):
            pos = window_positions(first, is_first, r, coff, d, j)
            s_vals = [-math.inf if p is None else score[p[0]][p[1]] + ape[p[2]][p[1]] for p in pos]
            x_vals = [0.0 if p is None else kv[p[0]][p[1]] for p in pos]
            m = max(s_vals)
            e = [math.exp(v - m) for v in s_vals]
            den = sum(e)
            p_vals = [v / den for v in e]
            out[row][j] = sum(x * p for x, p in zip(x_vals, p_vals))
            if not grads:
                continue
            g = g_out[row][j]
            total = sum(g * x * p for x, p in zip(x_vals, p_vals))
            for p_pos, x, p in zip(pos, x_vals, p_vals):
                if p_pos is None:
                    continue
                tok, col, arow = p_pos
                assert (tok, col) not in consumed, f"slot {(tok, col)} consumed twice"
                consumed.add((tok, col))
                gs = p * g * x - p * total
                grad_kv[tok][col] = g * p
                grad_score[tok][col] = gs
                grad_ape[arow][col] += gs
    as64 = lambda v: torch.tensor(v, dtype=torch.float64).reshape(len(v), -1)  # noqa: E731
    return as64(out), as64(grad_kv), as64(grad_score), as64(grad_ape), consumed


def consumed_mask(pack: Pack, consumed) -> torch.Tensor:
    mask = torch.zeros(pack.kv.shape, dtype=torch.bool)
    for tok, col in consumed:
        mask[tok, col] = True
    return mask


# -- metrics ----------------------------------------------------------------------------------------

def max_abs_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.numel() == 0:
        return 0.0
    return float((actual.double() - expected.double()).abs().max())


def assert_close_bf16(actual: torch.Tensor, expected: torch.Tensor, name: str, atol: float = 1e-5) -> None:
    """Within one bf16 step of an fp64 value (plus a small absolute slack for cancellation)."""
    diff = (actual.double().cpu() - expected.double().cpu()).abs()
    bound = BF16_STEP * expected.double().cpu().abs() + atol
    bad = diff > bound
    assert not bad.any(), (f"{name}: {int(bad.sum())} elements beyond one bf16 step, worst "
                           f"{float((diff - bound).max()):.3g} over the bound")


def assert_positive_zero(t: torch.Tensor, mask: torch.Tensor, name: str) -> None:
    """Elements under ``mask`` are exactly +0.0."""
    sel = t[mask.to(t.device)]
    assert bool((sel == 0).all()) and not bool(torch.signbit(sel.float()).any()), \
        f"{name}: never-consumed slots are not all +0.0"


# -- parametrisation ------------------------------------------------------------------------------

def leveled(cases, smoke) -> list:
    """pytest params of ``cases``, marked L0 when ``smoke(case)`` is true, else L1."""
    params = []
    for case in cases:
        case = case if isinstance(case, tuple) else (case,)
        mark = pytest.mark.L0 if smoke(*case) else pytest.mark.L1
        params.append(pytest.param(*case, marks=mark, id="-".join(map(str, case))))
    return params


def sentinel_like(t: torch.Tensor) -> torch.Tensor:
    """A buffer of t's shape filled with a recognisable value, to prove it stays untouched."""
    return torch.full_like(t, -7)


# -- calls ----------------------------------------------------------------------------------------

def leaves(*tensors) -> List[torch.Tensor]:
    """Fresh leaf copies that require grad."""
    return [t.detach().clone().requires_grad_() for t in tensors]


def execute_forward(inputs, out, ratio: int, coff: int, stream=None):
    """CSACompressorForward planned from the call's own tensors, compiled and executed; ``out``."""
    from csa_frontend import CSACompressorForward

    op = CSACompressorForward(*inputs, out, ratio=ratio, coff=coff)
    op.compile()
    op.execute(*inputs, out, current_stream=stream)
    return out


def execute_backward(inputs, grad_out, grads, ratio: int, coff: int, stream=None):
    """CSACompressorBackward planned from the call's own tensors, compiled and executed; ``grads``."""
    from csa_frontend import CSACompressorBackward

    op = CSACompressorBackward(*inputs, grad_out, *grads, ratio=ratio, coff=coff)
    op.compile()
    op.execute(*inputs, grad_out, *grads, current_stream=stream)
    return grads


# -- the numerics contract of whichever path produced a result ------------------------------------

def kernel_family(pack: Pack, direction: str) -> str:
    """"reference" for CPU tensors (the API runs the fp32 reference there), else the fused kernel
    family ("window" or "stream") that serves the pack's configuration in ``direction``."""
    if pack.kv.device.type == "cpu":
        return "reference"
    from csa_frontend.compressor.kernels.schedule import choose_schedule

    return choose_schedule(pack.ratio, pack.coff, pack.head_dim, direction).family


def assert_contract(name: str, got: torch.Tensor, want: torch.Tensor, family: str, rounded_sum: bool) -> None:
    """``got`` against the fp32 reference ``want`` under the contract of ``family``.

    Non-finite values must match exactly (NaN where NaN, the same infinities). Finite values: the
    reference path is the reference; register-window kernels match it bit for bit except for
    ``out`` (``rounded_sum``), which may be one bf16 step away; stream kernels may differ in
    max(1, 0.1%) of the elements, each by at most 1.6e-2.
    """
    got, want = got.float(), want.float()
    if family == "reference" or (family == "window" and not rounded_sum):
        rtol, atol = 0.0, 0.0
    elif family == "window":
        rtol, atol = BF16_STEP, 1e-5  # one bf16 step is at most 2**-7 of the value
    else:
        rtol, atol = 0.0, 1.6e-2
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{name}: {m}")
    if family == "stream":
        differ = int(((got != want) & ~(got.isnan() & want.isnan())).sum())
        assert differ <= max(1, want.numel() // 1000), f"{name}: {differ} of {want.numel()} elements differ"


def assert_grad_ape_contract(got: torch.Tensor, want: torch.Tensor, family: str) -> None:
    """grad_ape sums over every row, in the kernels' own fixed order: relative to its largest
    finite element, 1e-5 for window kernels and 1e-4 for stream kernels."""
    finite = want[torch.isfinite(want)]
    scale = float(finite.abs().max()) if finite.numel() else 1.0
    rtol = {"reference": 0.0, "window": 1e-5}.get(family, 1e-4)
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * scale, equal_nan=True,
                               msg=lambda m: f"grad_ape: {m}")


def assert_like_reference(pack: Pack, out: torch.Tensor, grads) -> None:
    """``out`` (pack.total_comp rows) and ``(grad_kv, grad_score, grad_ape)`` for ``pack.grad_out``
    against the fp32 reference run on the same device, under the contract of the path used."""
    from csa_frontend.compressor.reference import reference_backward, reference_forward

    ref_out = reference_forward(*pack.inputs, pack.ratio, pack.coff, pack.total_comp)
    ref_grads = reference_backward(*pack.inputs, pack.grad_out, pack.ratio, pack.coff)
    assert_contract("out", out, ref_out, kernel_family(pack, "fwd"), rounded_sum=True)
    family = kernel_family(pack, "bwd")
    for name, got, want in zip(("grad_kv", "grad_score"), grads, ref_grads):
        assert_contract(name, got, want, family, rounded_sum=False)
    assert_grad_ape_contract(grads[2], ref_grads[2], family)


# -- concurrency ----------------------------------------------------------------------------------

#: (ratio, coff, head_dim) the thread-safety tests mix: small and odd ratios, both window forms,
#: two head dims, and a ratio the stream kernel family serves on CUDA.
THREAD_CONFIGS = ((1, 2, 64), (3, 1, 128), (4, 2, 128), (64, 2, 128))


def run_concurrently(n_threads: int, work):
    """``[work(0), ..., work(n_threads - 1)]``, each on its own thread, all released at once by a
    barrier so first calls race; the first exception of any thread is re-raised here."""
    import threading

    barrier = threading.Barrier(n_threads)
    results = [None] * n_threads
    errors = [None] * n_threads

    def run(i):
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            errors[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for err in errors:
        if err is not None:
            raise err
    return results


def concurrent_wrapper_calls(device, n_threads: int = 8, side_streams: bool = False):
    """Thread i runs forward and backward wrappers of ``THREAD_CONFIGS[i % 4]`` on three packs of
    its own (token and segment counts differ per pack). With ``side_streams`` the upper half of
    the threads launch on a ``torch.cuda.Stream`` of their own. Returns ``[(pack, out, grads)]``
    once every launch is complete."""
    from csa_frontend import csa_compressor_backward_wrapper, csa_compressor_forward_wrapper

    packs = [[make_kind(kind, *THREAD_CONFIGS[i % len(THREAD_CONFIGS)], seed=10 * i + k, device=device)
              for k, kind in enumerate(("ragged", "empty", "padding"))] for i in range(n_threads)]
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda:
        torch.cuda.synchronize()

    def work(i):
        stream = torch.cuda.Stream() if side_streams and 2 * i >= n_threads else None
        done = []
        for pack in packs[i]:
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())
            kw = dict(ratio=pack.ratio, coff=pack.coff, stream=stream)
            out = csa_compressor_forward_wrapper(*pack.inputs, total_comp=pack.total_comp, **kw)["out"]
            grads = tuple(csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, **kw))
            done.append((pack, out, grads))
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        return done

    results = run_concurrently(n_threads, work)
    if on_cuda:
        torch.cuda.synchronize()
    return [item for per_thread in results for item in per_thread]


def compile_log_descriptions(records) -> List[str]:
    """Operator descriptions of the API's "compiled ..." log records, one per compile."""
    return [r.args[0] for r in records
            if r.getMessage().startswith("compiled CSACompressor") and isinstance(r.args, tuple)]


# -- malformed offset contents ------------------------------------------------------------------

#: ratio 4: cu_seqlens [0, 9, 9, 15, 28], cu_seqlens_comp [0, 2, 2, 3, 6], T = 30, total_comp 7.
OFFSET_BASE = dict(lengths=[9, 0, 6, 13], ratio=4, coff=2, head_dim=64, extra_tokens=2, extra_rows=1)

#: (cu_seqlens edits, cu_seqlens_comp edits, total_comp or None, message pattern): each names the
#: first bad index, also where a later index is wrong too.
BAD_OFFSETS = [
    pytest.param({0: 1}, {}, None, r"cu_seqlens: expected cu_seqlens\[0\] == 0, got 1", id="cu-start"),
    pytest.param({2: 5, 3: 4}, {}, None,
                 r"cu_seqlens: expected non-decreasing offsets, got cu_seqlens\[2\] = 5 < cu_seqlens\[1\] = 9",
                 id="cu-decreasing"),
    pytest.param({3: 31, 4: 32}, {}, None, r"cu_seqlens: expected cu_seqlens\[3\] <= T = kv.shape\[0\] = 30 "
                 r"\(offsets end at or below the token count\), got 31", id="cu-beyond-T"),
    pytest.param({}, {0: 1}, None, r"cu_seqlens_comp: expected cu_seqlens_comp\[0\] == 0 .*, got 1", id="comp-start"),
    pytest.param({}, {2: 3, 4: 7}, None, r"cu_seqlens_comp: expected cu_seqlens_comp\[2\] == 2 \(running sum of "
                 r"seqlen // ratio over cu_seqlens, ratio=4\), got 3", id="comp-mismatch"),
    pytest.param({}, {}, 5, r"(total_comp|out\.shape\[0\]|grad_out\.shape\[0\]): expected total_comp >= "
                 r"cu_seqlens_comp\[-1\] = 6, got 5", id="total_comp-short"),
]


def bad_offset_pack(cu_edits, comp_edits, total_comp, device) -> Pack:
    """The OFFSET_BASE pack on ``device`` with offsets edited; ``total_comp`` None keeps 7."""
    base = dict(OFFSET_BASE)
    pack = make_pack(base.pop("lengths"), **base, seed=3)
    for t, edits in ((pack.cu_seqlens, cu_edits), (pack.cu_seqlens_comp, comp_edits)):
        for index, value in edits.items():
            t[index] = value
    if total_comp is not None:
        pack.total_comp = total_comp
        pack.grad_out = pack.grad_out[:total_comp].contiguous()
    return pack if str(device) == "cpu" else pack.to(device)


def offset_reading_routes(pack: Pack, validate):
    """``[(route, run, outputs)]``: every public route that reads the offsets, with ``validate``
    (None defers to CSA_FRONTEND_VALIDATE, and adds csa_compress, which has no such argument).
    ``outputs`` are the caller's buffers ``run`` writes, to prove a rejection leaves them alone."""
    from csa_frontend import (CSACompressorBackward, CSACompressorForward, csa_compress,
                              csa_compressor_backward_wrapper, csa_compressor_forward_wrapper)

    kw = dict(ratio=pack.ratio, coff=pack.coff, validate=validate)
    out = sentinel_like(torch.empty(pack.total_comp, pack.head_dim, dtype=torch.bfloat16, device=pack.kv.device))
    grads = [sentinel_like(t) for t in (pack.kv, pack.score, pack.ape)]
    fwd = CSACompressorForward(*pack.inputs, out, **kw)
    bwd = CSACompressorBackward(*pack.inputs, pack.grad_out, *grads, **kw)

    def run_class(op, *args):
        op.compile()
        op.execute(*pack.inputs, *args)

    routes = [
        ("forward wrapper", lambda: csa_compressor_forward_wrapper(*pack.inputs, total_comp=pack.total_comp, **kw),
         []),
        ("backward wrapper", lambda: csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, **kw), []),
        ("forward class", lambda: run_class(fwd, out), [out]),
        ("backward class", lambda: run_class(bwd, pack.grad_out, *grads), grads),
    ]
    if validate is None:
        routes.append(("csa_compress", lambda: csa_compress(*pack.inputs, ratio=pack.ratio, coff=pack.coff,
                                                            total_comp=pack.total_comp), []))
    return routes


def assert_offsets_rejected(pack: Pack, validate, message: str) -> None:
    """Every offset-reading route raises ValueError matching ``message``; outputs untouched."""
    for route, run, outputs in offset_reading_routes(pack, validate):
        before = [t.clone() for t in outputs]
        with pytest.raises(ValueError, match=message):
            run()
        for t, b in zip(outputs, before):
            assert torch.equal(t, b), f"{route}: an output was written before the rejection"


def forget_plans() -> None:
    """Empty the planner's and the compiler's caches, so that a knob the planner reads (changed
    by a test) takes effect and does not leak into the next test."""
    from csa_frontend.compressor.kernels import dispatch, schedule
    schedule.choose_schedule.cache_clear()
    dispatch.clear_cache()
