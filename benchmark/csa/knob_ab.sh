#!/usr/bin/env bash
# A/B of one planner knob (an environment variable the package reads at import): config_ab.sh
# with one configuration per value, labelled by the value. The JSON of run K of value V goes
# to $OUT/knob_ab/V.K (or ./knob_ab/V.K).
#
#   bash benchmark/csa/knob_ab.sh CSA_FRONTEND_STREAM_BWD_CLUSTER "1 2" \
#       1x65536x128x2x512,1x65536x128x2x256 bwd 2
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 KNOB \"VALUE VALUE ...\" SHAPES [DIRECTIONS=fwd,bwd] [ROUNDS=2]" >&2
    exit 2
fi
knob=$1 values=$2 shapes=$3 directions=${4:-fwd,bwd} rounds=${5:-2}
configs=()
for value in $values; do
    configs+=("$value:$knob=$value")
done
AB_DIR=knob_ab exec bash "$(dirname "$0")/config_ab.sh" "$shapes" "$directions" "$rounds" "${configs[@]}"
