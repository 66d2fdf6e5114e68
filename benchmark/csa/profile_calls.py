"""A few plain launches of one fused direction on one shape, for a profiler to pick from.

ncu profiles kernel launches, not graph replays, so this runs ``--calls`` launches of the same
direction back to back, after one warm-up call that compiles. The inputs are made on the GPU
(torch's own kernels come first), so filter on the fused kernels' names: with the backward's two
per call (main kernel and slab reduction), ``-k regex:kernel_cutlass --launch-skip 2
--launch-count 2`` profiles the second call's pair. The per-SM spread of a kernel's active
cycles (``sm__cycles_active``'s min / avg / max against ``sm__cycles_elapsed.max``) is how NOTES
row 160 measured the window backward's imbalance across SMs. ncu flushes the L2 before each
profiled launch; ``--cache-control none`` keeps what the previous launch left there (its dirty
gradients, as in a graph replay), which is where NOTES row 170 found the stream backward's grid
gap (``--launch-skip 4`` then starts on a call that has one before it).

    ncu --clock-control none -k regex:kernel_cutlass --launch-skip 2 --launch-count 1 \
        --metrics sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_elapsed.max \
        python benchmark/csa/profile_calls.py --shape 3x8192x4x1x512 --direction bwd
"""
from __future__ import annotations

import argparse

import torch

from bench_csa_compressor import fused_call, make_problem, parse_shape


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True, help="SEGxSEQLENxRATIOxCOFFxHEAD_DIM or an index into SHAPES")
    ap.add_argument("--direction", default="bwd", choices=["fwd", "bwd", "bwd_frozen"])
    ap.add_argument("--calls", type=int, default=3, help="launches after the warm-up call")
    args = ap.parse_args()
    seg, seqlen, ratio, coff, d = parse_shape(args.shape)
    cu, comp, _, _, sets = make_problem(seg, seqlen, ratio, coff, d, copies=1)
    fn = fused_call(args.direction, cu, comp, ratio, coff, d)
    for _ in range(1 + args.calls):
        fn(sets[0])
    torch.cuda.synchronize()
    print(f"{args.calls + 1} calls of {args.direction} on {args.shape}")


if __name__ == "__main__":
    main()
