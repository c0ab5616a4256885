"""The tenant-scoped prefix cache on the workloads it exists for, against vLLM's in the same run:
SGLang-style generated shared prefixes (a 1,024-token system prompt per tenant + a 128-token
question -> 64 tokens, 8 tenants x 8 prompts), the same with ONE public system prompt for all
tenants, and multi-turn chat; and random prompts (no reuse) for what the cache costs.

Engines, each its own server process, started and stopped per round (so every round starts with
a cold cache), the order reversed every round:
  kvfence-cache    kvfence serve (cache on: the default), one API key per tenant
  kvfence-nocache  kvfence serve --no-enable-prefix-caching
  kvfence-shared   kvfence serve --shared-prefix-file (the one system prompt declared public)
  vllm             vLLM's API server with --enable-prefix-caching, sent `cache_salt` per tenant
                   (its safe configuration) and, on separate prompts, no salt (the unsafe one)
Random-prompt cost: kvfence-cache vs kvfence-nocache, both up, interleaved pairs.

    .venv/bin/python benchmarks/prefix_cache.py --rounds 2 --random-pairs 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH

from benchmarks.common import (  # noqa: E402
    RESULTS,
    Server,
    bench_model,
    interleaved_pairs,
    kvfence_server,
    log_command,
    machine,
    ratio_ci,
    this_command,
    vllm_server,
    write_json,
)

TENANTS = 8
KEYS = [f"bench-key-{i}" for i in range(TENANTS)]
KEPT = ("total_token_throughput", "ttft_ms", "itl_ms", "e2e_latency_ms", "completed", "failed",
        "cached_token_share", "num_prompts", "total_input_tokens")
# (workload, salt mode) per engine; a workload name maps to its bench flags below.
PLAN = {
    "kvfence-cache": [("shared-prefix", "none"), ("one-system-prompt", "none"),
                      ("multi-turn", "none")],
    "kvfence-nocache": [("shared-prefix", "none"), ("multi-turn", "none")],
    "kvfence-shared": [("one-system-prompt", "none")],
    # cache on without the step-time budget (issue 23's ITL bound traded for throughput)
    "kvfence-nobudget": [("shared-prefix", "none")],
    "vllm": [("shared-prefix", "per-tenant"), ("shared-prefix", "none"),
             ("one-system-prompt", "none"), ("one-system-prompt", "per-tenant"),
             ("multi-turn", "per-tenant")],
}


def workload_argv(name: str, a: argparse.Namespace, seed: int) -> list[str]:
    common = ["--output-len", str(a.output_len), "--concurrency", str(a.concurrency),
              "--vocab-size", str(a.vocab), "--seed", str(seed), "--warmup", "1",
              "--no-progress", *sum((["--api-key", k] for k in KEYS), [])]
    gsp = ["--num-groups", str(TENANTS), "--prompts-per-group", str(a.prompts_per_group),
           "--system-prompt-len", str(a.system_prompt_len), "--question-len",
           str(a.question_len)]
    if name == "shared-prefix":
        return ["--dataset", "shared-prefix", *gsp, *common]
    if name == "one-system-prompt":
        return ["--dataset", "shared-prefix", "--one-system-prompt", *gsp, *common]
    if name == "multi-turn":
        return ["--dataset", "multi-turn", "--num-prompts", str(a.chats), "--num-turns",
                str(a.turns), "--input-len", str(a.chat_input_len), "--question-len",
                str(a.chat_question_len), "--text-words", "ids", *common]
    if name == "random":
        return ["--dataset", "random", "--num-prompts", str(a.random_prompts), "--input-len",
                str(a.random_input_len), *common]
    raise ValueError(name)


def run_bench(url: str, argv: list[str]) -> dict:
    from kvfence.tools import bench

    full = ["--base-url", url, *argv]
    log_command(["kvfence", "bench", "serve", *full])
    code, result = asyncio.run(bench.bench(bench.parse_args(full)))
    if code != 0:
        raise RuntimeError(f"bench failed ({code}): {result.get('error') or result.get('errors')}")
    return {k: result[k] for k in KEPT}


def start(engine: str, a: argparse.Namespace, model: Path, tmp: Path, shared: Path) -> Server:
    log = Path(a.out) / f"prefix_cache-{engine}-server.log"
    if engine.startswith("kvfence"):
        extra = ["--api-key-file", str(tmp / "keys.txt")]
        if engine == "kvfence-nocache":
            extra.append("--no-enable-prefix-caching")
        if engine == "kvfence-shared":
            extra += ["--shared-prefix-file", str(shared)]
        if engine == "kvfence-nobudget":
            extra += ["--max-decode-step-ms", "0"]
        extra += ["--dtype", a.dtype]
        return kvfence_server("serve", model, a.context_length, pool_tokens(a), log, extra=extra)
    return vllm_server(a.vllm_python, model, a.context_length, log, prefix_caching=True,
                       dtype=a.dtype)


def pool_tokens(a: argparse.Namespace) -> int:
    """kvfence's pool in tokens: the same bytes as vLLM's KV space, so a bf16 pool (half the
    bytes per token) holds twice the tokens, as vLLM's does."""
    return a.pool_tokens * (2 if a.dtype == "bfloat16" else 1)


