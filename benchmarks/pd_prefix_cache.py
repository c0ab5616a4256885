"""The prefix cache across PD (issue 18): a 2 prefill + 2 decode `kvfence up` with the cache-aware
router, with least-loaded routing, and with the workers' caches off, on the multi-turn and
shared-prefix workloads of benchmarks/prefix_cache.py (8 tenants, an API key each): TTFT p50/p99,
throughput, hit rates (the client's cached-token share, each role's prefix-cache hits), KV bytes
transferred per request and per prompt token, every PD counter's change, and the router's
decisions.

Configurations, each a fresh `kvfence up` per round (cold caches), the order reversed every round:
  cache-aware    --router-policy cache_aware (the default)
  least-loaded   --router-policy least_loaded
  cache-off      --router-policy least_loaded --no-enable-prefix-caching (every worker)

Multi-turn users think before their next turn (--think-time, exponential, the same pauses in
every configuration). Without it the loop is closed: a chat's next turn leaves the moment its
answer ends, when its own decode has just freed a slot and is the least loaded, so least-loaded
routing sends the chat back to its decode (all but ties: test_router_policy.py simulates it), and
with seconds-long requests it matched cache-aware's hit rate and bytes exactly (the session-6 run:
both 0.72, same bytes; the policy had reached the router, whose decisions said
least_loaded/fallback). With the tiny model requests end within milliseconds of each other, ties
are common and the effect is weaker.

Then, per configuration, a per-turn trace: --trace-chats chats of two tenants, one request at a
time, each request's KV bytes read from the prefill workers' counters around it, beside its
prompt tokens, the history it repeats, the new tokens and decode's cached tokens: with the cache
the bytes follow what decode lacks (about the new tokens), without it the whole history.

    .venv/bin/python benchmarks/pd_prefix_cache.py --rounds 2
    .venv/bin/python benchmarks/pd_prefix_cache.py --tiny --rounds 1   # smoke test, minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import secrets
import statistics
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH

from benchmarks.common import (  # noqa: E402
    RESULTS,
    Server,
    bench_model,
    free_port,
    kvfence_bin,
    machine,
    this_command,
    write_json,
)
from benchmarks.prefix_cache import KEYS, run_bench, workload_argv  # noqa: E402

CONFIGS = {
    "cache-aware": ["--router-policy", "cache_aware"],
    "least-loaded": ["--router-policy", "least_loaded"],
    "cache-off": ["--router-policy", "least_loaded", "--no-enable-prefix-caching"],
}
WORKLOADS = ("multi-turn", "shared-prefix")
WARMUP = 1  # the bench's warm-up requests: they go through the workers' counters too
_STARTED = re.compile(r"kvfence up: started ((?:prefill|decode)-\d+) \(pid \d+\) on (http://\S+?)(?:,|$)")
# Worker /metrics counters that say what a role's prefix cache did (tokens).
_CACHE_COUNTERS = ("kvfence_prefix_cache_queries_total", "kvfence_prefix_cache_hits_total")


def start(config: str, a: argparse.Namespace, model: Path, keys: Path, op_key: str) -> Server:
    port = free_port()
    argv = [
        kvfence_bin(), "up", "--prefill", "2", "--decode", "2", "--model", str(model),
        "--port", str(port), "--context-length", str(a.context_length),
        "--kv-pool-tokens", str(a.pool_tokens), "--api-key-file", str(keys),
        "--log-level", "warning", *CONFIGS[config],
    ]  # fmt: skip
    # The operator key opens the workers' /pd/info and /metrics where they ask for it (issue 15).
    env = {"KVFENCE_ADMIN_API_KEY": op_key}
    return Server(argv, port, env, log=Path(a.out) / f"pd_prefix_cache-{config}.log")


def worker_urls(log: Path) -> dict[str, str]:
    """Each worker's URL, from `kvfence up`'s own start-up lines."""
    found = {m.group(1): m.group(2) for m in map(_STARTED.search, log.read_text().splitlines())
             if m}  # fmt: skip
    if len(found) != 4:
        raise RuntimeError(f"expected 4 workers in {log}, found {sorted(found)}")
    return found


def _samples(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} (counters and gauges only)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def snapshot(router: str, workers: Mapping[str, str], op_key: str) -> dict[str, Any]:
    """What the workers and the router have counted so far (their deltas are a run's)."""
    headers = {"Authorization": f"Bearer {op_key}"}
    out: dict[str, Any] = {"workers": {}, "router": {}}
    with httpx.Client(timeout=10, trust_env=False, headers=headers) as c:
        for name, url in workers.items():
            info = c.get(url + "/pd/info")
            metrics = c.get(url + "/metrics")
            if info.status_code != 200 or metrics.status_code != 200:
                raise RuntimeError(f"{name}: /pd/info {info.status_code}, /metrics "
                                   f"{metrics.status_code}: {info.text[:200]}")
            samples = _samples(metrics.text)
            out["workers"][name] = {
                "counters": {k: float(v) for k, v in (info.json().get("counters") or {}).items()},
                "cache": {k: samples.get(k, 0.0) for k in _CACHE_COUNTERS},
            }
        r = c.get(router + "/metrics")
        if r.status_code == 200:
            out["router"] = {k: v for k, v in _samples(r.text).items()
                             if k.startswith(("kvfence_router_decisions_total",
                                              "kvfence_router_predicted_hit_tokens_total",
                                              "kvfence_router_routed_prompt_tokens_total"))}
    return out


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    def sub(b: Mapping[str, float], a: Mapping[str, float]) -> dict[str, float]:
        return {k: a[k] - b.get(k, 0.0) for k in a if a[k] - b.get(k, 0.0)}

    workers = {
        name: {part: sub(before["workers"][name][part], w[part]) for part in w}
        for name, w in after["workers"].items()
    }
    return {"workers": workers, "router": sub(before["router"], after["router"])}


def prefill_bytes(router: str, workers: Mapping[str, str], op_key: str) -> float:
    s = snapshot(router, workers, op_key)
    return sum(w["counters"].get("bytes_sent", 0.0) for n, w in s["workers"].items()
               if n.startswith("prefill"))  # fmt: skip


async def per_turn_trace(
    router: str, workers: Mapping[str, str], op_key: str, a: argparse.Namespace, seed: int
) -> list[dict[str, Any]]:
    """Chats of two tenants, one request at a time: each turn's KV bytes (the prefill workers'
    bytes_sent around it) beside its prompt, the history it repeats and its new tokens."""
    from kvfence.tools import bench
    from kvfence.tools.bench_datasets import DatasetArgs, make_sessions

    sessions = make_sessions(DatasetArgs(
        "multi-turn", a.trace_chats, a.chat_input_len, a.vocab, seed, True, tuple(KEYS),
        question_len=a.chat_question_len, num_turns=a.turns, text_words="ids",
    ))  # fmt: skip
    model, _ = await bench.discover(router, KEYS[0], None, 60.0)
    w = bench.Workload(router, model, sessions, a.output_len, True, KEYS[0], 1, float("inf"),
                       seed, 600.0)  # fmt: skip
    rows: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=600.0, trust_env=False) as client:
        for i, s in enumerate(sessions):
            prompt, history = s.turns[0], 0
            for t in range(len(s.turns)):
                before = prefill_bytes(router, workers, op_key)
                rec = await bench.one_request(client, w, i * 1000 + t, prompt, s, t)
                sent = prefill_bytes(router, workers, op_key) - before
                if not rec.ok:
                    raise RuntimeError(f"trace chat {i} turn {t}: {rec.error}")
                cached = rec.cached_tokens or 0
                rows.append({
                    "chat": i, "turn": t, "prompt_tokens": rec.prompt_len,
                    "history_tokens": history, "new_tokens": rec.prompt_len - history,
                    "cached_tokens": cached, "kv_bytes": sent,
                    "kv_bytes_per_new_token": sent / max(1, rec.prompt_len - history),
                    "kv_bytes_per_uncached_token": sent / max(1, rec.prompt_len - cached),
                })  # fmt: skip
                history = rec.prompt_len + rec.output_tokens
                if t + 1 < len(s.turns):
                    prompt = bench.next_turn(prompt, rec.answer, s.turns[t + 1])
    return rows


