"""A small, representative set of fused-kernel launches for compute-sanitizer (see sanitize.sh).

Each case runs forward and backward through the public wrappers, whose outputs and gradients
come from ``torch.empty`` (so initcheck sees any read of an element no kernel wrote), on packs
with empty segments, segments shorter than ratio, tails, tokens past ``cu_seqlens[-1]`` and
padding rows; then a side-stream call and a pack without output rows. Results are checked
against the fp32 reference loosely: the numerics contract is the pytest suites' job, this
script only has to make sure the launches it sanitizes did real work.

    python test/python/gpu/sanitize_cases.py      # exits non-zero on a failed check
"""
import sys
from contextlib import contextmanager

import torch

from csa_frontend import csa_compressor_backward_wrapper, csa_compressor_forward_wrapper
from csa_frontend.compressor.reference import reference_backward, reference_forward
from packs import edge_lengths, offsets, random_inputs

# (ratio, coff, head_dim): register-window production shape, odd head_dim (scalar accesses) on
# the own-block window, head_dim 2 (256 row lanes per backward CTA: the slab's lane sum as a
# runtime loop), a forward window past the values budget at vec 2 (r7 c2: 14 positions), and
# ratios served by the stream family (their packs are small enough for the serial forward; r48
# c2: a 384-thread backward CTA, chunks padded to whole warps, one per SM);
# main() adds the families' own forwards, the bulk-copy forward and both families' interleaved
# backward row walks.
CASES = [(4, 2, 128), (3, 1, 65), (4, 2, 2), (7, 2, 128), (64, 2, 128), (128, 2, 64), (32, 1, 64), (48, 2, 64)]
SPARE_TOKENS, PADDING_ROWS = 3, 2
#: (label, knobs, case): schedules that long launches take, forced onto a few CTAs of many rows
FORCED_WALKS = [
    # the register-window backward's interleaved row walk (every step a new lookup)
    ("interleaved backward rows", dict(WINDOW_BWD_INTERLEAVE="1", BWD_TARGET_CTAS=3), (4, 2, 512)),
    # the register window's wide (16-byte) backward of long coff-1 launches, at any row count:
    # 65 column threads x 3 row lanes
    ("wide register-window backward", dict(WINDOW_BWD_WIDE_MIN_ROWS=1, BWD_TARGET_CTAS=3), (4, 1, 520)),
    # the stream backward's interleaved row walk (compiled into coff 1, and into coff 2 but STREAM_BWD_WALK_SPILLS)
    ("interleaved stream backward rows", dict(STREAM_BWD_INTERLEAVE="1", STREAM_GRID_SMS=3), (32, 1, 64)),
    # (2 column tiles: 6 SMs' worth is 3 row CTAs)
    ("interleaved coff-2 stream backward rows", dict(STREAM_BWD_INTERLEAVE="1", STREAM_GRID_SMS=6), (64, 2, 128)),
    # the stream forward's interleaved row walk (compiled into coff 1; the serial and online forwards off)
    ("interleaved stream forward rows", dict(STREAM_FWD_INTERLEAVE="1", STREAM_FWD_GRID_SMS=3, SERIAL_FWD_MAX_OUTPUTS=0,
                                             STREAM_FWD_ONLINE_WINDOW=0), (32, 1, 64)),
]
#: knobs read when a schedule is planned (cached), not when a launch is
PLANNER_KNOBS = {"STREAM_FWD_ONLINE_WINDOW"}
#: stream configurations of CASES run again on launches of rows * ratio == tokens (``whole_launch``)
GUESS_CASES = [(64, 2, 128), (128, 2, 64), (32, 1, 64)]


