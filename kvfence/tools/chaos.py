"""`python -m kvfence.tools.chaos`: a bounded chaos soak of a local PD cluster with all guards on.

Three tenants send canary prompts of random lengths (over-length included), cut streams off at
random, and the workers fire random faults (corrupt pages, truncated transfers, placeholders,
late writes, lost acks, stalls, client hang-ups). The soak asserts: no foreign canary in any
output, every request ends exactly once with an answer or an error, no 200 carries a short or
foreign answer, pools return to baseline, and no process crashed.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import secrets
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvfence import env
from kvfence.sse import iter_events
from kvfence.tools.canary import CanaryRegistry, build_prompt
from kvfence.tools.cluster import LocalCluster

FAULTS = (
    "corrupt_page,truncate_transfer,placeholder_on_reject,late_write,drop_abort_ack,"
    "stall_transfer,client_disconnect"
)
TENANTS = {"chaos-key-1": "tenant-1", "chaos-key-2": "tenant-2", "chaos-key-3": "tenant-3"}


@dataclass
class Tally:
    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)
    leaks: list[dict] = field(default_factory=list)
    short_200: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str) -> None:
        with self.lock:
            self.requests += 1
            self.outcomes[outcome] += 1


def start_cluster(
    model: str, prefill: int, ctx: int, tmp: Path, rate: float, fault_seed: int
) -> LocalCluster:
    children = {
        env.FAULT_INJECTION: "1",
        env.FAULTS: FAULTS,
        env.FAULT_RATE: str(rate),
        env.FAULT_SEED: str(fault_seed),
        env.STALL_S: "0.3",
    }
    return LocalCluster(
        tmp,
        model,
        "--prefill",
        str(prefill),
        "--decode",
        "1",
        "--context-length",
        str(ctx),
        "--kv-pool-tokens",
        str(4 * ctx),
        "--disaggregation-timeout",
        "3",
        keys=TENANTS,
        env=children,
    )


def crashed(cluster: LocalCluster) -> bool:
    """A process died, a worker is unhealthy, or a traceback reached the log."""
    return (
        not cluster.alive()
        or not all(w["healthy"] for w in cluster.workers())
        or "Traceback" in cluster.log.read_text()
    )


def one_request(
    url: str,
    ctx: int,
    registry: CanaryRegistry,
    tally: Tally,
    rng: random.Random,
    n: int,
    count: Callable[[str], int],
) -> None:
    key, tenant = rng.choice(list(TENANTS.items()))
    rid = f"chaos-{n}"
    over = rng.random() < 0.15
    target = rng.randint(ctx + 1, ctx + 200) if over else rng.randint(20, ctx - 80)
    prompt = build_prompt(registry, tenant, rid, target, rng=rng, count_tokens=count)
    over = prompt.tokens + 1 > ctx  # what admission will see (with max_tokens >= 1)
    max_tokens = rng.randint(4, 24)
    stream = rng.random() < 0.5
    cut = rng.random() < 0.2
    body = {
        "model": "kvfence-tiny",
        "prompt": prompt.text,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    headers = {"Authorization": f"Bearer {key}"}
    text, status = "", 0
    try:
        if stream:
            with httpx.stream(
                "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60
            ) as r:
                status = r.status_code
                if status != 200:
                    r.read()
                    tally.add(f"http_{status}")
                    return
                chunks, finished = 0, False
                for event in iter_events(r.iter_bytes()):
                    if event.done:
                        finished = True
                        break
                    obj = event.json()
                    if "error" in obj:
                        tally.add(f"stream_error_{obj['error'].get('code')}")
                        return
                    text += obj["choices"][0]["text"]
                    chunks += 1
                    if cut and chunks >= rng.randint(1, 3):
                        tally.add("client_cut_stream")
                        return
                if not finished:
                    tally.add("stream_ended_without_done")
                    tally.short_200.append({"request": rid, "text": text})
                    return
        else:
            r = httpx.post(
                f"{url}/v1/completions",
                json=body,
                headers=headers,
                timeout=rng.uniform(0.05, 0.5) if cut else 60,
            )
            status = r.status_code
            if status != 200:
                tally.add(f"http_{status}")
                return
            choice = r.json()["choices"][0]
            text = choice["text"]
            if r.json()["usage"]["completion_tokens"] != max_tokens:
                tally.short_200.append({"request": rid, "usage": r.json()["usage"]})
        if over:
            tally.short_200.append({"request": rid, "why": "over-length prompt answered 200"})
        tally.add("ok_200")
    except httpx.TimeoutException:
        tally.add("client_timeout" if cut else "unexpected_timeout")
    except httpx.HTTPError as e:
        tally.add(f"client_error_{type(e).__name__}")
    finally:
        for leak in registry.find_leaks(text, rid, tenant):
            with tally.lock:
                tally.leaks.append(leak.as_dict())


def soak(url: str, ctx: int, duration: float, concurrency: int, seed: int, model: str) -> Tally:
    from kvfence.model.tokenizer import Tokenizer

    tok = Tokenizer(model)
    count = lambda text: len(tok.encode(text))  # noqa: E731 - exact, BOS included as served
    registry, tally = CanaryRegistry(random.Random(seed)), Tally()
    counter = iter(range(10**9))
    lock = threading.Lock()
    deadline = time.monotonic() + duration

    def worker(wseed: int) -> None:
        rng = random.Random(wseed)
        while time.monotonic() < deadline:
            with lock:
                n = next(counter)
            one_request(url, ctx, registry, tally, rng, n, count)

    threads = [threading.Thread(target=worker, args=(seed * 1000 + i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tally


def run(
    model: str,
    prefill: int,
    duration: float,
    ctx: int = 1024,
    concurrency: int = 4,
    seed: int = 0,
    rate: float = 0.05,
    fault_seed: int = 0,
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = start_cluster(model, prefill, ctx, Path(tmp), rate, fault_seed)
        try:
            tally = soak(cluster.url, ctx, duration, concurrency, seed, model)
            baseline = False
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not baseline:
                baseline = not any(cluster.pages_used())
                time.sleep(0.3)
            workers = cluster.workers()
            broken = crashed(cluster)
            pattern = re.compile(
                r"^kvfence_pd_(?:transfers_failed_\w+|late_writes_dropped|checksum_mismatches|"
                r"source_integrity_errors)_total (\S+)$",
                re.M,
            )
            injected = sum(
                int(float(v))
                for w in workers
                for v in pattern.findall(
                    httpx.get(f"{w['url']}/metrics", timeout=5, headers=cluster.operator).text
                )
            )
        finally:
            cluster.stop()
        return {
            "prefill": prefill,
            "duration_s": duration,
            "fault_seed": fault_seed,
            "requests": tally.requests,
            "outcomes": dict(tally.outcomes),
            "fault_effects_seen": injected,
            "leaks": tally.leaks,
            "short_or_wrong_200": tally.short_200,
            "pools_at_baseline": baseline,
            "crashed": broken,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfence-chaos", description=__doc__)
    ap.add_argument(
        "--model", default=str(Path(__file__).resolve().parents[2] / "models" / "kvfence-tiny")
    )
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per configuration")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault-rate", type=float, default=0.05)
    ap.add_argument(
        "--fault-seed",
        type=int,
        default=None,
        help="seed of the workers' fault draws (default: a fresh one, printed, to replay a run)",
    )
    args = ap.parse_args(argv)
    fault_seed = secrets.randbits(32) if args.fault_seed is None else args.fault_seed
    print(f"chaos: fault seed {fault_seed} (replay with --fault-seed {fault_seed})", flush=True)
    ok = True
    for prefill in (1, 2):
        res = run(
            args.model,
            prefill,
            args.duration,
            concurrency=args.concurrency,
            seed=args.seed,
            rate=args.fault_rate,
            fault_seed=fault_seed,
        )
        print(json.dumps(res, indent=2))
        ok &= not res["leaks"] and not res["short_or_wrong_200"] and res["pools_at_baseline"]
        ok &= not res["crashed"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
