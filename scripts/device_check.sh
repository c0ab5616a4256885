#!/usr/bin/env bash
# One prepared device check (scripts/device_check.py says what it prints):
#   scripts/device_check.sh [--device cuda|cpu] [--size gpu|tiny] [--json FILE]
# On a bare accelerator machine (torch and triton only) it installs kvfence's other dependencies
# first, keeping the machine's torch: the project's torch pin is a CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-}
if [ -z "$py" ]; then
    if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
if ! "$py" -c 'import torch' >/dev/null 2>&1; then
    echo "NOT RUN: $py has no torch (a device machine brings its own; here: make test first)" >&2
    exit 1
fi
if ! "$py" -c 'import kvfence, transformers, fastapi, xxhash, llguidance' >/dev/null 2>&1; then
    deps=$("$py" -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print(" ".join(d for d in p["dependencies"] if not d.startswith("torch")))')
    # shellcheck disable=SC2086  # one word per requirement
    "$py" -m pip install --quiet $deps "transformers>=4.51"
    "$py" -m pip install --quiet --no-deps -e .
fi
exec "$py" scripts/device_check.py "$@"