def shared_prompt_file(a: argparse.Namespace, path: Path, seed: int) -> None:
    """The one system prompt of the one-system-prompt workload at this seed, as the token ids
    the bench sends: what the operator declares public with --shared-prefix-file."""
    from kvfence.tools.bench_datasets import DatasetArgs, make_sessions, shared_prefixes

    sessions = make_sessions(DatasetArgs(
        "shared-prefix", 0, 0, a.vocab, seed, False, tuple(KEYS), "none", TENANTS,
        a.prompts_per_group, a.system_prompt_len, a.question_len, True,
    ))
    path.write_text(json.dumps(shared_prefixes(sessions, a.system_prompt_len)))


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: build the SmolLM-135M-shaped one")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model, small workloads (smoke)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--engines", default=",".join(PLAN))
    p.add_argument("--workloads", default="shared-prefix,one-system-prompt,multi-turn",
                   help="which of the workloads to run (the random A/B is --random-pairs)")
    p.add_argument("--random-pairs", type=int, default=6, help="0 skips the random-prompt A/B")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-prompt-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--chats", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--chat-input-len", type=int, default=256)
    p.add_argument("--chat-question-len", type=int, default=64)
    p.add_argument("--random-prompts", type=int, default=32)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--context-length", type=int, default=2048)
    # vLLM's CPU KV space is 1 GiB here (VLLM_CPU_KVCACHE_SPACE=1): about 23k tokens of this
    # model; kvfence gets the same room for running requests plus its cache.
    p.add_argument("--pool-tokens", type=int, default=23_000, help="in float32; doubled in bf16")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="both engines' weights, activations and KV cache")
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="prefix_cache")
    a = p.parse_args(argv)
    if a.tiny:
        a.prompts_per_group, a.system_prompt_len, a.question_len, a.output_len = 2, 64, 16, 4
        a.chats, a.turns, a.chat_input_len, a.chat_question_len = 2, 2, 32, 8
        a.random_prompts, a.random_input_len, a.context_length = 4, 32, 512
        a.pool_tokens = 4096
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = this_command()
    model = bench_model(a.model, a.tiny)
    a.vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    workloads = set(a.workloads.split(","))
    plan = {e: [(w, s) for w, s in runs if w in workloads] for e, runs in PLAN.items()}
    engines = [e for e in a.engines.split(",") if e and plan.get(e)]
    skipped: dict[str, str] = {}
    if "vllm" in engines and not Path(a.vllm_python).exists():
        skipped["vllm"] = f"{a.vllm_python} not found (make it with benchmarks/setup_vllm.sh)"
        engines.remove("vllm")
    tmp = Path(tempfile.mkdtemp(prefix="kvfence-prefix-bench-"))
    (tmp / "keys.txt").write_text("".join(f"{k} tenant{i}\n" for i, k in enumerate(KEYS)))
    rounds: list[dict[str, dict]] = []
    for r in range(a.rounds):
        seed = 100 + r  # every engine sees the same prompts in a round, fresh ones next round
        shared = tmp / f"shared-{seed}.json"
        shared_prompt_file(a, shared, seed)
        order = engines if r % 2 == 0 else engines[::-1]
        rounds.append({})
        for e in order:
            srv = start(e, a, model, tmp, shared)
            res: dict[str, dict] = {"server_command": srv.command}  # type: ignore[dict-item]
            try:
                srv.wait_ready(timeout=600)
                for i, (w, salt) in enumerate(plan[e]):
                    # vLLM's salted and unsalted runs of one workload must not share prompts
                    s = seed + 1000 * i if e == "vllm" else seed
                    if w == "one-system-prompt":
                        s = seed  # the declared prompt is this round's one
                    res[f"{w}/{salt}"] = run_bench(
                        srv.url, [*workload_argv(w, a, s), "--cache-salt", salt]
                    )
                    print(f"round {r + 1} {e} {w}/{salt}: "
                          f"{res[f'{w}/{salt}']['total_token_throughput']:.1f} tok/s, TTFT p50 "
                          f"{res[f'{w}/{salt}']['ttft_ms']['p50']:.0f} ms", flush=True)
            except Exception as ex:  # noqa: BLE001 - recorded; the other engines still run
                res["error"] = f"{type(ex).__name__}: {ex}"[-1500:]  # type: ignore[assignment]
                print(f"round {r + 1} {e}: {res['error']}", flush=True)
            finally:
                srv.stop()
            rounds[-1][e] = res

    def med(e: str, key: str, metric: str) -> float:
        xs = []
        for rd in rounds:
            run = rd.get(e, {}).get(key)
            if isinstance(run, dict) and "ttft_ms" in run:
                xs.append(run["ttft_ms"]["p50"] if metric == "ttft_p50"
                          else run["total_token_throughput"])
        return median(xs)

    summary = {
        f"{e}|{k}": {"throughput": med(e, k, "tput"), "ttft_p50_ms": med(e, k, "ttft_p50")}
        for e in engines for k in [f"{w}/{s}" for w, s in plan[e]]
    }

    def ratio(x: float, y: float) -> float:
        return x / y if y == y and y else float("nan")

    goals = {
        "shared-prefix TTFT p50 cache off / on (goal >= 3)": ratio(
            summary.get("kvfence-nocache|shared-prefix/none", {}).get("ttft_p50_ms", float("nan")),
            summary.get("kvfence-cache|shared-prefix/none", {}).get("ttft_p50_ms", float("nan"))),
        "shared-prefix throughput kvfence / vLLM per-tenant salt (goal >= 1.0)": ratio(
            summary.get("kvfence-cache|shared-prefix/none", {}).get("throughput", float("nan")),
            summary.get("vllm|shared-prefix/per-tenant", {}).get("throughput", float("nan"))),
        "shared-prefix throughput kvfence without the step budget / vLLM per-tenant salt": ratio(
            summary.get("kvfence-nobudget|shared-prefix/none", {}).get("throughput", float("nan")),
            summary.get("vllm|shared-prefix/per-tenant", {}).get("throughput", float("nan"))),
        "one system prompt: kvfence declared shared / vLLM no salt (goal >= 0.9)": ratio(
            summary.get("kvfence-shared|one-system-prompt/none", {}).get("throughput",
                                                                         float("nan")),
            summary.get("vllm|one-system-prompt/none", {}).get("throughput", float("nan"))),
        "multi-turn throughput kvfence / vLLM per-tenant salt": ratio(
            summary.get("kvfence-cache|multi-turn/none", {}).get("throughput", float("nan")),
            summary.get("vllm|multi-turn/per-tenant", {}).get("throughput", float("nan"))),
    }
    random_ab: dict = {}
    if a.random_pairs and {"kvfence-cache", "kvfence-nocache"} <= set(engines):
        sides = {
            e: start(e, a, model, tmp, tmp / "none.json")
            for e in ("kvfence-cache", "kvfence-nocache")
        }
        pairs = interleaved_pairs(
            sides,
            a.random_pairs,
            lambda srv, i: run_bench(srv.url, workload_argv("random", a, 500 + i)),
            {"throughput": lambda r: r["total_token_throughput"]},
            "random",
        )
        random_ab = {
            "pairs": pairs,
            "throughput_on_over_off": ratio_ci(
                [pr["kvfence-cache"]["throughput"] / pr["kvfence-nocache"]["throughput"]
                 for pr in pairs]
            ),
        }
    for k, v in goals.items():
        print(f"{k}: {v:.3f}")
    if random_ab:
        print(f"random prompts, throughput cache on / off: {random_ab['throughput_on_over_off']}")
    write_json(out / f"{a.name}.json", {
        "command": cmd, "machine": machine(), "config": {k: v for k, v in vars(a).items()},
        "rounds": rounds, "summary": summary, "goals": goals, "random_ab": random_ab,
        "skipped": skipped,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
