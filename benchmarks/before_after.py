"""kvfence against another checkout of itself (e.g. the commit before an optimisation) on the
same offline workload, interleaved A/B in one run: the ratio of a change, not absolute speed.

    git worktree add /tmp/kvfence-base <commit>   # or: git archive <commit> | tar -x -C DIR
    .venv/bin/python benchmarks/before_after.py --base /tmp/kvfence-base
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    ROOT,
    bench_model,
    log_command,
    machine,
    ratio_ci,
    this_command,
    write_json,
)
from benchmarks.vs_engines import worker_argv  # noqa: E402


def run(root: str, a: argparse.Namespace, model: Path) -> dict:
    """The vs_engines kvfence worker, importing kvfence from `root` (PYTHONPATH wins over the
    editable install)."""
    env = {"PYTHONPATH": root}
    argv = worker_argv(sys.executable, "kvfence", a, model)
    log_command(argv, env)
    p = subprocess.run(
        argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=3600, check=True
    )
    res = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
    res.pop("outputs")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base", required=True, help="a kvfence checkout to compare against")
    p.add_argument("--model", default=None)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="before_after")
    a = p.parse_args(argv)
    cmd = this_command()
    model = bench_model(a.model, a.tiny)
    pairs = []
    for i in range(a.pairs):
        sides = [("base", a.base), ("new", str(ROOT))]
        if i % 2:
            sides.reverse()
        pairs.append({name: run(root, a, model) for name, root in sides})
        r = pairs[-1]
        print(
            f"pair {i + 1}: new/base throughput "
            f"{r['new']['total_tokens_per_s'] / r['base']['total_tokens_per_s']:.2f}, "
            f"batch-1 ms/token base/new "
            f"{r['base']['batch1_ms_per_token'] / r['new']['batch1_ms_per_token']:.2f}",
            flush=True,
        )
    summary = {
        "throughput_new_over_base": ratio_ci(
            [r["new"]["total_tokens_per_s"] / r["base"]["total_tokens_per_s"] for r in pairs]
        ),
        "batch1_speedup_base_ms_over_new_ms": ratio_ci(
            [r["base"]["batch1_ms_per_token"] / r["new"]["batch1_ms_per_token"] for r in pairs]
        ),
    }
    print(json.dumps(summary, indent=1))
    write_json(
        Path(a.out) / f"{a.name}.json",
        {
            "command": cmd,
            "machine": machine(),
            "base": a.base,
            "model": str(model),
            "workload": f"{a.num_prompts} x {a.input_len} -> {a.output_len}",
            "pairs": pairs,
            "summary": summary,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
