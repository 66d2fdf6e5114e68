"""What the backward's deterministic grad_ape costs per call: the full backward, its main kernel
alone (the slab reduction swapped for a no-op, so grad_ape is left unwritten: a diagnostic, not
a result), the atomic variant, the slab reduction alone on slabs of the launch's size, and the
cost of one more small kernel per call. CUDA-graph replay, timed as bench_csa_compressor.py
times the fused kernels. "atomic" is what ``deterministic=False`` runs: past
``STREAM_ATOMIC_MAX_GROUPS`` row groups that is the deterministic kernels again; to time the
atomic kernel at any count, raise the limit (``CSA_FRONTEND_STREAM_ATOMIC_GROUPS=1000000``).

    python benchmark/csa/probe_ape_tail.py --shapes 1x8192x128x2x128,1x65536x64x1x512
    CSA_FRONTEND_PDL=0 python benchmark/csa/probe_ape_tail.py ...   # without programmatic launch
"""
from __future__ import annotations

import argparse
from unittest import mock

import torch

from bench_csa_compressor import fused_call, graph_time_us, make_problem, parse_shape, rotated_copies, shape_name
from csa_frontend.compressor.kernels import dispatch
from csa_frontend.compressor.kernels.schedule import ape_split, bwd_row_groups, slab_bytes


def no_op(*_):
    return None


def without_reduction(main, _reduce, sched, per_sm, few):
    """The entries of ``dispatch._kernels_for`` with both schedules' slab reductions skipped."""
    return main, no_op, sched, per_sm, None if few is None else (few[0], no_op, few[2], few[3])


def probe(shape):
    seg, seqlen, ratio, coff, d = shape
    copies = rotated_copies(shape)
    cu, comp, n_tok, n_rows, sets = make_problem(seg, seqlen, ratio, coff, d, copies)
    backward = fused_call("bwd", cu, comp, ratio, coff, d)

    full = graph_time_us(backward, sets)
    atomic = graph_time_us(fused_call("bwd", cu, comp, ratio, coff, d, deterministic=False), sets)
    entries = dispatch._kernels_for("bwd", torch.device("cuda", torch.cuda.current_device()), ratio, coff, d)
    with mock.patch.object(dispatch, "_kernels_for", lambda *_: without_reduction(*entries)):
        main_only = graph_time_us(backward, sets)
    _, reduce, sched, rpt = dispatch.backward_for_rows(n_rows, *entries, slab_bytes(ratio, coff, d))
    groups = bwd_row_groups(n_rows, sched, rpt)
    n_ape = ratio * coff * d
    ape_shape = (ratio, coff * d)
    slabs = [(torch.randn(groups, *ape_shape, device="cuda"), torch.empty(ape_shape, device="cuda"))
             for _ in range(copies)]
    split = ape_split(groups)
    alone = graph_time_us(lambda st: reduce(st[0], st[1], split), slabs)
    one = [(torch.randn(1, *ape_shape, device="cuda"), torch.empty(ape_shape, device="cuda")) for _ in range(8)]
    one_slab = graph_time_us(lambda st: reduce(st[0], st[1], 1), one)
    print(f"{shape_name(shape):24s} full {full:6.1f}  main alone {main_only:6.1f}  atomic {atomic:6.1f}  "
          f"reduction alone {alone:5.2f} ({groups} slabs of {n_ape * 4 // 1024} KB, split {split}, "
          f"{copies} set(s) per graph)  one-slab reduction {one_slab:5.2f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1x8192x128x2x128,1x65536x64x1x512,4x8192x16x2x256,3x8192x4x2x512,"
                        "1x65536x4x2x512,64x1000x4x2x128", help="comma list of SEGxSEQLENxRATIOxCOFFxHEAD_DIM")
    args = parser.parse_args()
    print(f"device {torch.cuda.get_device_name()}; us per call, graph replay", flush=True)
    for item in args.shapes.split(","):
        probe(parse_shape(item))
    tiny = [(torch.randn(1, device="cuda"), torch.empty(1, device="cuda")) for _ in range(8)]
    print(f"one-element torch.add {graph_time_us(lambda st: torch.add(st[0], 1, out=st[1]), tiny):.2f}", flush=True)


if __name__ == "__main__":
    main()
