"""Markdown table from bench_csa_compressor.py's JSON, next to SPEC section 6's reference
figures, for docs/performance.md:  python benchmark/csa/report.py RESULTS.json"""
from __future__ import annotations

import json
import sys

#: "best known fused" fwd/bwd us from SPEC section 6 (same H200), None where unsupported there
BEST_KNOWN = {
    "1x8192 r4 c2 d128": (5.4, 13.4), "3x8192 r4 c2 d128": (11.4, 29.5),
    "3x8192 r4 c2 d512": (41.7, 76.6), "1x65536 r4 c2 d512": (101.9, 187.9),
    "3x8192 r4 c1 d512": (21.4, 47.3), "1x8192 r128 c2 d128": (8.9, 14.5),
    "1x131072 r128 c1 d128": (27.0, 85.6), "1x65536 r128 c2 d512": (91.5, 263.1),
    "1x131072 r128 c2 d512": (151.3, 512.5), "512x256 r4 c2 d512": (1264.0, 2449.0),
    "64x1000 r4 c2 d128": (41.5, 82.5), "4x8192 r16 c2 d256": (None, None),
}


def cell(r, key, fmt="{:.1f}"):
    return fmt.format(r[key]) if key in r else "-"


def copy_cell(r):
    """The same-bytes copy's fwd/bwd us and % of the floor (runs without the copy provider: -)."""
    if "fwd_copy_us" not in r and "bwd_copy_us" not in r:
        return "-"
    return (f"{cell(r, 'fwd_copy_us')}/{cell(r, 'bwd_copy_us')} ({cell(r, 'fwd_copy_pct_floor', '{:.0f}')}%/"
            f"{cell(r, 'bwd_copy_pct_floor', '{:.0f}')}%)")


def table(meta):
    rows = ["| shape | floor fwd/bwd us | fused fwd us (% floor) | fused bwd us (% floor) | same-bytes copy fwd/bwd us (% floor) | best known fwd/bwd us | eager fwd/bwd us | wall clock fwd us |",
            "|---|---|---|---|---|---|---|---|"]
    for r in meta["results"]:
        best = BEST_KNOWN.get(r["shape"], (None, None))
        best_s = "/".join("-" if b is None else f"{b:g}" for b in best)
        rows.append(
            f"| {r['shape']} | {cell(r, 'fwd_floor_us')}/{cell(r, 'bwd_floor_us')} "
            f"| {cell(r, 'fwd_fused_us')} ({cell(r, 'fwd_fused_pct_floor', '{:.0f}')}%) "
            f"| {cell(r, 'bwd_fused_us')} ({cell(r, 'bwd_fused_pct_floor', '{:.0f}')}%) "
            f"| {copy_cell(r)} "
            f"| {best_s} | {cell(r, 'fwd_eager_us', '{:.0f}')}/{cell(r, 'bwd_eager_us', '{:.0f}')} "
            f"| {cell(r, 'fwd_fused_wall_us')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        meta = json.load(fh)
    print(f"{meta['device']}, copy bandwidth {meta['copy_bw_TBps']:.2f} TB/s, {meta['date']}\n")
    print(table(meta))