def print_trace(label: str, rows: list[dict[str, Any]]) -> None:
    print(f"{label} per-turn trace: chat turn prompt history new cached KV-bytes "
          "bytes/new bytes/uncached")  # fmt: skip
    for r in rows:
        print(f"  {r['chat']:>2} {r['turn']:>2} {r['prompt_tokens']:>6} {r['history_tokens']:>6} "
              f"{r['new_tokens']:>5} {r['cached_tokens']:>6} {r['kv_bytes']:>11.0f} "
              f"{r['kv_bytes_per_new_token']:>9.0f} {r['kv_bytes_per_uncached_token']:>9.0f}",
              flush=True)  # fmt: skip


def summarize_run(result: dict[str, Any], d: dict[str, Any]) -> dict[str, Any]:
    """One workload's figures: the bench's, and what the counters say it cost the cluster."""
    requests = result["completed"] + result["failed"] + WARMUP

    def role_sum(role: str, part: str, key: str) -> float:
        return sum(w[part].get(key, 0.0) for n, w in d["workers"].items() if n.startswith(role))

    kv_bytes = role_sum("prefill", "counters", "bytes_sent")
    hit_rate = {}
    for role in ("prefill", "decode"):
        # The PD counters: every prompt a role admitted, and the tokens it took from its cache.
        # (The engine's kvfence_prefix_cache_queries once counted only prompts that
        # hit, a hit rate that barely moved with routing; kept in "cache" for reference.)
        q = role_sum(role, "counters", "prompt_tokens")
        h = role_sum(role, "counters", "prefix_cached_tokens")
        hit_rate[role] = h / q if q else None
    return {
        **result,
        "kv_bytes_per_request": kv_bytes / requests,
        "kv_bytes_per_prompt_token": kv_bytes / max(1, result["total_input_tokens"]),
        "worker_prefix_cache_hit_rate": hit_rate,
        "counters": d,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: build the SmolLM-135M-shaped one")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model, small workloads (smoke)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-prompt-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--chats", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--chat-input-len", type=int, default=256)
    p.add_argument("--chat-question-len", type=int, default=64)
    p.add_argument("--think-time", type=float, default=1.0,
                   help="multi-turn: mean seconds before a chat's next turn (0: a closed loop)")
    p.add_argument("--trace-chats", type=int, default=2,
                   help="chats of the per-turn bytes trace (one request at a time); 0: none")
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--pool-tokens", type=int, default=23_000, help="each worker's KV pool")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="pd_prefix_cache")
    a = p.parse_args(argv)
    if a.tiny:
        a.prompts_per_group, a.system_prompt_len, a.question_len, a.output_len = 2, 64, 16, 4
        a.chats, a.turns, a.chat_input_len, a.chat_question_len = 4, 3, 48, 8
        a.context_length, a.pool_tokens, a.concurrency = 512, 4096, 4  # the probe sends 256
        a.think_time = min(a.think_time, 0.2)
    configs = [c for c in a.configs.split(",") if c]
    workloads = [w for w in a.workloads.split(",") if w]
    if unknown := (set(configs) - set(CONFIGS)) | (set(workloads) - set(WORKLOADS)):
        p.error(f"unknown configuration or workload: {', '.join(sorted(unknown))}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = this_command()
    model = bench_model(a.model, a.tiny)
    a.vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    tmp = Path(tempfile.mkdtemp(prefix="kvfence-pd-prefix-bench-"))
    keys = tmp / "keys.txt"
    keys.write_text("".join(f"{k} tenant{i}\n" for i, k in enumerate(KEYS)))
    op_key = "op-" + secrets.token_hex(24)  # the operator key: 16+ characters, no spaces
    rounds: list[dict[str, Any]] = []
    for r in range(a.rounds):
        seed = 200 + r  # every configuration sees the same prompts in a round
        rounds.append({})
        for config in configs if r % 2 == 0 else configs[::-1]:
            srv = start(config, a, model, keys, op_key)
            res: dict[str, Any] = {"server_command": srv.command}
            try:
                srv.wait_ready(timeout=900)
                workers = worker_urls(Path(srv.log or ""))
                for w in workloads:
                    before = snapshot(srv.url, workers, op_key)
                    argv = workload_argv(w, a, seed)
                    if w == "multi-turn":
                        argv += ["--think-time", str(a.think_time)]
                    result = run_bench(srv.url, argv)
                    res[w] = summarize_run(result, delta(before, snapshot(srv.url, workers,
                                                                          op_key)))
                    print(f"round {r + 1} {config} {w}: "
                          f"{res[w]['total_token_throughput']:.1f} tok/s, TTFT p50 "
                          f"{res[w]['ttft_ms']['p50']:.0f} ms p99 {res[w]['ttft_ms']['p99']:.0f}"
                          f" ms, KV {res[w]['kv_bytes_per_request'] / 1024:.0f} KiB/request, "
                          f"hit rates {res[w]['worker_prefix_cache_hit_rate']}", flush=True)
                if a.trace_chats:
                    res["per_turn"] = asyncio.run(per_turn_trace(srv.url, workers, op_key, a,
                                                                 seed + 1000))  # fmt: skip
                    print_trace(f"round {r + 1} {config}", res["per_turn"])
            except Exception as ex:  # noqa: BLE001 - recorded; the other configurations run
                res["error"] = f"{type(ex).__name__}: {ex}"[-1500:]
                print(f"round {r + 1} {config}: {res['error']}", flush=True)
            finally:
                srv.stop()
            rounds[-1][config] = res

    def med(config: str, w: str, f: Any) -> float:
        xs = [f(rd[config][w]) for rd in rounds if isinstance(rd.get(config, {}).get(w), dict)]
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else float("nan")

    figures = {
        "ttft_p50_ms": lambda x: x["ttft_ms"]["p50"],
        "ttft_p99_ms": lambda x: x["ttft_ms"]["p99"],
        "throughput": lambda x: x["total_token_throughput"],
        "cached_token_share": lambda x: x["cached_token_share"],
        "prefill_hit_rate": lambda x: x["worker_prefix_cache_hit_rate"]["prefill"],
        "decode_hit_rate": lambda x: x["worker_prefix_cache_hit_rate"]["decode"],
        "kv_bytes_per_request": lambda x: x["kv_bytes_per_request"],
        "kv_bytes_per_prompt_token": lambda x: x["kv_bytes_per_prompt_token"],
    }
    summary = {f"{c}|{w}": {k: med(c, w, f) for k, f in figures.items()}
               for c in configs for w in workloads}  # fmt: skip

    def later_turns(rows: list[dict[str, Any]], key: str) -> float:
        later = [r for r in rows if r["turn"] > 0]
        return sum(r[key] for r in later) / max(1, sum(r["new_tokens"] for r in later))

    for c in configs:  # the per-turn trace: turns after the first, per new token
        traces = [rd[c]["per_turn"] for rd in rounds if rd.get(c, {}).get("per_turn")]
        summary[f"{c}|trace"] = {
            "kv_bytes_per_new_token_later_turns": statistics.median(
                [later_turns(t, "kv_bytes") for t in traces]) if traces else float("nan"),
            "history_tokens_per_new_token_later_turns": statistics.median(
                [later_turns(t, "history_tokens") for t in traces]) if traces else float("nan"),
        }  # fmt: skip

    def ratio(num: str, den: str, key: str) -> float:
        x, y = summary.get(num, {}).get(key, float("nan")), summary.get(den, {}).get(key)
        return x / y if y == y and y else float("nan")

    goals = {
        "multi-turn TTFT p50 cache-off / cache-aware (goal >= 2)": ratio(
            "cache-off|multi-turn", "cache-aware|multi-turn", "ttft_p50_ms"),
        "multi-turn TTFT p50 least-loaded / cache-aware": ratio(
            "least-loaded|multi-turn", "cache-aware|multi-turn", "ttft_p50_ms"),
        "shared-prefix TTFT p50 cache-off / cache-aware": ratio(
            "cache-off|shared-prefix", "cache-aware|shared-prefix", "ttft_p50_ms"),
        "trace: later turns' KV bytes per new token cache-aware / cache-off": ratio(
            "cache-aware|trace", "cache-off|trace", "kv_bytes_per_new_token_later_turns"),
        "multi-turn KV bytes per prompt token cache-aware / cache-off (goal: new tokens only)":
            ratio("cache-aware|multi-turn", "cache-off|multi-turn", "kv_bytes_per_prompt_token"),
    }  # fmt: skip
    for k, v in summary.items():
        print(f"{k}: " + ", ".join(f"{n} {x:.3g}" for n, x in v.items()))
    for k, v in goals.items():
        print(f"{k}: {v:.3f}")
    write_json(out / f"{a.name}.json", {
        "command": cmd, "machine": machine(), "config": vars(a), "rounds": rounds,
        "summary": summary, "goals": goals,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
