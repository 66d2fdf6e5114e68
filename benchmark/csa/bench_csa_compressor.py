"""CSA compressor pooling: fused CuTe kernels vs eager PyTorch vs torch.compile, on one GPU.

Per shape and direction it reports the CUDA-graph replay time per call (inputs rotated over
enough copies that the working set exceeds the L2), the DRAM floor (bytes that must move /
the device-to-device copy bandwidth measured in the same run), the fraction of the floor
reached, the time of a streaming kernel moving the same bytes (timed the same way: the floor
leaves per-launch costs out, so on small shapes a copy's time, not the floor, is what the
simplest kernel reaches), and the host wall clock per call without graphs. Prints a table,
writes JSON and a PNG chart.

    python benchmark/csa/bench_csa_compressor.py [--shapes all|r4|families|midratio|i,j,...] [--out DIR]
        [--providers fused,eager,copy] [--directions fwd,bwd[,bwd_frozen]]

``--shapes`` items are indices into SHAPES or ``SEGxSEQLENxRATIOxCOFFxHEAD_DIM`` (e.g.
``1x16384x4x2x512``). An A/B of a tuning knob is two runs of the fused provider, one with the
knob set: ``CSA_FRONTEND_WINDOW_BWD_INTERLEAVE=0 python ... --providers fused --directions bwd``.
``bwd_frozen`` times the backward of a frozen ape (no grad_ape: no slab reduction launch).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from csa_frontend.compressor import kernels
from csa_frontend.compressor.reference import build_windows

L2_BYTES = 60 << 20

# (segments, seqlen, ratio, coff, head_dim); the rows of SPEC section 6 plus many-segment packs
SHAPES = [
    (1, 8192, 4, 2, 128), (3, 8192, 4, 2, 128), (3, 8192, 4, 2, 512), (1, 65536, 4, 2, 512),
    (3, 8192, 4, 1, 512), (1, 8192, 128, 2, 128), (1, 131072, 128, 1, 128), (1, 65536, 128, 2, 512),
    (1, 131072, 128, 2, 512), (512, 256, 4, 2, 512), (64, 1000, 4, 2, 128), (4, 8192, 16, 2, 256),
    (1, 65536, 64, 1, 512),
]

#: Named ``--shapes`` sets beyond SPEC's rows: each side of the boundary between the register
#: window and the stream family (NOTES row 89, docs/performance.md "Session 22"), and stream
#: windows of mid ratios on short packs (NOTES row 90).
SHAPE_SETS = {
    "families": [(1, 32768, r, c, 512) for r, c in ((4, 2), (5, 2), (6, 2), (7, 2), (8, 2), (16, 2), (8, 1), (10, 1),
                                                    (12, 1), (13, 1), (14, 1), (16, 1), (32, 1))]
                + [(1, 32768, 8, 2, 256), (1, 32768, 16, 1, 256)]
                + [(1, 65536, r, c, 128) for r, c in ((6, 2), (7, 2), (8, 2), (12, 1), (16, 1))],
    "midratio": [(1, 32768, 24, 1, 512), (1, 32768, 32, 2, 128), (1, 16384, 48, 2, 256), (1, 65536, 200, 1, 192),
                 (2, 16384, 100, 2, 128), (1, 32768, 17, 1, 256)],
}


def select_shapes(arg: str):
    """``--shapes``: all (SPEC's rows), r4 (its small-ratio rows), a name in SHAPE_SETS, or a
    comma list of items (``parse_shape``)."""
    if arg == "all":
        return list(SHAPES)
    if arg == "r4":
        return [s for s in SHAPES if s[2] <= 8]
    if arg in SHAPE_SETS:
        return list(SHAPE_SETS[arg])
    return [parse_shape(i) for i in arg.split(",")]


def parse_shape(item: str):
    """One ``--shapes`` item: an index into SHAPES, or ``SEGxSEQLENxRATIOxCOFFxHEAD_DIM``."""
    if "x" in item:
        shape = tuple(int(v) for v in item.split("x"))
        if len(shape) != 5:
            raise SystemExit(f"--shapes: {item!r} is not SEGxSEQLENxRATIOxCOFFxHEAD_DIM")
        return shape
    return SHAPES[int(item)]


def shape_name(s):
    return f"{s[0]}x{s[1]} r{s[2]} c{s[3]} d{s[4]}"


def traffic_bytes(n_tok, n_rows, coff, d, direction):
    """Bytes that must move: fwd reads kv+score, writes out; bwd reads kv, score, grad_out and
    writes grad_kv, grad_score (ape and offsets are negligible)."""
    io = 2 * n_tok * coff * d * 2
    rows = n_rows * d * 2
    return io + rows if direction == "fwd" else 2 * io + rows


def copy_bandwidth():
    """Device-to-device copy bandwidth (read + write bytes) on a 1 GiB buffer."""
    src = torch.empty(1 << 29, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(10):
        dst.copy_(src)
    ev[1].record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 2 * 10 / (ev[0].elapsed_time(ev[1]) * 1e-3)


def make_problem(seg, seqlen, ratio, coff, d, copies):
    lengths = [seqlen] * seg
    cu = torch.tensor([0] + [seqlen * (i + 1) for i in range(seg)], dtype=torch.int32, device="cuda")
    comp = torch.tensor([0] + [(seqlen // ratio) * (i + 1) for i in range(seg)], dtype=torch.int32,
                        device="cuda")
    n_tok, n_rows = sum(lengths), int(comp[-1])
    sets = []
    for _ in range(copies):
        kv = torch.randn(n_tok, coff * d, device="cuda").to(torch.bfloat16)
        score = (2 * torch.randn(n_tok, coff * d, device="cuda")).to(torch.bfloat16)
        ape = 0.5 * torch.randn(ratio, coff * d, device="cuda")
        g = torch.randn(n_rows, d, device="cuda").to(torch.bfloat16)
        sets.append(dict(kv=kv, score=score, ape=ape, grad_out=g, out=torch.empty(n_rows, d, device="cuda",
                         dtype=torch.bfloat16), gkv=torch.empty_like(kv), gs=torch.empty_like(score),
                         gape=torch.empty_like(ape)))
    return cu, comp, n_tok, n_rows, sets


def eager_region(win, ratio, coff, d):
    """The upstream eager region (what frameworks run today), indices precomputed."""
    def fwd(kv, score, ape):
        n_tok = kv.shape[0]
        half = win.half.expand_as(win.token)
        s = score.reshape(n_tok, coff, d)[win.token, half].float()
        s = s + ape.reshape(ratio, coff, d)[win.ape_row, win.half]
        valid = win.valid[:, :, None]
        s = torch.where(valid, s, float("-inf"))
        x = torch.where(valid, kv.reshape(n_tok, coff, d)[win.token, half], 0)
        return (x * torch.softmax(s, dim=1).to(torch.bfloat16)).sum(dim=1)
    return fwd


def graph_time_us(fn_per_set, sets, reps=20):
    """Median-free simple estimate: time per call over graph replays of all rotated sets."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for st in sets:
            fn_per_set(st)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for st in sets:
            fn_per_set(st)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(reps):
            graph.replay()
        ev[1].record()
        torch.cuda.synchronize()
        times.append(ev[0].elapsed_time(ev[1]) * 1e3 / (reps * len(sets)))
    times.sort()
    return times[len(times) // 2]


def copy_time_us(nbytes, copies):
    """A streaming kernel that moves ``nbytes`` (half read, half written), timed like the fused
    kernels (graph replay, ``copies`` rotated buffer pairs): the per-launch costs a kernel pays
    are included here and left out of the floor (bytes / the bandwidth of a 1 GiB copy), so on
    shapes of tens of MB this, not the floor, is what the simplest kernel reaches.

    An elementwise kernel (``bitwise_or`` with 0), not ``copy_``: captured in a graph, ``copy_``
    is a memcpy node, which on the H200 moved 1.07 GB at 2.75 TB/s and 1.08 GB at 4.2."""
    n = max(1, nbytes // 4)  # int16 elements per buffer: nbytes / 2 bytes each
    pairs = [dict(src=torch.empty(n, dtype=torch.int16, device="cuda").random_(),
                  dst=torch.empty(n, dtype=torch.int16, device="cuda")) for _ in range(copies)]
    t = graph_time_us(lambda st: torch.bitwise_or(st["src"], 0, out=st["dst"]), pairs)
    pairs.clear()
    return t


def wall_us(fn, n=200):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def rotated_copies(shape):
    """Input sets a shape's graph rotates over: enough that one pass over them is 3x the L2
    (a call never finds its inputs there), at most 8."""
    seg, seqlen, ratio, coff, d = shape
    n_tok = seg * seqlen
    return max(1, min(8, -(-3 * L2_BYTES // traffic_bytes(n_tok, n_tok // ratio, coff, d, "bwd"))))


def fused_call(direction, cu, comp, ratio, coff, d, deterministic=True):
    """``fn(st)``: one fused launch of ``direction`` on the input set ``st`` (``make_problem``);
    ``bwd_frozen``: the backward without grad_ape."""
    kw = dict(ratio=ratio, coff=coff, head_dim=d)
    if direction == "fwd":
        return lambda st: kernels.forward(st["kv"], st["score"], st["ape"], cu, comp, st["out"], **kw)
    frozen = direction == "bwd_frozen"
    return lambda st: kernels.backward(st["kv"], st["score"], st["ape"], cu, comp, st["grad_out"], st["gkv"],
                                       st["gs"], None if frozen else st["gape"], deterministic=deterministic, **kw)


def bench_shape(shape, bw, providers, directions=("fwd", "bwd")):
    seg, seqlen, ratio, coff, d = shape
    copies = rotated_copies(shape)
    cu, comp, n_tok, n_rows, sets = make_problem(seg, seqlen, ratio, coff, d, copies)
    res = {"shape": shape_name(shape), "tokens": n_tok, "rows": n_rows}
    reason = kernels.unsupported_reason(ratio, coff, d, "sm_90a")
    for direction in directions:
        nbytes = traffic_bytes(n_tok, n_rows, coff, d, direction.split("_")[0])
        res[f"{direction}_floor_us"] = nbytes / bw * 1e6
        if reason is None and "fused" in providers:
            fn = fused_call(direction, cu, comp, ratio, coff, d)
            t = graph_time_us(fn, sets)
            res[f"{direction}_fused_us"] = t
            res[f"{direction}_fused_pct_floor"] = 100 * res[f"{direction}_floor_us"] / t
            res[f"{direction}_fused_wall_us"] = wall_us(lambda: fn(sets[0]))
        if "copy" in providers:
            res[f"{direction}_copy_us"] = copy_time_us(nbytes, copies)
            res[f"{direction}_copy_pct_floor"] = 100 * res[f"{direction}_floor_us"] / res[f"{direction}_copy_us"]
    win = build_windows(cu, comp, ratio, coff, n_rows, torch.device("cuda"))
    eager = eager_region(win, ratio, coff, d)
    if "eager" in providers:
        res["fwd_eager_us"] = graph_time_us(lambda st: eager(st["kv"], st["score"], st["ape"]), sets[:1], reps=5)
        def eager_bwd(st):
            kv, sc, ap = (st[k].detach().requires_grad_() for k in ("kv", "score", "ape"))
            out = eager(kv, sc, ap)
            torch.autograd.grad(out, (kv, sc, ap), st["grad_out"])
        res["bwd_eager_us"] = graph_time_us(eager_bwd, sets[:1], reps=5) - res["fwd_eager_us"]
    if "compile" in providers:
        comp_fn = torch.compile(eager, dynamic=False)
        res["fwd_compile_us"] = graph_time_us(lambda st: comp_fn(st["kv"], st["score"], st["ape"]), sets[:1], reps=5)
    sets.clear()  # drop the tensors before the next shape
    torch.cuda.empty_cache()
    return res


def chart(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["shape"] for r in results]
    fig, ax = plt.subplots(figsize=(12, 5))
    xs = range(len(names))
    for i, direction in enumerate(("fwd", "bwd")):
        vals = [r.get(f"{direction}_fused_pct_floor", 0) for r in results]
        ax.bar([x + 0.4 * i for x in xs], vals, width=0.4, label=f"fused {direction}")
        copy = [(x + 0.4 * i, r[f"{direction}_copy_pct_floor"]) for x, r in zip(xs, results)
                if f"{direction}_copy_pct_floor" in r]
        if copy:
            ax.scatter(*zip(*copy), marker="_", s=160, color="k", zorder=3,
                       label="same-bytes copy" if i == 0 else None)
    ax.axhline(100, color="k", lw=0.8)
    ax.axhline(85, color="r", lw=0.8, ls="--", label="85% target")
    ax.set_xticks([x + 0.2 for x in xs])
    ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("% of DRAM floor (measured copy bandwidth)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="all",
                    help="all, r4 (small-ratio rows), families, midratio (SHAPE_SETS) or a comma list of "
                         "indices / SEGxSEQLENxRATIOxCOFFxHEAD_DIM")
    ap.add_argument("--providers", default="fused,eager,copy",
                    help="fused, eager (upstream eager region), compile (torch.compile of it), copy (a streaming "
                         "kernel moving the same bytes)")
    ap.add_argument("--directions", default="fwd,bwd", help="fused directions to time (A/B runs of one kernel)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    shapes = select_shapes(args.shapes)
    providers = args.providers.split(",")
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results = []
    for s in shapes:
        r = bench_shape(s, bw, providers, args.directions.split(","))
        results.append(r)
        print(json.dumps(r), flush=True)
    cols = ("floor", "fused", "%fl", "copy", "eager")
    hdr = " | ".join(" ".join(f"{c:>7s}" for c in cols) for _ in ("fwd", "bwd"))
    print(f"{'shape (fwd | bwd)':26s} {hdr} | wall fwd")
    for r in results:
        f = lambda k: f"{r[k]:7.1f}" if k in r else "      -"
        p = lambda k: f"{r[k]:7.0f}" if k in r else "      -"
        side = lambda d: (f"{f(d + '_floor_us')} {f(d + '_fused_us')} {p(d + '_fused_pct_floor')} {f(d + '_copy_us')} "
                          f"{f(d + '_eager_us')}")
        print(f"{r['shape']:26s} {side('fwd')} | {side('bwd')} | {f('fwd_fused_wall_us')}")
    meta = {"device": torch.cuda.get_device_name(), "copy_bw_TBps": bw / 1e12,
            "date": time.strftime("%Y-%m-%d"), "results": results}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_csa_compressor.json"), "w") as fh:
        json.dump(meta, fh, indent=1)
    chart(results, os.path.join(args.out, "bench_csa_compressor.png"))


if __name__ == "__main__":
    main()
