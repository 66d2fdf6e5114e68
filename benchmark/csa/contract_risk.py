"""Model: how often a launch of n outputs breaks the contract's differing-element count.

The numerics contract lets max(1, n // 1000) elements of ``out`` differ from the fp32
reference (0.1%). A fast forward that rounds a fraction ``q`` of its elements differently
(measured on 2M-element packs; ``csa_compressor.md`` section 4) breaks it with the chance that
a Poisson count of mean ``q * n`` exceeds the allowance. That chance peaks just above each
multiple of 1000 (the allowance steps up only there), so this prints the worst n of each band
of launch sizes. The serial forward's limits in ``kernels/schedule.py`` are read off it.

    python benchmark/csa/contract_risk.py [--rates 3.1e-4,1e-4,0.35e-4] [--bands 1,4097,8192,16384,65536]
"""
from __future__ import annotations

import argparse
import math


def allowance(n: int) -> int:
    """Differing elements the contract allows in an output of ``n`` elements."""
    return max(1, n // 1000)


def exceed_chance(n: int, rate: float) -> float:
    """P(Poisson(rate * n) > allowance(n))."""
    lam, k = rate * n, allowance(n)
    term, below = math.exp(-lam), 0.0
    for i in range(k + 1):
        below += term
        term *= lam / (i + 1)
    return max(0.0, 1.0 - below)


def worst_in(first: int, last: int, rate: float):
    """(chance, n) of the riskiest launch size in [first, last]."""
    return max((exceed_chance(n, rate), n) for n in range(first, last + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="3.1e-4,1e-4,0.35e-4",
                    help="comma list of differing fractions: stream r256 c2, stream r16 c1, register window")
    ap.add_argument("--bands", default="1,4097,8192,16384,65536",
                    help="comma list of band starts (output elements); the last band ends at 4x its start")
    args = ap.parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    starts = [int(x) for x in args.bands.split(",")]
    ends = [s - 1 for s in starts[1:]] + [4 * starts[-1]]
    print("outputs".ljust(16) + "".join(f"rate {r:g}".rjust(24) for r in rates))
    for first, last in zip(starts, ends):
        cells = []
        for r in rates:
            chance, n = worst_in(first, last, r)
            cells.append(f"{chance:.2e} at {n}".rjust(24))
        print(f"{first}-{last}".ljust(16) + "".join(cells))


if __name__ == "__main__":
    main()
