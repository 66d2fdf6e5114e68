"""Instruction budget of one compiled kernel, read from its SASS on a CPU-only machine: registers
(ptxas), instructions in all, and per barrier-delimited region, the way NOTES rows 130-131
counted the serial forward. The kernel is compiled for sm_90a in a child process (knobs such as
``CSA_FRONTEND_SERIAL_FWD_LEAN`` are read at import, so ``--env`` sets them there), ptxas
assembles its PTX and nvdisasm prints the SASS. nvdisasm is not in this machine's CUDA install;
PyPI's ``nvidia-cuda-nvdisasm`` wheel holds it (``pip download nvidia-cuda-nvdisasm --no-deps``,
unzip, pass ``--nvdisasm .../nvidia/cu13/bin/nvdisasm``).

    python benchmark/csa/sass_budget.py --kernel serial --config 128x2x128 --nvdisasm PATH \
        [--env CSA_FRONTEND_SERIAL_FWD_LEAN=1]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from window_registers import ROOT, parse_ptxas

CHILD = """
import sys
from csa_frontend.compressor.kernels import dispatch
from csa_frontend.compressor.kernels.schedule import (bulk_forward_schedule, choose_schedule, serial_forward_schedule,
                                                     wide_rows_schedule)
kind, ratio, coff, d, path = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
options = dispatch._options  # keep the PTX (the DSL also writes it into the dump directory)
dispatch._options = lambda arch, cubin_dir=None: f"{options(arch, cubin_dir)} --keep-ptx --dump-dir={sys.argv[6]}"
sched = {"serial": lambda: serial_forward_schedule(ratio, coff, d), "fwd": lambda: choose_schedule(ratio, coff, d, "fwd"),
         "bwd": lambda: choose_schedule(ratio, coff, d, "bwd"),
         "bulk": lambda: bulk_forward_schedule(ratio, coff, d, "sm_90a"),
         "wide": lambda: wide_rows_schedule(ratio, coff, d)}[kind]()
build = dispatch._build_backward if kind in ("bwd", "wide") else dispatch._build_forward
fn = build(ratio, coff, d, sched, "sm_90a")[0]
open(path, "w").write(str(fn.artifacts.PTX))
print(sched)
"""
#: ``/*0a40*/  @!P0 LDG.E.U16 R20, ...``: the opcode's mnemonic, without its modifiers
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)", re.M)


def sass_regions(sass: str):
    """Instruction counts of a kernel's SASS: (opcode counter of all, instructions per region),
    a region ending at each ``BAR`` (the barrier counts in the region it closes)."""
    ops = INSTRUCTION.findall(sass)
    regions = [0]
    for op in ops:
        regions[-1] += 1
        if op == "BAR":
            regions.append(0)
    return collections.Counter(ops), regions


def compile_ptx(kind: str, ratio: int, coff: int, head_dim: int, env: dict, ptx: Path) -> str:
    child_env = dict(os.environ, **env, PYTHONPATH=f"{ROOT / 'python'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, "-c", CHILD, kind, str(ratio), str(coff), str(head_dim), str(ptx),
                          str(ptx.parent)], env=child_env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=["serial", "fwd", "bwd", "bulk", "wide"], default="serial")
    ap.add_argument("--config", default="128x2x128", help="RATIOxCOFFxHEAD_DIM")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the compiling process")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"), help="path of nvdisasm")
    ap.add_argument("--sass", help="also write the disassembly to this file")
    args = ap.parse_args()
    if not args.nvdisasm:
        ap.error("--nvdisasm: not on PATH; see the module docstring for where to get it")
    ratio, coff, head_dim = map(int, args.config.split("x"))
    env = dict(item.split("=", 1) for item in args.env)
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        sched = compile_ptx(args.kernel, ratio, coff, head_dim, env, ptx)
        verbose = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx), "-o", str(cubin)],
                                 capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([args.nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    if args.sass:
        Path(args.sass).write_text(sass)
    ops, regions = sass_regions(sass)
    res = parse_ptxas(verbose)
    print(f"{args.kernel} r{ratio} c{coff} d{head_dim} {' '.join(args.env)}: {sched}")
    print(f"registers {res['registers']}, spills {res['spill_bytes']} B, instructions {sum(ops.values())}")
    print("per region (barrier to barrier): " + ", ".join(str(n) for n in regions))
    print("most frequent: " + ", ".join(f"{op} {n}" for op, n in ops.most_common(12)))


if __name__ == "__main__":
    main()
