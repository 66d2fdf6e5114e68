"""Fixed cost per call and streaming rate of the fused kernels, from a size sweep.

One configuration, one direction, several token counts: each size is timed as
bench_csa_compressor.py times it (CUDA-graph replay over rotated inputs), next to a plain
streaming kernel moving the same bytes, and both series are fitted by least squares to
``t = fixed + bytes / rate``. The floor's percentage mixes the two terms; apart, they say
whether a change moved what every call pays once (pipeline start and drain, the grad_ape
reduction launch: NOTES "Fixed cost per call") or how fast the bytes stream in between.

    python benchmark/csa/size_sweep.py --config 4x2x512 --directions bwd
    python benchmark/csa/size_sweep.py --config 128x1x128 --seqlens 16384,32768,65536,131072
    CSA_FRONTEND_FIRST_ROW_ALONE=0 python benchmark/csa/size_sweep.py ...   # a knob's A/B

``--config`` is ``RATIOxCOFFxHEAD_DIM``; one segment of each ``--seqlens`` token count.
"""
from __future__ import annotations

import argparse
import json
import os

from bench_csa_compressor import (copy_time_us, fused_call, graph_time_us, make_problem, rotated_copies,
                                  traffic_bytes)

DEFAULT_SEQLENS = (8192, 16384, 32768, 65536, 131072)


def fit_line(nbytes, times_us):
    """Least-squares ``t = fixed + nbytes / rate``: (fixed us, rate in TB/s). Needs two or more
    distinct sizes; a rate of inf means the times did not grow with the bytes."""
    n = len(nbytes)
    if n < 2 or len(set(nbytes)) < 2 or len(times_us) != n:
        raise ValueError(f"fit_line: need two or more distinct sizes with one time each, got {nbytes}, {times_us}")
    mx, my = sum(nbytes) / n, sum(times_us) / n
    sxx = sum((x - mx) ** 2 for x in nbytes)
    slope = sum((x - mx) * (y - my) for x, y in zip(nbytes, times_us)) / sxx  # us per byte
    fixed = my - slope * mx
    rate = float("inf") if slope <= 0 else 1e-6 / slope  # bytes per us -> TB/s
    return fixed, rate


def parse_config(text: str):
    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise SystemExit(f"--config {text!r}: expected RATIOxCOFFxHEAD_DIM, e.g. 4x2x512")
    return tuple(int(p) for p in parts)


def sweep(config, seqlens, direction, with_copy=True):
    """Per token count: bytes, fused us and (with_copy) same-bytes copy us."""
    ratio, coff, d = config
    rows = []
    for seqlen in seqlens:
        shape = (1, seqlen, ratio, coff, d)
        copies = rotated_copies(shape)
        cu, comp, n_tok, n_rows, sets = make_problem(*shape, copies)
        nbytes = traffic_bytes(n_tok, n_rows, coff, d, direction)
        row = {"seqlen": seqlen, "bytes": nbytes, "fused_us": graph_time_us(fused_call(direction, cu, comp, ratio,
                                                                                       coff, d), sets)}
        sets.clear()
        if with_copy:
            row["copy_us"] = copy_time_us(nbytes, copies)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="RATIOxCOFFxHEAD_DIM")
    ap.add_argument("--seqlens", default=",".join(map(str, DEFAULT_SEQLENS)))
    ap.add_argument("--directions", default="fwd,bwd")
    ap.add_argument("--no-copy", action="store_true", help="time the fused kernels only")
    ap.add_argument("--out", default=None, help="directory for size_sweep.json")
    args = ap.parse_args()
    config = parse_config(args.config)
    seqlens = [int(s) for s in args.seqlens.split(",")]
    report = {"config": args.config, "directions": {}}
    for direction in args.directions.split(","):
        rows = sweep(config, seqlens, direction, with_copy=not args.no_copy)
        print(f"r{config[0]} c{config[1]} d{config[2]} {direction}")
        for row in rows:
            copy = f"  copy {row['copy_us']:8.1f}" if "copy_us" in row else ""
            print(f"  1x{row['seqlen']:<7d} {row['bytes'] / 1e6:8.1f} MB  fused {row['fused_us']:8.1f}{copy}")
        fits = {}
        for kind in ("fused", "copy"):
            if f"{kind}_us" in rows[0]:
                fixed, rate = fit_line([r["bytes"] for r in rows], [r[f"{kind}_us"] for r in rows])
                fits[kind] = {"fixed_us": fixed, "rate_TBps": rate}
                print(f"  {kind:5s} fit: {fixed:6.2f} us per call + bytes / {rate:.2f} TB/s")
        report["directions"][direction] = {"sizes": rows, "fits": fits}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "size_sweep.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
