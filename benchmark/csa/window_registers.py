"""Registers and spills of the kernel the planner picks, per register-window budget: where the
register window stops fitting (SPEC's "generic over ratio up to the point where registers
spill"). Runs on a CPU-only machine: each budget is compiled for sm_90a in a child process
(the budget knob is read at import) with the PTX kept, and ptxas reports each entry point.

    python benchmark/csa/window_registers.py --configs 4x2,8x1,8x2,16x1,16x2 --head-dim 512 \
        --budgets fwd=16,bwd=32 fwd=32,bwd=64 fwd=1,bwd=1
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import sys
from csa_frontend.compressor.kernels import dispatch
from csa_frontend.compressor.kernels.schedule import choose_schedule
ratio, coff, d = map(int, sys.argv[1:4])
dispatch.compile_forward(ratio=ratio, coff=coff, head_dim=d, arch="sm_90a")
dispatch.compile_backward(ratio=ratio, coff=coff, head_dim=d, arch="sm_90a")
print(choose_schedule(ratio, coff, d, "fwd").family, choose_schedule(ratio, coff, d, "bwd").family)
"""
KERNELS = {"WindowForward": "window fwd", "StreamForward": "stream fwd", "WindowBackward": "window bwd",
           "StreamBackward": "stream bwd"}


def parse_ptxas(verbose: str) -> dict:
    """Registers and spill bytes (stores + loads) from ``ptxas -v`` of one entry point."""
    regs = int(re.search(r"Used (\d+) registers", verbose).group(1))
    spill = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", verbose))
    return {"registers": regs, "spill_bytes": spill}


def ptxas_report(ptx: Path) -> dict:
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    return parse_ptxas(out)


def measure(ratio: int, coff: int, head_dim: int, budget: str) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, CSA_FRONTEND_WINDOW_BUDGET=budget, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=dump,
                   PYTHONPATH=f"{ROOT / 'python'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        families = subprocess.run([sys.executable, "-c", CHILD, str(ratio), str(coff), str(head_dim)], env=env,
                                  capture_output=True, text=True, check=True).stdout.split()
        row = {"ratio": ratio, "coff": coff, "head_dim": head_dim, "budget": budget,
               "fwd_family": families[0], "bwd_family": families[1]}
        # in compile order: each direction's default (long-launch) schedule comes first, its
        # row-count bucket's kernel of the same class later
        for ptx in sorted(Path(dump).glob("*.ptx"), key=lambda p: p.stat().st_mtime_ns):
            for name, label in KERNELS.items():
                if name in ptx.name and label not in row:
                    row[label] = ptxas_report(ptx)
        return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="2x2,3x2,4x2,8x1,4x1,8x2,16x1,16x2,32x1",
                    help="comma list of RATIOxCOFF")
    ap.add_argument("--head-dim", type=int, default=512)
    ap.add_argument("--budgets", nargs="+", default=["fwd=16,bwd=32", "fwd=32,bwd=64"],
                    help="CSA_FRONTEND_WINDOW_BUDGET values (fwd=N,bwd=M)")
    ap.add_argument("--out", help="JSON file for the rows")
    args = ap.parse_args()
    rows = []
    for cfg in args.configs.split(","):
        ratio, coff = map(int, cfg.split("x"))
        for budget in args.budgets:
            row = measure(ratio, coff, args.head_dim, budget)
            rows.append(row)
            cells = "  ".join(f"{k} {v['registers']} regs/{v['spill_bytes']} B spilled"
                              for k, v in row.items() if isinstance(v, dict))
            print(f"r{ratio} c{coff} d{args.head_dim} budget {budget}: fwd {row['fwd_family']}, "
                  f"bwd {row['bwd_family']}; {cells}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
