"""Host overhead per call of every csa_frontend entry point, without CUDA graphs, next to a plain
torch op measured in the same run.

Method: warm-up calls of every entry point (compiles), then ``--repeats`` rounds that time
each entry point in turn (round-robin, so host slowdowns hit all alike): synchronize,
``time.perf_counter`` around ``--calls`` back-to-back calls and a final synchronize; the
median of the repeats divided by the call count is the wall clock per call (the best repeat
is reported too). ``enqueue`` is the
same loop without the final synchronize: pure host time while the launch queue is not full.
The forward kernel's own device time (CUDA-graph replay) is printed too: wall time per call
above it is host overhead the GPU cannot hide. Entry points that must not synchronise are
run once under ``torch.cuda.set_sync_debug_mode("error")`` and marked when they do.

    python benchmark/csa/bench_host_overhead.py [--calls 1000] [--repeats 7] [--profile] [--out DIR]

``--profile`` then shows where the forward wrapper's host time goes: each step of the wrapper
timed alone (``time.perf_counter_ns`` over ``--calls`` calls), and cProfile's top functions.
Writes ``host_overhead.json`` to ``--out`` (default ``$OUT`` or the current directory).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch

import csa_frontend.compressor.api as api
from csa_frontend import (CSACompressorForward, csa_compress, csa_compressor_backward_wrapper,
                          csa_compressor_forward_wrapper)
from csa_frontend.compressor import kernels, plan
from csa_frontend.compressor.kernels import dispatch


def make_problem(segments, seqlen, ratio, coff, head_dim):
    lengths = [seqlen] * segments
    cu = torch.tensor([0] + [seqlen * (i + 1) for i in range(segments)], dtype=torch.int32, device="cuda")
    comp = torch.tensor([0] + [seqlen // ratio * (i + 1) for i in range(segments)], dtype=torch.int32,
                        device="cuda")
    tokens, rows, cols = sum(lengths), segments * (seqlen // ratio), coff * head_dim
    kv = torch.randn(tokens, cols, device="cuda").to(torch.bfloat16)
    score = (2 * torch.randn(tokens, cols, device="cuda")).to(torch.bfloat16)
    ape = 0.5 * torch.randn(ratio, cols, device="cuda")
    grad_out = torch.randn(rows, head_dim, device="cuda").to(torch.bfloat16)
    return dict(kv=kv, score=score, ape=ape, cu=cu, comp=comp, grad_out=grad_out, rows=rows,
                out=torch.empty(rows, head_dim, dtype=torch.bfloat16, device="cuda"))


def entry_points(p, ratio, coff, head_dim):
    """(name, call, may synchronise) for every way to run the forward, the backward wrapper, and
    torch.mul on a tensor of kv's size."""
    inputs = (p["kv"], p["score"], p["ape"], p["cu"], p["comp"])
    rows, out = p["rows"], p["out"]
    kw = dict(ratio=ratio, coff=coff)
    op = CSACompressorForward(*inputs, out, **kw)
    op.compile()
    leaves = [t.clone().requires_grad_() for t in inputs[:3]]
    custom_op = torch.ops.csa_frontend.compress_fwd
    return [
        ("torch.mul (kv-sized bf16)", lambda: torch.mul(p["kv"], p["score"]), False),
        ("kernels.forward (no API layer)",
         lambda: kernels.forward(*inputs, out, head_dim=head_dim, **kw), False),
        ("forward wrapper, total_comp given", lambda: csa_compressor_forward_wrapper(*inputs, total_comp=rows, **kw),
         False),
        ("forward wrapper, total_comp=None", lambda: csa_compressor_forward_wrapper(*inputs, **kw), True),
        ("forward wrapper, validate=True",
         lambda: csa_compressor_forward_wrapper(*inputs, total_comp=rows, validate=True, **kw), True),
        ("CSACompressorForward.execute", lambda: op.execute(*inputs, out), False),
        ("csa_compress, no grad", lambda: csa_compress(*inputs, total_comp=rows, **kw), False),
        ("csa_compress, autograd.Function",
         lambda: csa_compress(*leaves, *inputs[3:], total_comp=rows, **kw), False),
        ("torch.ops custom op, no grad", lambda: custom_op(*inputs, ratio, coff, rows, True), False),
        ("torch.ops custom op, autograd", lambda: custom_op(*leaves, *inputs[3:], ratio, coff, rows, True), False),
        ("backward wrapper", lambda: csa_compressor_backward_wrapper(*inputs, p["grad_out"], **kw), False),
    ]


