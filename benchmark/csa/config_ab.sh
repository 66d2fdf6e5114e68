#!/usr/bin/env bash
# A/B of whole planner configurations (any number of knobs each; the package reads them at
# import), one process per run: bench_csa_compressor.py under each configuration in turn,
# alternating for ROUNDS rounds so that a slow spell of the device hits every one alike. A
# configuration is LABEL:ASSIGNMENTS, the assignments space-separated (none: the defaults).
# Prints each run's table; the JSON of run K of LABEL goes to $OUT/$AB_DIR/LABEL.K (AB_DIR
# defaults to config_ab; without $OUT, under the current directory; an absolute AB_DIR is used
# as it is, not nested under $OUT).
#
#   bash benchmark/csa/config_ab.sh 1x65536x128x2x512,4x8192x16x2x256 bwd 2 \
#       "before:CSA_FRONTEND_STREAM_BWD_WALK_COFFS=1 CSA_FRONTEND_STREAM_BWD_LONG_GRID_SMS=0" "now:"
set -euo pipefail
if [ $# -lt 4 ]; then
    echo "usage: $0 SHAPES DIRECTIONS ROUNDS LABEL:ASSIGNMENTS [LABEL:ASSIGNMENTS ...]" >&2
    exit 2
fi
shapes=$1 directions=$2 rounds=$3
shift 3
here=$(cd "$(dirname "$0")" && pwd)
case "${AB_DIR:-}" in
    /*) out=$AB_DIR ;;
    *) out=${OUT:-.}/${AB_DIR:-config_ab} ;;
esac
for round in $(seq 1 "$rounds"); do
    for config in "$@"; do
        label=${config%%:*} assignments=${config#*:}
        echo "== $label (${assignments:-defaults}), round $round"
        # shellcheck disable=SC2086 # the assignments are separate words on purpose
        env $assignments python "$here/bench_csa_compressor.py" --shapes "$shapes" --providers fused \
            --directions "$directions" --out "$out/$label.$round" | grep -v '^{'
    done
done
