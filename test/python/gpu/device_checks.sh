#!/usr/bin/env bash
# The device session's checks as one command: the GPU suite, the sanitizer, a fuzz range and the
# SPEC table, in the order given, each step's whole output in its own log as it runs. Device calls
# are short and can be cut off; a step cut off still leaves its log (and every earlier step's)
# under $OUT, which is what comes back from the device.
#
#   bash test/python/gpu/device_checks.sh suite sanitize fuzz:18898-19097 table
#
# Steps:
#   suite          every gpu-marked test, L0 and L1 (test/python/run_suite.py gpu)
#   sanitize       test/python/gpu/sanitize.sh (its own SANITIZE_* variables apply; its logs by
#                  default under this script's, in sanitize/)
#   fuzz:A-B       test_fuzz.py over seeds A..B (CSA_FRONTEND_FUZZ_SEEDS)
#   table          bench_csa_compressor.py --shapes all with the eager and copy providers, then
#                  targets.py on its JSON (the SPEC section 6 verdicts)
# suite and fuzz run over DEVICE_CHECKS_WORKERS pytest-xdist workers where xdist is installed and
# the count is not 0, else in one process.
# Environment: DEVICE_CHECKS_LOG_DIR (default $OUT/device_checks or /tmp/csa_device_checks),
# DEVICE_CHECKS_WORKERS (default 15), PYTHON (default python3), DEVICE_CHECKS_DRY_RUN=1 (print each
# step's command and run nothing; no GPU needed). Every step is checked before the first one runs,
# so a typo costs no device time. Prints one line per step (verdict, seconds, the log's summary);
# exits 1 if any step failed or a pytest step saw no CUDA device (NOTHING RAN), 2 on a bad argument.
set -u -o pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
python="${PYTHON:-python3}"
workers="${DEVICE_CHECKS_WORKERS:-15}"
logs="${DEVICE_CHECKS_LOG_DIR:-${OUT:+$OUT/device_checks}}"
logs="${logs:-/tmp/csa_device_checks}"
dry="${DEVICE_CHECKS_DRY_RUN:-0}"

usage() { echo "device_checks.sh: $1; steps: suite, sanitize, fuzz:A-B, table" >&2; exit 2; }

[ $# -gt 0 ] || usage "no step given"
case "$workers" in ''|*[!0-9]*) usage "DEVICE_CHECKS_WORKERS must be an integer >= 0, got '$workers'" ;; esac
for step in "$@"; do
  case "$step" in
    suite|sanitize|table) ;;
    fuzz:*)
      range="${step#fuzz:}"
      [[ "$range" =~ ^([0-9]+)-([0-9]+)$ ]] && [ "${BASH_REMATCH[1]}" -le "${BASH_REMATCH[2]}" ] \
        || usage "step '$step': expected fuzz:A-B with integers A <= B" ;;
    *) usage "unknown step '$step'" ;;
  esac
done

# pytest-xdist spreads the suite over the device machine's cores; without it, one process.
xdist=false
"$python" -c "import xdist" 2>/dev/null && xdist=true

# The command of one step, as words for bash -c (run from the repository root). The suite is
# CTest's GPU suite (run_suite.py: the gpu marker over all of test/python, exit 77 without CUDA).
command_of() {
  local parallel=""
  [ "$workers" -gt 0 ] && $xdist && parallel=" -n $workers"
  case "$1" in
    suite) echo "$python test/python/run_suite.py gpu -q$parallel" ;;
    sanitize) echo "SANITIZE_LOG_DIR='${SANITIZE_LOG_DIR:-$logs/sanitize}' bash test/python/gpu/sanitize.sh" ;;
    fuzz:*) echo "CSA_FRONTEND_FUZZ_SEEDS=${1#fuzz:} $python -m pytest -p no:cacheprovider -q$parallel" \
                 "-m 'L1 and gpu' test/python/gpu/test_fuzz.py" ;;
    table) echo "cd benchmark/csa && $python bench_csa_compressor.py --shapes all --providers fused,eager,copy" \
                "--out '$logs/table' && $python targets.py '$logs/table/bench_csa_compressor.json'" ;;
  esac
}

# The lines of a finished step's log that say how it went.
summary_of() {
  case "$1" in
    suite|fuzz:*) grep -E '(passed|failed|skipped|error|no tests ran|no CUDA device)' "$2" | tail -n 1 ;;
    sanitize) grep -E '^(memcheck|racecheck|initcheck) ' "$2" | tr -s ' ' | paste -sd ';' - ;;
    table) grep -iE 'meet|targets' "$2" | tail -n 1 ;;
  esac
}

if [ "$dry" = 1 ]; then
  for step in "$@"; do echo "$step: $(command_of "$step")"; done
  exit 0
fi

mkdir -p "$logs" && logs="$(cd "$logs" && pwd)"  # absolute: the steps run from the root
cd "$root" || exit 2
device="$(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader 2>/dev/null | head -n 1)"
commit="$(git rev-parse --short HEAD 2>/dev/null || echo 'no git')"
echo "device_checks.sh: ${device:-no nvidia-smi}; commit $commit; logs in $logs"
status=0
for step in "$@"; do
  log="$logs/${step/:/_}.log"
  start=$(date +%s)
  bash -c "$(command_of "$step")" >"$log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - start ))
  summary="$(summary_of "$step" "$log")"
  # run_suite.py's 77, or every test skipped: no CUDA device was seen, which is not a pass
  if [ "$step" = suite ] && [ $rc -eq 77 ]; then
    verdict="NOTHING RAN"
  elif [ $rc -ne 0 ]; then
    verdict="FAILED (exit $rc)"
  elif [[ "$step" =~ ^(suite|fuzz:) ]] && [[ ! "$summary" =~ passed ]]; then
    verdict="NOTHING RAN"
  else
    verdict=ok
  fi
  [ "$verdict" = ok ] || status=1
  printf '%-18s %-16s %5ss  %s\n' "$step" "$verdict" "$seconds" "${summary:-no summary line, see $log}"
done
exit $status
