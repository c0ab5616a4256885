#!/usr/bin/env bash
# Coverage-guided fuzzing (atheris) of every parser a peer or a tenant reaches, N inputs per
# target; prints the inputs tried per target and fails if any input escaped as anything but
# its parser's clean rejection, or ran past the time or memory cap.
#   scripts/fuzz.sh [N] [target ...]       (N defaults to 100000; targets: tests/fuzz/targets.py)
# Needs atheris (`pip install -e .[fuzz]`). Crash inputs land in ./fuzz-crashes/.
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-100000}"
shift || true
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
  TARGETS=(wire_header session handshake hop structured tools grammar)
fi
mkdir -p fuzz-crashes
status=0
printf '%-12s %10s %8s %s\n' target inputs seconds result
for t in "${TARGETS[@]}"; do
  log="fuzz-crashes/$t.log"
  start=$(date +%s)
  # Per input: 20 s wall (a grammar compile is bounded at 10 s), 3 GiB of memory in all.
  if nice "$PY" tests/fuzz/run.py "$t" -runs="$N" -timeout=20 -rss_limit_mb=3072 \
      -max_len=65536 -print_final_stats=1 -artifact_prefix="fuzz-crashes/$t-" >"$log" 2>&1; then
    result=ok
  else
    result="FAILED (see $log)"
    status=1
  fi
  runs=$(grep -oE '^Done [0-9]+ runs' "$log" | grep -oE '[0-9]+' || true)
  printf '%-12s %10s %8s %s\n' "$t" "${runs:-?}" "$(($(date +%s) - start))" "$result"
done
exit $status
