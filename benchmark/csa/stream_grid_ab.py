"""A/B of the stream grids' sizing in one process, on the same compiled kernels.

The grid is a per-call choice of the planner (``schedule.stream_row_ctas``), so its variants
need no recompiling: each shape's kernels are compiled once and its launches timed under each
variant in turn, alternating for ``--rounds`` rounds (graph replay, inputs rotated past the L2,
as ``bench_csa_compressor.py``). Variants: ``targets`` (the thread targets alone, the grid
before session 23), ``wave`` (one even resident wave, the default), ``shared`` (the wave with
shared memory counted in the residency, ``CSA_FRONTEND_STREAM_SHARED_RESIDENT``), ``smsN``
(the wave on N SMs instead of STREAM_GRID_SMS, the backward's, long launches included, and
the device's, the forward's; ``sms128`` is the forward before session 24) and ``rpc+K`` / ``rpc-K`` (forward only: the
wave's rows per CTA plus or minus K, at least 1: the curve a forward grid rule is fitted to).
Prints one JSON line per shape, with each forward variant's rows per CTA and grid.

    python benchmark/csa/stream_grid_ab.py --shapes 1x16384x48x2x256,1x65536x100x1x512 \\
        --variants targets,wave,sms132
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_csa_compressor import (copy_bandwidth, fused_call, graph_time_us, make_problem,  # noqa: E402
                                  parse_shape, rotated_copies, traffic_bytes)

from csa_frontend.compressor.kernels import dispatch, schedule  # noqa: E402

GRID_SMS = schedule.STREAM_GRID_SMS
SHARED = schedule.STREAM_SHARED_RESIDENT
FWD_GRID_SMS = schedule.STREAM_FWD_GRID_SMS
LONG_GRID_SMS = schedule.STREAM_BWD_LONG_GRID_SMS
FWD_ROWS_PER_CTA = dispatch.fwd_rows_per_cta


def apply_variant(name: str) -> None:
    """Set the planner's grid sizing to variant ``name`` (see the module docstring)."""
    wave = 0 if name == "targets" else 1
    schedule.STREAM_RESIDENT.update(fwd=wave, bwd=wave)
    sms = int(name[3:]) if name.startswith("sms") else None
    schedule.STREAM_GRID_SMS = sms or GRID_SMS
    schedule.STREAM_FWD_GRID_SMS = sms or FWD_GRID_SMS
    schedule.STREAM_BWD_LONG_GRID_SMS = 0 if sms else LONG_GRID_SMS  # smsN: every backward launch on N
    schedule.STREAM_SHARED_RESIDENT = True if name == "shared" else SHARED
    offset = int(name[3:]) if name.startswith("rpc") else 0
    dispatch.fwd_rows_per_cta = (FWD_ROWS_PER_CTA if not offset else
                                 lambda rows, sched, per_sm, sms=None: max(1, FWD_ROWS_PER_CTA(rows, sched, per_sm, sms)
                                                                           + offset))


def ab_shape(item: str, variants, directions, rounds: int, bw: float) -> dict:
    seg, seqlen, ratio, coff, d = shape = parse_shape(item)
    cu, comp, n_tok, n_rows, sets = make_problem(seg, seqlen, ratio, coff, d, rotated_copies(shape))
    res = {"shape": item, "rows": n_rows}
    for direction in directions:
        fn = fused_call(direction, cu, comp, ratio, coff, d)
        res[f"{direction}_floor_us"] = round(traffic_bytes(n_tok, n_rows, coff, d, direction) / bw * 1e6, 1)
        entry = dispatch._kernels_for(direction, cu.device, ratio, coff, d)
        sched, per_sm, sms = entry.sched, entry.per_sm, getattr(entry, "sms", None)
        res[f"{direction}_schedule"] = f"{sched.family} {sched.threads} threads x {sched.col_tiles} tiles, " \
                                       f"{per_sm} CTAs per SM"
        # the online forward is launched by output rows alone: no grid variants
        for name in variants if direction == "fwd" and sched.family == "stream" and not sched.online else ():
            apply_variant(name)
            rpc = dispatch.fwd_rows_per_cta(n_rows, sched, per_sm, sms)
            res[f"fwd_{name}_grid"] = f"{rpc} rows x {-(-n_rows // rpc) * sched.col_tiles} CTAs"
        for r in range(rounds):
            for name in variants:
                apply_variant(name)
                res[f"{direction}_{name}_us_{r}"] = round(graph_time_us(fn, sets), 1)
        apply_variant("wave")
    sets.clear()
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", required=True, help="comma list of SEGxSEQLENxRATIOxCOFFxHEAD_DIM")
    ap.add_argument("--variants", default="targets,wave", help="targets, wave, shared, smsN, rpc+K, rpc-K")
    ap.add_argument("--directions", default="fwd,bwd")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    bw = copy_bandwidth()
    for item in args.shapes.split(","):
        print(json.dumps(ab_shape(item, args.variants.split(","), args.directions.split(","), args.rounds, bw)),
              flush=True)


if __name__ == "__main__":
    main()