def run_case(ratio, coff, head_dim, stream=None, repeat=1, deterministic=True, whole_launch=False,
             compute_grad_ape=True):
    """``whole_launch``: kv and the output rows sized so that rows * ratio == tokens, where the
    stream kernels request their first rows before their lookups (``STREAM_FWD_GUESS``,
    ``STREAM_BWD_GUESS``); the pack's tails and padding rows make some of those guesses wrong."""
    gen = torch.Generator(device="cuda").manual_seed(ratio + coff)
    cu, comp = offsets(edge_lengths(ratio) * repeat, ratio)
    total = int(comp[-1]) + PADDING_ROWS
    n_tok = int(cu[-1]) + SPARE_TOKENS
    if whole_launch:
        total = max(total, -(-n_tok // ratio))
        n_tok = total * ratio
    kv, score, ape = random_inputs(n_tok, ratio, coff, head_dim, generator=gen)
    grad_out = torch.randn(total, head_dim, device="cuda", generator=gen).to(torch.bfloat16)
    kw = dict(ratio=ratio, coff=coff, stream=stream)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    out = csa_compressor_forward_wrapper(kv, score, ape, cu, comp, total_comp=total, **kw)["out"]
    grads = csa_compressor_backward_wrapper(kv, score, ape, cu, comp, grad_out, deterministic=deterministic,
                                            compute_grad_ape=compute_grad_ape, **kw)
    if stream is not None:
        torch.cuda.current_stream().wait_stream(stream)
    want = (reference_forward(kv, score, ape, cu, comp, ratio, coff, total),
            *reference_backward(kv, score, ape, cu, comp, grad_out, ratio, coff))
    for name, got, ref in zip(("out", "grad_kv", "grad_score", "grad_ape"), (out, *grads), want):
        if got is None:  # grad_ape of a frozen ape
            continue
        ref = ref.float()
        torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2 * max(1.0, float(ref.abs().max())),
                                   msg=lambda m: f"r{ratio} c{coff} d{head_dim} {name}: {m}")


def run_empty(ratio=4, coff=2, head_dim=128):
    """Every segment shorter than ratio: no rows, nothing launched forward, zero gradients."""
    cu, comp = offsets([ratio - 1, 0, 1], ratio)
    kv, score, ape = random_inputs(int(cu[-1]), ratio, coff, head_dim)
    out = csa_compressor_forward_wrapper(kv, score, ape, cu, comp, ratio=ratio, coff=coff, total_comp=0)["out"]
    grads = csa_compressor_backward_wrapper(kv, score, ape, cu, comp, out.new_empty(0, head_dim), ratio=ratio,
                                            coff=coff)
    assert out.shape == (0, head_dim) and not any(bool(g.any()) for g in grads)


@contextmanager
def knobs(**values):
    """The schedule module's tuning knobs set to ``values`` for the block, restored after it.
    Knobs the planner reads (``PLANNER_KNOBS``) empty its and the compile caches on both sides."""
    from csa_frontend.compressor.kernels import dispatch, schedule
    saved = {name: getattr(schedule, name) for name in values}

    def apply(settings):
        for name, value in settings.items():
            setattr(schedule, name, value)
        if PLANNER_KNOBS & settings.keys():
            schedule.choose_schedule.cache_clear()
            dispatch.clear_cache()

    apply(values)
    try:
        yield
    finally:
        apply(saved)


def main():
    for case in CASES:
        run_case(*case)
        print(f"r{case[0]} c{case[1]} d{case[2]}: ok", flush=True)
    # these packs are small enough for the serial forward: the families' own forwards too
    with knobs(SERIAL_FWD_MAX_OUTPUTS=0):
        for case in CASES:
            run_case(*case)
            print(f"r{case[0]} c{case[1]} d{case[2]} (the family's forward): ok", flush=True)
        # the stream kernels' first-row guesses, right ones and wrong ones (tails, padding rows)
        for case in GUESS_CASES:
            run_case(*case, repeat=3, whole_launch=True)
        print("stream forwards of rows * ratio == tokens launches: ok", flush=True)
        # r32 c1 d64's window through the pipelined forward (the online forward off), every warp combining
        with knobs(STREAM_FWD_ONLINE_WINDOW=0):
            run_case(32, 1, 64)
            run_case(32, 1, 64, repeat=3, whole_launch=True)
        print("r32 c1 d64 (the pipelined stream forward of a short window): ok", flush=True)
    # small packs take the stream backward's few-rows schedule: the default one too
    from csa_frontend.compressor.kernels import schedule
    with knobs(STREAM_BWD_FEW_ROWS=0):
        for case in [c for c in CASES if schedule.few_rows_schedule(*c) is not None]:
            run_case(*case)
            print(f"r{case[0]} c{case[1]} d{case[2]} (default backward schedule): ok", flush=True)
        for case in GUESS_CASES:
            run_case(*case, repeat=3, whole_launch=True)
        print("default stream backwards of rows * ratio == tokens launches: ok", flush=True)
    # the bulk-copy forward (sm_90+) at any row count, three CTAs each wrapping its stage ring
    if schedule.bulk_forward_schedule(2, 2, 512, "sm_90a") is not None and torch.cuda.get_device_capability() >= (9, 0):
        with knobs(WINDOW_FWD_BULK_MIN_STAGES=1, WINDOW_FWD_BULK_CTAS=3):
            run_case(2, 2, 512, repeat=4)
        print("r2 c2 d512 (bulk-copy forward): ok", flush=True)
    for label, values, case in FORCED_WALKS:
        with knobs(**values):
            run_case(*case, repeat=4)
        print(f"r{case[0]} c{case[1]} d{case[2]} ({label}): ok", flush=True)
    # the opt-in atomic grad_ape path: scalar adds (register window), vector reductions (stream, sm_90+)
    for case in [(4, 2, 128), (3, 1, 65), (64, 2, 128), (128, 2, 64), (32, 1, 64)]:
        run_case(*case, deterministic=False)
    print("atomic grad_ape path: ok", flush=True)
    # a frozen ape: no grad_ape (slabs to scratch, no reduction; atomics into zeroed scratch)
    for case in [(4, 2, 128), (64, 2, 128)]:
        for deterministic in (True, False):
            run_case(*case, deterministic=deterministic, compute_grad_ape=False)
    print("frozen ape (no grad_ape): ok", flush=True)
    run_case(*CASES[0], stream=torch.cuda.Stream())
    run_empty()
    torch.cuda.synchronize()
    print("side stream and empty pack: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
