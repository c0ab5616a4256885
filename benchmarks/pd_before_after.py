"""`kvfence up` 1P1D of this tree against the same of another tree (a commit before a change),
interleaved A/B over HTTP in one run: the ratio a change makes to PD serving, not absolute speed.
Both clusters stay up for the whole run and pairs alternate which goes first. The hand-off alone
(the workers' transfer window) is tls_transfer.py's --before-ref.

    git worktree add /tmp/kvfence-base <commit>
    .venv/bin/python benchmarks/pd_before_after.py --base /tmp/kvfence-base
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    Server,
    add_http_ab_args,
    bench_model,
    http_ab_workload,
    interleaved_pairs,
    kvfence_server,
    machine,
    run_bench,
    this_command,
    write_json,
)
from benchmarks.up_threads import METRICS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base", required=True, help="a kvfence checkout to compare against")
    add_http_ab_args(p, "pd_before_after", num_prompts=32)
    p.add_argument("--after-args", default="", help="more `kvfence up` flags for this tree's side")
    a = p.parse_args(argv)
    cmd = this_command()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = bench_model(a.model, a.tiny)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    base = str(Path(a.base).resolve())
    sides = {  # PYTHONPATH wins over the editable install: "before" runs the base tree's code
        side: kvfence_server(
            "up",
            model,
            a.context_length,
            a.kv_pool_tokens,
            out / f"{a.name}-{side}.log",
            env={"PYTHONPATH": base} if side == "before" else None,
            extra=shlex.split(a.after_args) if side == "after" else (),
        )
        for side in ("after", "before")
    }

    def bench(srv: Server, seed: int) -> dict:
        return run_bench(
            srv.url, a.num_prompts, a.input_len, a.output_len, a.concurrency, vocab, seed=seed
        )

    pairs = interleaved_pairs(sides, a.pairs, bench, METRICS, "pd")
    ratios = {k: [pr["after"][k] / pr["before"][k] for pr in pairs] for k in METRICS}
    summary = {
        k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in ratios.items()
    }
    for k, s in summary.items():
        print(f"{k} after/before = {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})")
    write_json(
        out / f"{a.name}.json",
        {
            "command": cmd,
            "machine": machine(),
            "base": base,
            "server_commands": {side: srv.command for side, srv in sides.items()},
            "workload": http_ab_workload(a, model),
            "pairs": pairs,
            "ratios_after_over_before": ratios,
            "summary": summary,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
