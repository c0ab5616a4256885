"""`python -m kvfence.tools.chaos_cache`: the chaos soak where the prefix cache is.

The cache mix (chaos_mix.py: tenants sharing one identical system prompt, a declared public
prefix, private multi-turn histories of canaries) against a cluster whose pool is small enough
that eviction and preemption run all the time, with every action fault point a soak survives
armed at random, streams cut at random and the workers restarted (SIGHUP to `kvfence up`, a
drain and restart of a unified server) mid-soak; unified, 1P1D, 2P1D and TP=2. Beside chaos.py's
checks it asserts: no foreign canary anywhere, no cached tokens credited across tenants beyond
the declared public prefix, every error answer in the one table of failure classes, every
cached page unreferenced and the pool back to baseline at the end, and the cache exercised
(the within-tenant repeat-turn hit rate, printed, over a floor).
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
from pathlib import Path

import httpx

from kvfence import env
from kvfence.faults import ACTION_POINTS
from kvfence.tools.canary import CanaryRegistry
from kvfence.tools.chaos import TENANTS, Tally, crashed
from kvfence.tools.chaos_mix import HEADS, PUBLIC_TEXT, SYSTEM_TEXT, Ledger, Mix
from kvfence.tools.cluster import LocalCluster

TOPOLOGIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "unified": ("serve", ()),
    "1P1D": ("up", ("--prefill", "1", "--decode", "1")),
    "2P1D": ("up", ("--prefill", "2", "--decode", "1")),
    "TP2": ("up", ("--prefill", "1", "--decode", "1", "--tp-size", "2")),
}
# Every action point a running soak survives, and drop_abort_ack (liveness only). Left out: the
# kill_* points (a dead worker ends `kvfence up`, by design: the restarts stand in for them);
# tp_leader_decides_alone, which turns the ranks' combined check off (a twin); and
# tp_rank_skips_tag_check, meant for one rank: armed through the environment it reaches every
# rank, and a batch where all of them skip has no tag check at all (the long soak's TP=2 run
# met that with write_sealed_page: a same-tenant canary fragment).
_NOT_ARMED = {"kill_prefill", "kill_decode", "tp_leader_decides_alone", "tp_rank_skips_tag_check"}
FAULTS = sorted(ACTION_POINTS - _NOT_ARMED)
FAULTS.append("drop_abort_ack")
HIT_RATE_FLOOR = 0.2
_COUNTER = re.compile(r'^(kvfence_\w+_total)(?:\{point="(\w+)"\})? (\S+)$', re.M)


class Counters:
    """The workers' counters summed over restarts: sampled as the soak runs, a drop (a
    restarted process counts from 0) carries the last value seen."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self._last: dict[tuple[str, str], float] = {}
        self._carried: Counter[str] = Counter()
        self._lock = threading.Lock()

    def sample(self) -> None:
        try:
            urls = [w["url"] for w in self.cluster.workers()]
        except (httpx.HTTPError, ValueError, KeyError):
            return
        for url in urls:
            try:
                text = httpx.get(f"{url}/metrics", timeout=5, headers=self.cluster.operator).text
            except httpx.HTTPError:
                continue  # restarting
            with self._lock:
                for name, point, value in _COUNTER.findall(text):
                    series, v = f"{name}:{point}" if point else name, float(value)
                    last = self._last.get((url, series), 0.0)
                    if v < last:
                        self._carried[series] += last
                    self._last[(url, series)] = v

    def totals(self) -> dict[str, int]:
        with self._lock:
            out = Counter(self._carried)
            for (_, series), v in self._last.items():
                out[series] += v
        return {k: int(v) for k, v in sorted(out.items())}


def prefixes(model: str) -> tuple[list[int], list[int]]:
    """The public prefix (with BOS: a conversation opens with it; the shared-prefix file holds
    these ids) and the identical system prompt, as the soak sends them."""
    from kvfence.model.tokenizer import Tokenizer

    tok = Tokenizer(model)
    return tok.encode(PUBLIC_TEXT), tok.encode(SYSTEM_TEXT, add_special_tokens=False)


