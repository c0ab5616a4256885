"""`kvfence up` on one host: each worker on its share of the cores (the default, --threads =
cores / workers) against every worker on all of them (--threads = cores, torch's own default),
interleaved A/B over HTTP. Both clusters stay up for the whole run; pairs alternate which goes
first. Ratios are split / all: below 1 for latencies and above 1 for throughput favour the split.
"""

from __future__ import annotations

import argparse
import json
import os
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
    new_figure,
    plot_available,
    ratio_ci,
    run_bench,
    save_figure,
    this_command,
    write_json,
)

METRICS = {
    "throughput": lambda r: r["total_token_throughput"],
    "p50_ttft_ms": lambda r: r["ttft_ms"]["p50"],
    "p50_itl_ms": lambda r: r["itl_ms"]["p50"],
    "p99_itl_ms": lambda r: r["itl_ms"]["p99"],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    add_http_ab_args(p, "up_threads", num_prompts=16)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = bench_model(a.model, a.tiny)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    cores = len(os.sched_getaffinity(0))
    # "split": up's default share of the cores; "all": every worker on every core.
    sides = {
        side: kvfence_server(
            "up",
            model,
            a.context_length,
            a.kv_pool_tokens,
            out / f"{a.name}-{side}.log",
            extra=["--threads", str(cores)] if side == "all" else [],
        )
        for side in ("split", "all")
    }

    def bench(srv: Server, seed: int) -> dict:
        return run_bench(
            srv.url, a.num_prompts, a.input_len, a.output_len, a.concurrency, vocab, seed=seed
        )

    pairs = interleaved_pairs(sides, a.pairs, bench, METRICS, "up")
    ratios = {k: [pr["split"][k] / pr["all"][k] for pr in pairs] for k in METRICS}
    summary = {k: ratio_ci(v) for k, v in ratios.items()}
    for k, s in summary.items():
        print(f"{k} split/all = {s['mean']:.3f} (95% CI {s['lo']:.3f}..{s['hi']:.3f}, n={s['n']})")
    result = {
        "command": this_command(),
        "machine": machine(),
        "cores": cores,
        "server_commands": {side: srv.command for side, srv in sides.items()},
        "workload": http_ab_workload(a, model),
        "pairs": pairs,
        "ratios_split_over_all": ratios,
        "summary": summary,
    }
    write_json(out / f"{a.name}.json", result)
    if plot_available():
        fig, ax = new_figure(figsize=(6, 4))
        for j, k in enumerate(METRICS):
            ax.scatter([j] * len(ratios[k]), ratios[k], alpha=0.5, color="gray")
            ax.scatter([j], [summary[k]["mean"]], color="C0", zorder=3)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(METRICS)), list(METRICS))
        ax.set_ylabel("threads split / all cores per worker")
        ax.set_title(f"kvfence up, 1 prefill + 1 decode, {cores} cores")
        save_figure(fig, out / f"{a.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