def time_once(fn, calls):
    """(wall us per call with the final synchronize, enqueue us per call) of one repeat."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    queued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (done - start) / calls * 1e6, (queued - start) / calls * 1e6


def wall_per_call_us(fns, calls, repeats):
    """Per callable: (median wall us per call, median enqueue us per call, best wall us).

    Repeats go round-robin over all callables, so a slow spell of the (virtualised) host
    lands on every entry point alike instead of on whichever ran at that moment."""
    for fn in fns:
        for _ in range(20):
            fn()
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, got in zip(fns, samples):
            got.append(time_once(fn, calls))
    return [(statistics.median(w for w, _ in got), statistics.median(e for _, e in got), min(w for w, _ in got))
            for got in samples]


def synchronises(fn):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return False
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")


def graph_us_per_call(fn, calls=100, repeats=5):
    """Device time per call: CUDA-graph replay of ``calls`` captured calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def wrapper_steps(p, ratio, coff, head_dim):
    """The forward wrapper's fast-path steps, in its order, each callable alone (mirrors
    ``api._fast_forward``; the cProfile listing is the ground truth)."""
    kv, score, ape, cu, comp, rows, out = (p[k] for k in ("kv", "score", "ape", "cu", "comp", "rows", "out"))
    key = ("forward", kv.device, ratio, coff, None)
    fp = api._fast_plans[key]
    fn, launch_args = dispatch.forward_call(*dispatch._kernels_for("fwd", kv.device, ratio, coff, head_dim),
                                            kv, score, ape, cu, comp, out)
    return [
        ("fast-plan lookup", lambda: api._fast_plans.get(("forward", kv.device, ratio, coff, None))),
        ("_FastPlan.beyond_entry_checks (incl. env read)", lambda: fp.beyond_entry_checks(kv, cu, comp, rows)),
        ("  plan.validate_env_on", plan.validate_env_on),
        ("kv.new_empty (out)", lambda: kv.new_empty((rows, head_dim))),
        ("prepared launch", lambda: fp.launch(kv, score, ape, cu, comp, out)),
        ("  compiled function call (TVM-FFI checks + launch)", lambda: fn(*launch_args)),
        ("api.OpResult(out=...)", lambda: api.OpResult(out=out)),
        ("(checked path, for comparison) plan.check_inputs",
         lambda: plan.check_inputs(kv, score, ape, cu, comp, fp.op.config, kv.device, "kv")),
    ]


def profile(p, ratio, coff, head_dim, calls):
    rows = p["rows"]
    inputs = (p["kv"], p["score"], p["ape"], p["cu"], p["comp"])
    whole = lambda: csa_compressor_forward_wrapper(*inputs, ratio=ratio, coff=coff, total_comp=rows)  # noqa: E731
    whole()  # the steps below look up what this call cached
    print(f"\nforward wrapper host time by step (us per call, each step alone over {calls} calls)")
    steps = [("whole wrapper", whole)] + wrapper_steps(p, ratio, coff, head_dim)
    for name, fn in steps:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter_ns() - start
        torch.cuda.synchronize()
        print(f"  {name:44s} {elapsed / calls / 1e3:7.2f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        whole()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
    print(f"\ncProfile of {calls} forward wrapper calls (cProfile adds its own per-call cost)")
    print(text.getvalue())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--segments", type=int, default=1)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--ratio", type=int, default=4)
    ap.add_argument("--coff", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help="break the forward wrapper's host time down")
    ap.add_argument("--out", default=os.environ.get("OUT", os.getcwd()))
    args = ap.parse_args()
    ratio, coff, head_dim = args.ratio, args.coff, args.head_dim
    shape = f"{args.segments}x{args.seqlen} r{ratio} c{coff} d{head_dim}"
    p = make_problem(args.segments, args.seqlen, ratio, coff, head_dim)
    kernel_us = graph_us_per_call(lambda: kernels.forward(p["kv"], p["score"], p["ape"], p["cu"], p["comp"], p["out"],
                                                          ratio=ratio, coff=coff, head_dim=head_dim))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {shape}: forward kernel {kernel_us:.2f} us "
          f"device time (graph replay); {args.calls} calls x {args.repeats} repeats, median")
    print(f"{'entry point':38s} {'wall us':>8s} {'enqueue us':>10s} {'best wall':>9s}  syncs")
    results = []
    points = entry_points(p, ratio, coff, head_dim)
    timings = wall_per_call_us([fn for _, fn, _ in points], args.calls, args.repeats)
    for (name, fn, may_sync), (wall, enqueue, best) in zip(points, timings):
        syncs = synchronises(fn)
        flag = "yes" if syncs else "no"
        if syncs != may_sync:
            flag += "  <-- unexpected"
        print(f"{name:38s} {wall:8.2f} {enqueue:10.2f} {best:9.2f}  {flag}")
        results.append(dict(name=name, wall_us=wall, enqueue_us=enqueue, best_wall_us=best, synchronises=syncs))
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shape=shape, calls=args.calls,
                  repeats=args.repeats, forward_kernel_device_us=kernel_us, date=time.strftime("%Y-%m-%d"),
                  results=results)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "host_overhead.json")
    with open(path, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"wrote {path}")
    if args.profile:
        profile(p, ratio, coff, head_dim, args.calls)


if __name__ == "__main__":
    main()