def make_mix(
    model: str, ctx: int, seed: int, heads: tuple[tuple[str, int], ...] = HEADS
) -> Mix:
    from kvfence.model.tokenizer import Tokenizer

    tok = Tokenizer(model)
    public, system = prefixes(model)
    return Mix(
        tenants=TENANTS,
        ctx=ctx,
        model=Path(model).name,
        encode=lambda t: tok.encode(t, add_special_tokens=False),
        bos=tok.encode(""),
        registry=CanaryRegistry(random.Random(seed)),
        ledger=Ledger(public),
        tally=Tally(),
        public_ids=public,
        system_ids=system,
        heads=heads,
    )


def start(
    topology: str, tmp: Path, model: str, ctx: int, pool: int, faults: dict[str, str]
) -> LocalCluster:
    shared = tmp / "shared-prefix.json"
    shared.write_text(json.dumps([prefixes(model)[0]]))
    command, args = TOPOLOGIES[topology]
    pd = ("--disaggregation-timeout", "3") if command == "up" else ()
    return LocalCluster(
        tmp,
        model,
        *args,
        *pd,
        "--context-length",
        str(ctx),
        "--kv-pool-tokens",
        str(pool),
        "--shared-prefix-file",
        str(shared),
        keys=TENANTS,
        env={env.FAULT_INJECTION: "1", env.STALL_S: "0.3", **faults},
        command=command,
    )


def at_baseline(cluster: LocalCluster) -> dict:
    """Every worker's pool and cache at rest: no page held, no cache reference, no holder."""
    out = {}
    for w in cluster.workers():
        text = httpx.get(f"{w['url']}/metrics", timeout=5, headers=cluster.operator).text
        g = {m[0]: float(m[1]) for m in re.findall(r"^(kvfence_\w+) (\S+)$", text, re.M)}
        out[w["url"]] = {
            "pages_used": g.get("kvfence_pool_pages_used"),
            "running": g.get("kvfence_requests_running"),
            "waiting": g.get("kvfence_requests_waiting"),
            "cache_pages": g.get("kvfence_prefix_cache_pages"),
            "cache_unreferenced": g.get("kvfence_prefix_cache_evictable_pages"),
            "cache_holders": g.get("kvfence_prefix_cache_holders"),
            "cache_references": g.get("kvfence_prefix_cache_references"),
            "page_size": g.get("kvfence_pool_page_size_tokens"),
        }
    return out


def _rested(pools: dict) -> bool:
    return all(
        p["pages_used"] == 0 and p["running"] == 0 and p["waiting"] == 0
        and p["cache_holders"] == 0 and p["cache_references"] == 0
        and p["cache_pages"] == p["cache_unreferenced"]
        for p in pools.values()
    )  # fmt: skip


def run(
    topology: str,
    model: str,
    *,
    requests: int | None = None,
    duration: float | None = None,
    ctx: int = 512,
    pool: int = 1024,
    concurrency: int = 4,
    seed: int = 0,
    rate: float = 0.05,
    fault_seed: int = 0,
    restarts: int = 1,
    faults: list[str] | None = None,
    log_dir: Path | None = None,
    heads: tuple[tuple[str, int], ...] = HEADS,
) -> dict:
    """One topology's soak: `requests` requests or `duration` seconds, whichever comes first."""
    armed = {
        env.FAULTS: ",".join(FAULTS if faults is None else faults),
        env.FAULT_RATE: str(rate),
        env.FAULT_SEED: str(fault_seed),
    }
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        cluster = start(topology, Path(tmp), model, ctx, pool, armed)
        started = time.monotonic() - t0
        try:
            mix = make_mix(model, ctx, seed, heads)
            tally = mix.tally
            counters = Counters(cluster)
            t1 = time.monotonic()
            done_restarts = soak(cluster.url, mix, requests, duration, concurrency, seed,
                                 restarts, cluster, counters)  # fmt: skip
            soak_s = time.monotonic() - t1
            pools: dict = {}
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                pools = at_baseline(cluster)
                if _rested(pools):
                    break
                time.sleep(0.3)
            counters.sample()
            totals = counters.totals()
            broken = crashed(cluster)
        finally:
            cluster.stop()
            if log_dir is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
                (log_dir / f"{topology}.log").write_bytes(cluster.log.read_bytes())
    page = int(next(iter(pools.values()))["page_size"] or 16)
    turns, hits = mix.ledger.repeat_hit_rate(page)
    fires = {k.split(":", 1)[1]: v for k, v in totals.items() if k.startswith("kvfence_fault")}
    return {
        "topology": topology,
        "requests": tally.requests,
        "startup_s": round(started, 1),
        "soak_s": round(soak_s, 1),
        "requests_per_s": round(tally.requests / soak_s, 2) if soak_s else None,
        "seed": seed,
        "fault_seed": fault_seed,
        "fault_rate": rate,
        "outcomes": dict(sorted(tally.outcomes.items())),
        "fault_fires": fires,
        # Action points only: a guard point draws at every guard check, fired or not relevant.
        "fault_effects": sum(v for k, v in fires.items() if k in ACTION_POINTS),
        "guard_catches": sum(
            v for k, v in totals.items()
            if re.match(r"kvfence_(pd_transfers_failed|pd_late_writes_dropped|pd_checksum_"
                        r"mismatches|pd_source_integrity_errors|kv_integrity_errors)", k)
        ),  # fmt: skip
        "preemptions": totals.get("kvfence_preemptions_total", 0),
        "cache_evictions": totals.get("kvfence_prefix_cache_evictions_total", 0),
        "restarts": done_restarts,
        "repeat_turns": turns,
        "repeat_turn_hits": hits,
        "repeat_hit_rate": round(hits / turns, 3) if turns else 0.0,
        "leaks": tally.leaks,
        "short_or_wrong_200": tally.short_200,
        "error_table_mismatches": mix.mismatches,
        "cross_tenant_credit": mix.ledger.credit_breaches(page),
        "pools_at_baseline": _rested(pools),
        "pools": pools,
        "crashed": broken,
    }


