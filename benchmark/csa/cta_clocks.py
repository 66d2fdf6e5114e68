"""Summarise the register-window backward's per-CTA clocks (``CSA_FRONTEND_CTA_CLOCKS=1``).

With the knob on, thread 0 of every row CTA prints ``cta_clock bx by smid start end`` (global
timer, ns) as it ends. Pipe a run of back-to-back launches through this script to see, per
launch, how CTA durations and SM finishing times spread, which CTAs ran slowest (and how long
the other CTA on the same SM took), and whether the slowest tenth repeats from one launch to the
next (same CTAs, same SMs) or is drawn afresh:

    CSA_FRONTEND_CTA_CLOCKS=1 python profile_calls.py --shape 3x8192x4x1x512 --direction bwd \\
        --calls 4 | python cta_clocks.py

The device printf can perturb a kernel near its register limit (session 50: the 128-register
coff-2 backward ran 9x slower with it), so check the launch's time against a run without it.
Grids of more than one wave are worse off: in session 51's 1x65536 r4 c1 d512 run the second
wave started ~270 us after the first wave's last ``end`` stamp (~40 us), so the CTAs kept their
slots long after stamping (the printf is the suspect) and only the first wave's durations mean
anything.
"""
from __future__ import annotations

import statistics
import sys
from collections import Counter, defaultdict
from typing import Dict, Iterable, List, NamedTuple

class Clock(NamedTuple):
    bx: int
    by: int
    sm: int
    start: int
    end: int

    @property
    def us(self) -> float:
        return (self.end - self.start) / 1000


def parse(lines: Iterable[str]) -> List[Clock]:
    """The ``cta_clock`` records among ``lines`` (anything else is skipped)."""
    out = []
    for line in lines:
        fields = line.split()
        if len(fields) == 6 and fields[0] == "cta_clock":
            out.append(Clock(*map(int, fields[1:])))
    return out


def launches(clocks: List[Clock]) -> List[List[Clock]]:
    """Records grouped into launches: in start order, a launch ends where one of its CTAs comes
    again. Launches do not overlap (a CTA stamps its start after ``enter_grid``'s wait for the
    grid before it), while a grid of more CTAs than slots starts its later waves tens of
    microseconds after its first, so start-time gaps cannot tell launches apart."""
    groups: List[List[Clock]] = []
    seen: set = set()
    for c in sorted(clocks, key=lambda c: c.start):
        if not groups or (c.bx, c.by) in seen:
            groups.append([])
            seen = set()
        groups[-1].append(c)
        seen.add((c.bx, c.by))
    return groups


def per_sm(launch: List[Clock]) -> Dict[int, List[Clock]]:
    """A launch's records by the SM they ran on."""
    by_sm: Dict[int, List[Clock]] = defaultdict(list)
    for c in launch:
        by_sm[c.sm].append(c)
    return by_sm


def slowest(launch: List[Clock], share: float = 0.1) -> List[Clock]:
    """The slowest ``share`` of a launch's CTAs (at least one), slowest first."""
    k = max(1, round(share * len(launch)))
    return sorted(launch, key=lambda c: -c.us)[:k]


def report(launch: List[Clock], previous: "List[Clock] | None" = None, show: int = 8) -> List[str]:
    """Lines describing one launch (and how its slowest tenth overlaps ``previous``'s)."""
    t0 = min(c.start for c in launch)
    durations = sorted(c.us for c in launch)
    n = len(durations)
    by_sm = per_sm(launch)
    sm_end = sorted((max(c.end for c in v) - t0) / 1000 for v in by_sm.values())
    lines = [f"{n} CTAs on {len(by_sm)} SMs ({dict(sorted(Counter(len(v) for v in by_sm.values()).items()))} "
             f"CTAs per SM); starts spread over {(max(c.start for c in launch) - t0) / 1000:.2f} us",
             f"  CTA us: min {durations[0]:.1f}, p10 {durations[n // 10]:.1f}, median "
             f"{statistics.median(durations):.1f}, p90 {durations[9 * n // 10]:.1f}, max {durations[-1]:.1f}",
             f"  SM finished at us: first {sm_end[0]:.1f}, median {statistics.median(sm_end):.1f}, "
             f"last {sm_end[-1]:.1f}"]
    now = slowest(launch)
    for c in now[:show]:
        partners = ", ".join(f"{p.us:.1f}" for p in by_sm[c.sm] if p is not c) or "-"
        lines.append(f"  slow: bx {c.bx} by {c.by} on SM {c.sm}: {c.us:.1f} us (same SM: {partners})")
    if previous:
        before = slowest(previous)
        same_cta = len({(c.bx, c.by) for c in now} & {(c.bx, c.by) for c in before})
        same_sm = len({c.sm for c in now} & {c.sm for c in before})
        lines.append(f"  slowest tenth shared with the launch before: {same_cta} of {len(now)} CTAs, "
                     f"{same_sm} of {len({c.sm for c in now})} SMs")
    return lines


def placement(launch: List[Clock], bands: int = 4) -> List[str]:
    """Whether a CTA's duration follows its place: alone on its SM, or the lower or the higher
    block index of an SM's pair (the hardware hands out block indices in order, so the higher
    one was placed second), and the mean duration per band of block indices."""
    by_sm = per_sm(launch)
    alone = [v[0].us for v in by_sm.values() if len(v) == 1]
    pairs = [sorted(v, key=lambda c: (c.bx, c.by)) for v in by_sm.values() if len(v) == 2]
    lines = [f"  mean us: alone {_mean(alone)} ({len(alone)}), pair's lower bx {_mean([p[0].us for p in pairs])}, "
             f"higher bx {_mean([p[1].us for p in pairs])} ({len(pairs)} pairs)"]
    top = max(c.bx for c in launch) + 1
    width = -(-top // bands)
    band_us = [[c.us for c in launch if c.bx // width == b] for b in range(bands)]
    lines.append("  mean us by bx band: " + ", ".join(f"{b * width}-{min(top, (b + 1) * width) - 1}: {_mean(u)}"
                                                      for b, u in enumerate(band_us)))
    return lines


def _mean(values: List[float]) -> str:
    return f"{statistics.fmean(values):.1f}" if values else "-"


def main() -> None:
    groups = launches(parse(sys.stdin))
    print(f"{len(groups)} launches")
    previous = None
    for i, launch in enumerate(groups):
        print(f"launch {i}: " + "\n".join(report(launch, previous) + placement(launch)))
        previous = launch


if __name__ == "__main__":
    main()
