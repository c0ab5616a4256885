"""`kvfence bench serve`: an HTTP load generator for any OpenAI-compatible server (like vLLM's
`vllm bench serve` and SGLang's bench_serving): throughput, TTFT, ITL, TPOT, end-to-end latency,
prefix-cache hits; random, shared-prefix and multi-turn workloads over one or more tenants."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from kvfence.sse import aiter_events
from kvfence.tools.bench_datasets import (
    DATASETS,
    DatasetArgs,
    Prompt,
    Session,
    make_sessions,
    shared_prefixes,
)

EXIT_OK, EXIT_FAILED, EXIT_CANNOT_RUN = 0, 1, 2
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    index: int
    prompt_len: int  # the server's usage.prompt_tokens when it sends usage, else an estimate
    turn: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    ok: bool = False
    status: int | None = None
    error: str | None = None
    start: float = 0.0
    ttft: float | None = None  # seconds to the first chunk that carried output
    latency: float | None = None  # seconds to the end of the stream
    output_tokens: int = 0  # from usage when the server sends it, else output chunks
    itl: list[float] = field(default_factory=list)  # gaps between output chunks after the first
    answer: str = ""  # the streamed text, which a multi-turn session appends to its next prompt


@dataclass(frozen=True)
class Workload:
    base_url: str
    model: str
    sessions: list[Session]
    output_len: int
    ignore_eos: bool
    api_key: str | None  # for discovery and the probe; each session carries its own
    concurrency: int | None
    request_rate: float
    seed: int
    timeout_s: float
    # multi-turn: mean seconds a user reads an answer before the next turn (exponential, drawn
    # per session from the seed). 0: at once, a closed loop in which each turn finds its
    # decode just freed, so even load-only routing sends a chat back where it was.
    think_time: float = 0.0


def percentile(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(xs: list[float]) -> dict[str, float]:
    out = {"mean": sum(xs) / len(xs) if xs else float("nan")}
    out.update({f"p{p}": percentile(xs, p) for p in PERCENTILES})
    return out


def _headers(api_key: str | None) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def _client(timeout_s: float, limit: int) -> httpx.AsyncClient:
    # Only ever talks to --base-url: no proxy from the environment, no redirects.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=10.0),
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
        trust_env=False,
        follow_redirects=False,
    )


def make_prompts(
    n: int, input_len: int, vocab: int, seed: int, as_text: bool
) -> list[list[int]] | list[str]:
    sessions = make_sessions(DatasetArgs("random", n, input_len, vocab, seed, as_text))
    return [s.turns[0] for s in sessions]  # type: ignore[return-value]


def body(
    w: Workload, prompt: Prompt, max_tokens: int, ignore_eos: bool, extra: dict | None = None
) -> dict:
    b: dict[str, Any] = {
        **(extra or {}),
        "model": w.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        b["ignore_eos"] = True
    return b


def next_turn(prompt: Prompt, answer: str, question: Prompt) -> str:
    """A chat's next prompt: the conversation so far, its answer, the next question. A streamed
    answer's text starts without a space when its first token carries none (a word-level
    tokenizer's always do): glued to the prompt, the last word and the first would re-tokenize
    as one, and the next turn would miss the cached page holding the prompt's end."""
    sep = "" if not answer or answer[0].isspace() else " "
    return f"{prompt}{sep}{answer} {question}"


