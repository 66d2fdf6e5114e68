"""Which performance targets a benchmark run meets: SPEC section 6 and the kernel issues'
"done when" criteria, checked against SPEC's own floor (bytes / 4.29 TB/s, the card's copy
bandwidth in SPEC), not the run's measured copy bandwidth that bench_csa_compressor.py's
"%fl" column uses.

    python benchmark/csa/targets.py RESULTS.json        # bench_csa_compressor.py's JSON

Criteria per row and direction (only those that apply):
- faster than SPEC's "best known fused" figure, where it has one;
- >= 85% of the floor where the direction moves more than 64 MB;
- ratio-128 backwards >= 1.5x faster than the best known;
- the r16 and r64 rows >= 80% of the floor (the large-ratio issue's bar for them, in place of
  the 85%).
Each miss states the time that would meet it, and, where the run has the ``copy`` provider,
the same-bytes copy's time beside it.
"""
from __future__ import annotations

import json
import sys

from bench_csa_compressor import traffic_bytes
from report import BEST_KNOWN

SPEC_COPY_BW = 4.29e12  # bytes per second
BIG_BYTES = 64e6
FLOOR_SHARE_BIG = 0.85
FLOOR_SHARE_MIDRATIO = 0.80
MIDRATIO_ROWS = ("4x8192 r16 c2 d256", "1x65536 r64 c1 d512")
R128_BWD_SPEEDUP = 1.5


def parse_name(shape: str):
    """(segments, seqlen, ratio, coff, head_dim) from a name such as ``3x8192 r4 c2 d512``."""
    pack, ratio, coff, d = shape.split()
    seg, seqlen = pack.split("x")
    return int(seg), int(seqlen), int(ratio[1:]), int(coff[1:]), int(d[1:])


def moved_bytes(row: dict, direction: str) -> float:
    """The direction's bytes, counted as the benchmark counts them for its floor."""
    _, _, _, coff, d = parse_name(row["shape"])
    return traffic_bytes(row["tokens"], row["rows"], coff, d, direction)


def check(meta: dict):
    """One entry per (row, direction) with a fused time: its SPEC floor share and, per
    criterion, (met, the time that meets it)."""
    entries = []
    for row in meta["results"]:
        _, _, ratio, _, _ = parse_name(row["shape"])
        best = BEST_KNOWN.get(row["shape"], (None, None))
        for i, direction in enumerate(("fwd", "bwd")):
            t = row.get(f"{direction}_fused_us")
            if t is None:
                continue
            nbytes = moved_bytes(row, direction)
            floor = nbytes / SPEC_COPY_BW * 1e6
            needs = {}
            if best[i] is not None:
                needs["faster than best known"] = best[i]
                if ratio == 128 and direction == "bwd":
                    needs[f"{R128_BWD_SPEEDUP}x best known"] = best[i] / R128_BWD_SPEEDUP
            if row["shape"] in MIDRATIO_ROWS:  # the large-ratio issue's own bar for these rows
                needs[f"{FLOOR_SHARE_MIDRATIO:.0%} of floor"] = floor / FLOOR_SHARE_MIDRATIO
            elif nbytes > BIG_BYTES:
                needs[f"{FLOOR_SHARE_BIG:.0%} of floor"] = floor / FLOOR_SHARE_BIG
            entries.append({"shape": row["shape"], "direction": direction, "us": t, "spec_floor_us": floor,
                            "floor_share": floor / t, "copy_us": row.get(f"{direction}_copy_us"),
                            "criteria": {name: (t <= limit, limit) for name, limit in needs.items()}})
    return entries


def _digits(t: float, limits) -> int:
    """Decimals that tell a time from the limits it misses: 1, or 2 where one decimal prints
    the time and a limit it misses alike (19.87 us beside 'needs <= 19.86' read 19.9 and 19.9)."""
    return 2 if any(f"{t:.1f}" == f"{limit:.1f}" for limit in limits) else 1


def render(entries) -> str:
    lines = []
    for e in entries:
        missed = [(name, limit) for name, (met, limit) in e["criteria"].items() if not met]
        n = _digits(e["us"], [limit for _, limit in missed])
        misses = [f"{name} needs <= {limit:.{n}f}" for name, limit in missed]
        status = "met" if not misses else "MISSED: " + "; ".join(misses)
        if misses and e.get("copy_us"):
            # what a plain streaming kernel takes for the same bytes in the same run: a target
            # below it asks for a kernel faster than a copy
            status += f" (same-bytes copy {e['copy_us']:.1f})"
        if not e["criteria"]:
            status = "no target"
        lines.append(f"{e['shape']:24s} {e['direction']} {e['us']:8.{n}f} us  {e['floor_share']:6.1%} of SPEC floor  "
                     f"{status}")
    met = sum(all(ok for ok, _ in e["criteria"].values()) for e in entries if e["criteria"])
    lines.append(f"{met} of {sum(1 for e in entries if e['criteria'])} row directions meet every target")
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        print(render(check(json.load(fh))))
