#!/usr/bin/env bash
# Runs sanitize_cases.py (forward and backward of r4 c2 d128, r3 c1 d65 and r4 c2 d2 on ragged packs
# with empty and short segments, tails, spare tokens and padding rows; r64 c2 d128, r128 c2 d64
# (512-thread forward, backwards combining once per CTA) and r32 c1 d64 (the online forward;
# pipelined with it off, every warp combining) of the stream family, their backwards under both
# row-count schedules; every forward of these small packs both as the serial forward and as its
# family's own (the stream kernels also on launches of rows * ratio == tokens, where they guess
# their first rows, the backward under both schedules); r2 c2 d512 through the bulk-copy forward;
# r4 c2 d512 through the interleaved backward row walk; r4 c1 d520 through the wide (16-byte)
# register-window backward; r32 c1 d64's interleaved stream backward and forward walks and
# r64 c2 d128's interleaved stream backward; the atomic grad_ape path of five of them; backwards
# without grad_ape (a frozen ape) of two, deterministic and atomic; a side-stream call; a pack
# without rows) under compute-sanitizer's memcheck, racecheck and initcheck, one after another, and
# prints one summary line per tool. Exits non-zero if any tool reports an error, the script fails,
# or a run exceeds its time limit.
#
#   bash test/python/gpu/sanitize.sh                 # from the repository root, csa_frontend importable
#
# Environment: COMPUTE_SANITIZER (the binary; default: PATH, $CUDA_HOME/bin, /usr/local/cuda/bin,
# then the nvidia-cuda-sanitizer-api wheel), SANITIZE_TIMEOUT (seconds per tool, default 300),
# SANITIZE_LOG_DIR (full logs; default $OUT/sanitize or /tmp/csa_sanitize), PYTHON (default python3),
# SANITIZE_TOOLS (default "memcheck racecheck initcheck": one tool alone fits a longer limit).
#
# Scope, and why:
# - PYTORCH_NO_CUDA_MEMORY_CACHING=1: every tensor is its own cudaMalloc. With torch's caching
#   allocator a tensor sits inside a larger cached segment, and memcheck can only see accesses
#   that leave the segment, not the tensor; initcheck would also see "initialised" memory left
#   over from earlier tensors. Without caching both tools check each tensor's exact bounds.
# - initcheck without --track-unused-memory (off by default): only reads of never-written memory
#   are errors. Reports of allocated-but-unused bytes would flag torch's own allocations (and
#   outputs of zero rows), which say nothing about the kernels. The wrappers hand the kernels uninitialised outputs
#   (torch.empty), so a kernel that reads an element before writing it, or leaves one unwritten
#   that the script later reads back, is still an initcheck error.
# - racecheck checks shared-memory hazards of every kernel launched, torch's included.
set -u -o pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
limit="${SANITIZE_TIMEOUT:-300}"
logs="${SANITIZE_LOG_DIR:-${OUT:+$OUT/sanitize}}"
logs="${logs:-/tmp/csa_sanitize}"
mkdir -p "$logs"

find_sanitizer() {
  local candidate
  for candidate in "${COMPUTE_SANITIZER:-}" "$(command -v compute-sanitizer 2>/dev/null)" \
                   "${CUDA_HOME:-/nonexistent}/bin/compute-sanitizer" /usr/local/cuda/bin/compute-sanitizer; do
    [ -n "$candidate" ] && [ -x "$candidate" ] && { echo "$candidate"; return 0; }
  done
  # the pip wheel nvidia-cuda-sanitizer-api ships the binary inside site-packages
  "$python" - <<'EOF' 2>/dev/null
import glob, os, site
for root in site.getsitepackages() + [site.getusersitepackages()]:
    for path in glob.glob(os.path.join(root, "nvidia", "*", "compute-sanitizer", "compute-sanitizer")):
        if os.access(path, os.X_OK):
            print(path)
            raise SystemExit(0)
raise SystemExit(1)
EOF
}

sanitizer="$(find_sanitizer)" || { echo "sanitize.sh: compute-sanitizer not found (set COMPUTE_SANITIZER)"; exit 2; }
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "sanitize.sh: no CUDA device"; exit 77; }
echo "sanitize.sh: $("$sanitizer" --version | tail -n 1); logs in $logs"

# --report-api-errors no: CuTe DSL's GPU-arch detection probes driver entry points with
# cuGetProcAddress, and each probe of an absent one is reported as an API error (34 of them,
# H200 2026-11-29) although no kernel misbehaved; only device-side findings count here.
# initcheck: compute-sanitizer 2025.3's --track-unused-memory is a bare flag that turns the
# unused-memory report on, and it is off by default, so it is simply not passed.
declare -A options=([memcheck]="--report-api-errors no" [racecheck]="--report-api-errors no"
                    [initcheck]="--report-api-errors no")
# The target architecture is named, so the DSL does not probe the driver for it.
export CUTE_DSL_ARCH="${CUTE_DSL_ARCH:-sm_90a}"
status=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck}; do
  log="$logs/$tool.log"
  start=$(date +%s)
  # shellcheck disable=SC2086 # options[] holds separate words on purpose
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$limit" "$sanitizer" --tool "$tool" ${options[$tool]} \
    --error-exitcode 1 "$python" "$here/sanitize_cases.py" >"$log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - start ))
  summary="$(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -n 1 | sed 's/^=* *//')"
  case $rc in
    0) verdict=clean ;;
    124) verdict="TIMED OUT after ${limit}s" ;;
    *) verdict="FAILED (exit $rc)" ;;
  esac
  [ $rc -eq 0 ] || status=1
  printf '%-9s %-26s %4ss  %s\n' "$tool" "$verdict" "$seconds" "${summary:-no summary line, see $log}"
done
exit $status