async def one_request(
    client: httpx.AsyncClient,
    w: Workload,
    index: int,
    prompt: Prompt,
    session: Session | None = None,
    turn: int = 0,
) -> RequestRecord:
    plen = len(prompt) if isinstance(prompt, list) else len(prompt.split())
    rec = RequestRecord(index, plen, turn)
    api_key = session.api_key if session is not None else w.api_key
    extra = session.extra if session is not None else None
    url = w.base_url.rstrip("/") + "/v1/completions"
    rec.start = time.perf_counter()
    last = rec.start
    chunks = 0
    usage_tokens: int | None = None
    try:
        b = body(w, prompt, w.output_len, w.ignore_eos, extra)
        async with client.stream("POST", url, json=b, headers=_headers(api_key)) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                rec.error = (await r.aread()).decode(errors="replace")[:300]
                return rec
            async for event in aiter_events(r.aiter_bytes()):
                if event.done:
                    break
                obj = event.json()
                if obj.get("error"):
                    rec.error = json.dumps(obj["error"])[:300]
                    return rec
                if obj.get("usage"):
                    usage = obj["usage"]
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    rec.prompt_len = usage.get("prompt_tokens") or rec.prompt_len
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        rec.cached_tokens = int(details["cached_tokens"])
                choices = obj.get("choices") or []
                if not any(c.get("text") for c in choices):
                    continue
                rec.answer += "".join(c.get("text") or "" for c in choices)
                now = time.perf_counter()
                if rec.ttft is None:
                    rec.ttft = now - rec.start
                else:
                    rec.itl.append(now - last)
                last = now
                chunks += 1
        rec.latency = time.perf_counter() - rec.start
        rec.output_tokens = usage_tokens if usage_tokens is not None else chunks
        rec.ok = rec.ttft is not None
        if not rec.ok:
            rec.error = "stream ended without output"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
    return rec


