#!/usr/bin/env bash
# The long cache-mix chaos soak (kvfence/tools/chaos_cache.py) over the four topologies, as two
# soaks side by side (unified then 2P1D; 1P1D then TP=2), each topology for SECONDS seconds with
# two restarts, every action fault point armed at 5%; then one summary of both.
#   nohup nice -n 10 scripts/chaos_cache.sh [SECONDS] [OUT] > chaos_cache.log 2>&1 &
# (SECONDS defaults to 1900 per topology, about 70 minutes in all on a loaded 2-core machine;
# OUT to benchmarks/results/chaos_cache.json; each cluster's log goes to OUT's folder/logs.)
set -uo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH="${1:-1900}"
OUT="${2:-benchmarks/results/chaos_cache.json}"
DIR="$(dirname "$OUT")"
LOGS="$(mktemp -d "${TMPDIR:-/tmp}/chaos-cache-logs.XXXXXX")"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
SEED="${FAULT_SEED:-$RANDOM$RANDOM}"
soak() {  # name topologies
    "$PY" -m kvfence.tools.chaos_cache --topologies "$2" --duration "$SECONDS_EACH" \
        --concurrency 8 --kv-pool-tokens 768 --restarts 2 --fault-seed "$SEED" \
        --log-dir "$LOGS" --out "$DIR/chaos_cache_$1.json" > "$LOGS/$1.out" 2>&1
}
soak a unified,2P1D &
A=$!
soak b 1P1D,TP2 &
B=$!
wait "$A" "$B"
"$PY" -m kvfence.tools.chaos_cache --merge "$DIR/chaos_cache_a.json" "$DIR/chaos_cache_b.json" \
    --out "$OUT"
rc=$?
rm -f "$DIR/chaos_cache_a.json" "$DIR/chaos_cache_b.json"
echo "logs: $LOGS"
exit $rc
