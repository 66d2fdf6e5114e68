#!/usr/bin/env bash
# A/B of one planner knob (an environment variable the package reads at import), one process
# per run: bench_csa_compressor.py under each value in turn, alternating for ROUNDS rounds so
# that a slow spell of the device hits every value alike. Prints each run's table; the JSON of
# run K of value V goes to $OUT/knob_ab/V.K (or ./knob_ab/V.K).
#
#   bash benchmark/csa/knob_ab.sh CSA_FRONTEND_STREAM_BWD_CLUSTER "1 2" \
#       1x65536x128x2x512,1x65536x128x2x256 bwd 2
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 KNOB \"VALUE VALUE ...\" SHAPES [DIRECTIONS=fwd,bwd] [ROUNDS=2]" >&2
    exit 2
fi
knob=$1 values=$2 shapes=$3 directions=${4:-fwd,bwd} rounds=${5:-2}
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-.}/knob_ab
for round in $(seq 1 "$rounds"); do
    for value in $values; do
        echo "== $knob=$value, round $round"
        env "$knob=$value" python "$here/bench_csa_compressor.py" --shapes "$shapes" --providers fused \
            --directions "$directions" --out "$out/$value.$round" | grep -v '^{'
    done
done
