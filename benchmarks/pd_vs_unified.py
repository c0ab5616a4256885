"""PD (`kvfence up`: router + 1 prefill + 1 decode) vs unified (`kvfence serve`): TTFT and ITL by
prompt length, one request at a time, interleaved by length and repeat; PD's workers run on every
core each (`--threads`), as the unified server does. The hand-off's share of
PD's TTFT is estimated as (TTFT_pd - TTFT_unified) / TTFT_pd: everything disaggregation adds
(router hop, RESERVE, transfer, verification, commit) for the same compute.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    ROOT,
    kvfence_server,
    machine,
    new_figure,
    plot_available,
    run_bench,
    save_figure,
    this_command,
    write_json,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=str(ROOT / "models" / "kvfence-tiny"))
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--lengths", default="256,1024,2048,3584")
    p.add_argument("--context-length", type=int, default=4096)
    p.add_argument("--kv-pool-tokens", type=int, default=16384)
    p.add_argument("--num-prompts", type=int, default=6, help="per length and server, in turn")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed requests of each length before its timed ones (0: none; a short one per "
        "server still goes first, so a fresh PD pair's dial and handshake are never timed)",
    )
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="pd_vs_unified")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = this_command()
    lengths = [int(x) for x in a.lengths.split(",")]
    # One request at a time: PD's workers get every core each, as unified has, so the difference
    # is the hand-off and not `kvfence up`'s default split of the cores between its workers.
    cores = ["--threads", str(len(os.sched_getaffinity(0)))]
    servers = {
        mode: kvfence_server(
            "serve" if mode == "unified" else "up",
            a.model,
            a.context_length,
            a.kv_pool_tokens,
            out / f"{a.name}-{mode}.log",
            extra=cores if mode == "pd" else (),
        )
        for mode in ("unified", "pd")
    }
    raw: dict[str, dict[int, list[dict]]] = {k: {n: [] for n in lengths} for k in servers}
    try:
        for s in servers.values():
            s.wait_ready()
            run_bench(s.url, 1, min(64, *lengths), 4, 1, a.vocab_size, seed=7, warmup=0)
        for r in range(a.rounds):
            for n in lengths:
                order = list(servers) if (r + lengths.index(n)) % 2 == 0 else list(servers)[::-1]
                for k in order:
                    res = run_bench(
                        servers[k].url,
                        a.num_prompts,
                        n,
                        a.output_len,
                        1,
                        a.vocab_size,
                        seed=r * 100 + n,
                        warmup=a.warmup,
                    )
                    raw[k][n].append(res)
                    print(
                        f"round {r + 1} len {n} {k}: TTFT p50 {res['ttft_ms']['p50']:.1f} ms,"
                        f" ITL p50 {res['itl_ms']['p50']:.1f} ms",
                        flush=True,
                    )
    finally:
        for s in servers.values():
            s.stop()

    def mean(rs: list[dict], key: str, stat: str) -> float:
        return sum(x[key][stat] for x in rs) / len(rs)

    table = {}
    for n in lengths:
        row = {}
        for k in servers:
            for key in ("ttft_ms", "itl_ms", "tpot_ms"):
                for stat in ("mean", "p50", "p99"):
                    row[f"{k}_{key}_{stat}"] = mean(raw[k][n], key, stat)
        row["handoff_ms"] = row["pd_ttft_ms_mean"] - row["unified_ttft_ms_mean"]
        row["handoff_share_of_pd_ttft"] = row["handoff_ms"] / row["pd_ttft_ms_mean"]
        table[n] = row
        print(
            f"len {n}: TTFT unified {row['unified_ttft_ms_mean']:.1f} / pd "
            f"{row['pd_ttft_ms_mean']:.1f} ms (hand-off {row['handoff_share_of_pd_ttft']:.0%}); "
            f"ITL p50 unified {row['unified_itl_ms_p50']:.1f} / pd {row['pd_itl_ms_p50']:.1f}"
        )
    result = {
        "command": cmd,
        "machine": machine(),
        "server_commands": {k: s.command for k, s in servers.items()},
        "output_len": a.output_len,
        "num_prompts_per_round": a.num_prompts,
        "rounds": a.rounds,
        "by_length": table,
    }
    write_json(out / f"{a.name}.json", result)
    if plot_available():
        fig, axes = new_figure(1, 2, figsize=(11, 4))
        for k in servers:
            axes[0].plot(lengths, [table[n][f"{k}_ttft_ms_mean"] for n in lengths], "o-", label=k)
            axes[1].plot(lengths, [table[n][f"{k}_itl_ms_p50"] for n in lengths], "o-", label=k)
        for n in lengths:
            axes[0].annotate(
                f"{table[n]['handoff_share_of_pd_ttft']:.0%}",
                (n, table[n]["pd_ttft_ms_mean"]),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=8,
            )
        axes[0].set_xlabel("prompt tokens")
        axes[0].set_ylabel("TTFT mean (ms); label: hand-off share")
        axes[1].set_xlabel("prompt tokens")
        axes[1].set_ylabel("ITL p50 (ms)")
        for ax in axes:
            ax.legend()
        save_figure(fig, out / f"{a.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