class Progress:
    """One live line on stderr: done/total, failures, elapsed."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.failed, self.enabled = total, 0, 0, enabled
        self.t0 = time.perf_counter()

    def update(self, rec: RequestRecord) -> None:
        self.done += 1
        self.failed += not rec.ok
        if self.enabled:
            width = 30
            filled = int(width * self.done / max(self.total, 1))
            sys.stderr.write(
                f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
                f" failed {self.failed} {time.perf_counter() - self.t0:6.1f}s"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


async def run_workload(w: Workload, progress: bool = True) -> tuple[list[RequestRecord], float]:
    """All sessions, by a fixed number in flight or by Poisson arrivals; a session's turns go out
    one after another (a slot is held for the whole conversation). Returns (records, wall)."""
    n = len(w.sessions)
    limit = w.concurrency or n
    sem = asyncio.Semaphore(limit)
    bar = Progress(sum(len(s.turns) for s in w.sessions), progress)
    rng = random.Random(w.seed)
    records: list[RequestRecord] = []
    async with _client(w.timeout_s, limit) as client:

        async def task(i: int, s: Session) -> None:
            think = random.Random(w.seed * 1_000_003 + i)  # the same pauses in every run
            async with sem:
                prompt: Prompt = s.turns[0]
                for t in range(len(s.turns)):
                    rec = await one_request(client, w, i * 1000 + t, prompt, s, t)
                    records.append(rec)
                    bar.update(rec)
                    if not rec.ok or t + 1 == len(s.turns):
                        break
                    if w.think_time > 0:
                        await asyncio.sleep(think.expovariate(1.0 / w.think_time))
                    prompt = next_turn(prompt, rec.answer, s.turns[t + 1])

        t0 = time.perf_counter()
        tasks = []
        for i, s in enumerate(w.sessions):
            tasks.append(asyncio.create_task(task(i, s)))
            if math.isfinite(w.request_rate) and w.request_rate > 0 and i < n - 1:
                await asyncio.sleep(rng.expovariate(w.request_rate))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    bar.close()
    return sorted(records, key=lambda r: r.index), wall


def metrics(records: list[RequestRecord], wall: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    in_tok = sum(r.prompt_len for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    out_tok = sum(r.output_tokens for r in ok)
    tpot = [
        (r.latency - r.ttft) / (r.output_tokens - 1)
        for r in ok
        if r.latency is not None and r.ttft is not None and r.output_tokens > 1
    ]
    ms = 1000.0
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": wall,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / wall if wall > 0 else float("nan"),
        "input_throughput": in_tok / wall if wall > 0 else float("nan"),
        "output_throughput": out_tok / wall if wall > 0 else float("nan"),
        "total_token_throughput": (in_tok + out_tok) / wall if wall > 0 else float("nan"),
        "ttft_ms": summarize([r.ttft * ms for r in ok if r.ttft is not None]),
        "itl_ms": summarize([x * ms for r in ok for x in r.itl]),
        "tpot_ms": summarize([x * ms for x in tpot]),
        "e2e_latency_ms": summarize([r.latency * ms for r in ok if r.latency is not None]),
        # share of prompt tokens the server says it served from its prefix cache (None: it
        # does not report usage.prompt_tokens_details)
        "cached_token_share": (
            sum(r.cached_tokens or 0 for r in reported)
            / max(1, sum(r.prompt_len for r in reported))
            if reported
            else None
        ),
    }


async def discover(
    base_url: str, api_key: str | None, model: str | None, timeout_s: float
) -> tuple[str, int | None]:
    """The model to name (first of /v1/models unless given) and its vocabulary hint, if any."""
    async with _client(timeout_s, 1) as c:
        r = await c.get(base_url.rstrip("/") + "/v1/models", headers=_headers(api_key))
        if r.status_code != 200:
            if model:
                return model, None
            raise RuntimeError(f"GET /v1/models: HTTP {r.status_code}: {r.text[:200]}")
        data = r.json().get("data") or []
        if model is None:
            if not data:
                raise RuntimeError("GET /v1/models lists no model; pass --model")
            model = str(data[0]["id"])
        return model, None


async def probe(
    w: Workload, prompt_ids: list[int], prompt_text: str
) -> tuple[bool, bool, str | None]:
    """Which prompt form and whether `ignore_eos` the server accepts: (ids, ignore_eos, error)."""
    url = w.base_url.rstrip("/") + "/v1/completions"
    async with _client(w.timeout_s, 1) as c:
        last = None
        for ids, ign in ((True, True), (True, False), (False, True), (False, False)):
            b = body(w, prompt_ids if ids else prompt_text, 1, ign)
            b["stream"] = False
            b.pop("stream_options")
            r = await c.post(url, json=b, headers=_headers(w.api_key))
            if r.status_code == 200:
                return ids, ign, None
            last = f"HTTP {r.status_code}: {r.text[:200]}"
            if r.status_code in (401, 403, 404):
                break
        return True, True, last


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvfence bench serve", description=__doc__)
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--concurrency", type=int, default=None, help="requests in flight at most")
    g.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (default inf: all at once)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="repeat for several tenants: sessions (shared-prefix: groups) go round-robin",
    )
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument(
        "--cache-salt",
        choices=("none", "per-tenant", "shared"),
        default="none",
        help="send vLLM's request field cache_salt: one per API key, or one for everybody",
    )
    g = p.add_argument_group("shared-prefix (SGLang's generated-shared-prefix)")
    g.add_argument("--num-groups", type=int, default=8)
    g.add_argument("--prompts-per-group", type=int, default=8)
    g.add_argument("--system-prompt-len", type=int, default=1024)
    g.add_argument("--question-len", type=int, default=128, help="also multi-turn's questions")
    g.add_argument(
        "--one-system-prompt",
        action="store_true",
        help="every group shares one (public) system prompt",
    )
    g.add_argument(
        "--write-shared-prefixes",
        default=None,
        help="write the system prompts here (JSON list) for a server's --shared-prefix-file",
    )
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per chat")
    p.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="multi-turn: mean seconds (exponential) before a chat's next turn; 0: at once",
    )
    p.add_argument(
        "--text-words",
        choices=("letters", "ids"),
        default="letters",
        help="text prompts: random 3-letter words, or w<id> words (a word-level tokenizer)",
    )
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument(
        "--prompt-format",
        choices=("auto", "ids", "text"),
        default="auto",
        help="token-id prompts, random text, or ids when the server takes them",
    )
    p.add_argument("--vocab-size", type=int, default=2048, help="random ids are below this")
    p.add_argument("--no-ignore-eos", action="store_true", help="never send ignore_eos")
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and dropped) first")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len", "num_groups", "prompts_per_group",
                 "system_prompt_len", "question_len", "num_turns"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.concurrency is not None and a.concurrency < 1:
        p.error("--concurrency must be >= 1")
    if not a.think_time >= 0:
        p.error("--think-time must be >= 0")
    return a


async def bench(a: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    keys: tuple[str | None, ...] = tuple(a.api_key) if a.api_key else (None,)
    try:
        model, _ = await discover(a.base_url, keys[0], a.model, a.timeout)
    except (httpx.HTTPError, RuntimeError, ValueError, OSError) as e:
        return EXIT_CANNOT_RUN, {"error": f"cannot reach {a.base_url}: {e}"}
    base = Workload(
        a.base_url,
        model,
        [],
        a.output_len,
        not a.no_ignore_eos,
        keys[0],
        a.concurrency,
        a.request_rate,
        a.seed,
        a.timeout,
        a.think_time,
    )
    ids_p = make_prompts(1, a.input_len, a.vocab_size, a.seed + 1, as_text=False)[0]
    txt_p = make_prompts(1, a.input_len, a.vocab_size, a.seed + 1, as_text=True)[0]
    use_ids, ignore_eos, err = await probe(base, ids_p, txt_p)  # type: ignore[arg-type]
    if err is not None:
        return EXIT_CANNOT_RUN, {"error": f"probe request failed: {err}"}
    if a.prompt_format != "auto":
        use_ids = a.prompt_format == "ids"
    if a.dataset == "multi-turn":
        use_ids = False  # each answer's text is appended to the next turn's prompt
    ignore_eos = ignore_eos and not a.no_ignore_eos

    def dataset(name: str, n: int, seed: int) -> DatasetArgs:
        return DatasetArgs(
            name, n, a.input_len, a.vocab_size, seed, not use_ids, keys, a.cache_salt,
            a.num_groups, a.prompts_per_group, a.system_prompt_len, a.question_len,
            a.one_system_prompt, a.num_turns, a.text_words,
        )

    try:
        sessions = make_sessions(dataset(a.dataset, a.num_prompts, a.seed))
    except ValueError as e:
        return EXIT_CANNOT_RUN, {"error": str(e)}
    if a.write_shared_prefixes:
        with open(a.write_shared_prefixes, "w") as f:
            json.dump(shared_prefixes(sessions, a.system_prompt_len), f)
    w = Workload(**{**asdict(base), "sessions": sessions, "ignore_eos": ignore_eos})
    if a.warmup:
        # Random prompts: the warm-up must not prime the cache for the measured workload.
        warm = make_sessions(dataset("random", a.warmup, a.seed + 2))
        await run_workload(Workload(**{**asdict(w), "sessions": warm}), progress=False)
    records, wall = await run_workload(w, progress=not a.no_progress)
    result = {
        "base_url": a.base_url,
        "model": model,
        "dataset": a.dataset,
        "tenants": len(keys),
        "cache_salt": a.cache_salt,
        "num_prompts": len(records),
        "input_len": a.input_len,
        "output_len": a.output_len,
        "concurrency": a.concurrency,
        "request_rate": a.request_rate if math.isfinite(a.request_rate) else "inf",
        "seed": a.seed,
        "think_time": a.think_time,
        "prompt_format": "ids" if use_ids else "text",
        "ignore_eos": ignore_eos,
        **metrics(records, wall),
        "errors": sorted({r.error for r in records if r.error})[:10],
    }
    return (EXIT_OK if result["failed"] == 0 else EXIT_FAILED), result


def report(r: dict[str, Any]) -> str:
    if "error" in r and "completed" not in r:
        return f"kvfence bench: {r['error']}"
    lines = [
        f"{'model':<28}{r['model']}",
        f"{'prompts (ok/failed)':<28}{r['completed']}/{r['failed']}"
        f"  ({r['prompt_format']}, ignore_eos={r['ignore_eos']})",
        f"{'duration (s)':<28}{r['duration_s']:.2f}",
        f"{'request throughput (req/s)':<28}{r['request_throughput']:.3f}",
        f"{'output tokens/s':<28}{r['output_throughput']:.1f}",
        f"{'total tokens/s':<28}{r['total_token_throughput']:.1f}",
        f"{'cached prompt tokens':<28}"
        + ("not reported" if r.get("cached_token_share") is None
           else f"{100 * r['cached_token_share']:.1f}%"),
        f"{'(ms)':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms"):
        s = r[key]
        lines.append(
            f"{key[:-3].upper():<16}"
            + "".join(f"{s[k]:>10.1f}" for k in ("mean", "p50", "p90", "p99"))
        )
    for e in r.get("errors", []):
        lines.append(f"error: {e}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] != ["serve"]:
        print("usage: kvfence bench serve --base-url URL [options]  (see --help)", file=sys.stderr)
        return EXIT_CANNOT_RUN
    a = parse_args(argv[1:])
    code, result = asyncio.run(bench(a))
    print(report(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