def soak(
    url: str,
    mix: Mix,
    requests: int | None,
    duration: float | None,
    concurrency: int,
    seed: int,
    restarts: int = 0,
    cluster: LocalCluster | None = None,
    counters: Counters | None = None,
) -> int:
    """Client threads until the budget is spent; `restarts` restarts spread over it (each one
    waited for before the soak ends). Returns the restarts done."""
    budget = iter(range(requests)) if requests is not None else None
    lock = threading.Lock()
    end = time.monotonic() + (duration if duration is not None else 1e9)
    stop = threading.Event()

    def more() -> bool:
        if stop.is_set() or time.monotonic() > end:
            return False
        if budget is None:
            return True
        with lock:
            return next(budget, None) is not None

    def client(wseed: int) -> None:
        rng = random.Random(wseed)
        conv = None
        while more():
            conv = mix.step(url, conv, rng)

    # Daemons, stopped on any way out: an interrupted soak must not go on sending.
    threads = [
        threading.Thread(target=client, args=(seed * 1000 + i,), daemon=True)
        for i in range(concurrency)
    ]
    for t in threads:
        t.start()
    rng = random.Random(seed)
    done = 0
    # Restarts spread over the soak (jittered), by progress so that they land mid-traffic.
    marks = sorted(rng.uniform(0.2, 0.8) for _ in range(restarts))
    try:
        while any(t.is_alive() for t in threads):
            if counters is not None:
                counters.sample()
            if marks and cluster is not None:
                progress = (
                    mix.tally.requests / requests
                    if requests
                    else 1 - (end - time.monotonic()) / (duration or 1.0)
                )
                if progress >= marks[0]:
                    marks.pop(0)
                    restart(cluster, mix)
                    done += 1
            time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join()
    return done


def restart(cluster: LocalCluster, mix: Mix, timeout: float = 600.0) -> None:
    """One restart of every worker, waited for: `up`'s rolling restart, or a unified drain."""
    mix.restarting.set()
    try:
        before = cluster.restarts_done()
        cluster.restart()
        if cluster.command == "up":
            deadline = time.monotonic() + timeout
            while cluster.restarts_done() <= before:
                if time.monotonic() > deadline or not cluster.alive():
                    raise RuntimeError(f"rolling restart did not finish: {cluster.log}")
                time.sleep(0.5)
    finally:
        mix.restarting.clear()


def verdict(res: dict, hit_floor: float = HIT_RATE_FLOOR) -> list[str]:
    """What failed in one topology's result (empty: it passed)."""
    bad = [
        k for k in ("leaks", "short_or_wrong_200", "error_table_mismatches",
                    "cross_tenant_credit") if res[k]
    ]  # fmt: skip
    if not res["pools_at_baseline"]:
        bad.append("pools_at_baseline")
    if res["crashed"]:
        bad.append("crashed")
    odd = [k for k in res["outcomes"] if k.startswith(("unexpected", "client_error"))]
    bad += odd
    if res["repeat_hit_rate"] < hit_floor:
        bad.append(f"repeat_hit_rate {res['repeat_hit_rate']} < {hit_floor}")
    return bad


