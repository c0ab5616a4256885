#!/usr/bin/env bash
# The OpenAI HTTP surface fuzzed from the server's own OpenAPI document (schemathesis): every
# operation, N examples per generation mode (positive, negative), on a unified tiny-model worker
# and through the router in front of a prefill/decode pair. Prints the responses per status and
# fails on any 5xx or any answer the document does not admit.
#   scripts/schemathesis.sh [N]      (N defaults to 100; needs `pip install -e .[fuzz]`)
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-100}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec nice "${PYTHON:-python}" - "$N" <<'PY'
import sys
import time

sys.path[:0] = ["tests"]
from openapi_props import run, worker_and_router  # noqa: E402

n = int(sys.argv[1])
bad = 0
with worker_and_router() as (worker, router, doc):
    for where, url in (("worker", worker), ("router", router)):
        start = time.monotonic()
        tally = run(doc, url, n)
        print(f"{tally.line(where)} in {time.monotonic() - start:.0f} s", flush=True)
        for failure in tally.failures:
            print("   ", failure)
        bad += len(tally.failures)
sys.exit(1 if bad else 0)
PY