def summarize(results: list[dict], command: str, wall_s: float, hit_floor: float) -> dict:
    """The figures over every topology's result (one run, or several merged)."""
    failed = {r["topology"]: bad for r in results if (bad := verdict(r, hit_floor))}
    return {
        "command": command,
        "wall_s": round(wall_s, 1),
        "requests": sum(r["requests"] for r in results),
        "fault_effects": sum(r["fault_effects"] for r in results),
        "guard_catches": sum(r["guard_catches"] for r in results),
        "restarts": sum(r["restarts"] for r in results),
        "preemptions": sum(r["preemptions"] for r in results),
        "leaks": sum(len(r["leaks"]) for r in results),
        "short_or_wrong_200": sum(len(r["short_or_wrong_200"]) for r in results),
        "cross_tenant_credit": sum(len(r["cross_tenant_credit"]) for r in results),
        "error_table_mismatches": sum(len(r["error_table_mismatches"]) for r in results),
        "unexpected_timeouts": sum(r["outcomes"].get("unexpected_timeout", 0) for r in results),
        "pools_at_baseline": all(r["pools_at_baseline"] for r in results),
        "repeat_hit_rate": {r["topology"]: r["repeat_hit_rate"] for r in results},
        "failed": failed,
        "topologies": results,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfence-chaos-cache", description=__doc__)
    ap.add_argument(
        "--model", default=str(Path(__file__).resolve().parents[2] / "models" / "kvfence-tiny")
    )
    ap.add_argument("--topologies", default="unified,1P1D,2P1D,TP2")
    ap.add_argument("--requests", type=int, default=None, help="per topology")
    ap.add_argument("--duration", type=float, default=None, help="seconds per topology")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--restarts", type=int, default=2, help="restarts per topology")
    ap.add_argument("--context-length", type=int, default=512)
    ap.add_argument("--kv-pool-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault-rate", type=float, default=0.05)
    ap.add_argument("--fault-seed", type=int, default=None, help="default: fresh, printed")
    ap.add_argument("--hit-rate-floor", type=float, default=HIT_RATE_FLOOR)
    ap.add_argument("--out", type=Path, default=None, help="write the summary JSON here")
    ap.add_argument("--log-dir", type=Path, default=None, help="keep each cluster's log here")
    ap.add_argument(
        "--merge", type=Path, nargs="+", default=None,
        help="no soak: merge these summaries (soaks run side by side) into --out",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.merge:
        parts = [json.loads(p.read_text()) for p in args.merge]
        results = [r for part in parts for r in part["topologies"]]
        command = " & ".join(part["command"] for part in parts)
        wall = max(part["wall_s"] for part in parts)  # side by side
        summary = summarize(results, command, wall, args.hit_rate_floor)
        print(json.dumps({k: v for k, v in summary.items() if k != "topologies"}, indent=1))
        if args.out is not None:
            args.out.write_text(json.dumps(summary, indent=1) + "\n")
        return 1 if summary["failed"] else 0
    if args.requests is None and args.duration is None:
        ap.error("give --requests or --duration")
    fault_seed = secrets.randbits(32) if args.fault_seed is None else args.fault_seed
    print(f"chaos_cache: fault seed {fault_seed} (replay with --fault-seed {fault_seed})",
          flush=True)  # fmt: skip
    t0 = time.monotonic()
    results = []
    for topology in args.topologies.split(","):
        res = run(
            topology,
            args.model,
            requests=args.requests,
            duration=args.duration,
            ctx=args.context_length,
            pool=args.kv_pool_tokens,
            concurrency=args.concurrency,
            seed=args.seed,
            rate=args.fault_rate,
            fault_seed=fault_seed,
            restarts=args.restarts,
            log_dir=args.log_dir,
        )
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "pools"}, indent=1), flush=True)
        command = "python -m kvfence.tools.chaos_cache " + " ".join(argv or sys.argv[1:])
        summary = summarize(results, command, time.monotonic() - t0, args.hit_rate_floor)
        if args.out is not None:  # after each topology: a run cut short keeps what it did
            args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "topologies"}, indent=1))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
