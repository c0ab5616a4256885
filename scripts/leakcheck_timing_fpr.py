"""Measures the timing probe's false-positive rate and power against tests/fake_openai.py's
CachingServer: N runs against a cache per tenant (sound: any finding is a false positive) and N
against a cache shared across tenants (the leak: each run without a finding is a miss), with the
same settings as tests/test_leakcheck_timing.py. Prints the counts and the command.
With --kvfence, the same against a real unified `kvfence serve` of the bundled model (sound, and
its twin with fault prefix_cache_ignore_namespace), one server each, with the settings of
tests/test_leakcheck_timing_kvfence.py.

    PYTHONPATH=$PWD .venv/bin/python scripts/leakcheck_timing_fpr.py --runs 20
    PYTHONPATH=$PWD .venv/bin/python scripts/leakcheck_timing_fpr.py --kvfence --runs 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import sys
import tempfile
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fake_openai import KEYS, CachingServer  # noqa: E402
from test_leakcheck_timing_kvfence import TWIN, serve_unified, timing_check  # noqa: E402

from kvfence.tools.leakcheck import Settings, Tenant, check  # noqa: E402

TENANTS = tuple(Tenant(t, k) for k, t in KEYS.items())


def one(shared: bool, cache: bool, seed: int, pairs: int) -> str:
    settings = Settings(
        base_url="http://fake:8000",
        tenants=TENANTS,
        seed=seed,
        requests=120,
        probes=("timing",),
        timing_prefix_tokens=320,
        timing_pairs=pairs,
    )
    server = CachingServer(per_token_s=0.00025, shared=shared, cache=cache)
    report = asyncio.run(
        check(settings, transport=httpx.MockTransport(server.handle), err=io.StringIO())
    )
    return report.timing.decision.value if report.timing else "not run"


def kvfence(runs: int, seed: int) -> None:
    for name, env in (
        ("kvfence, tenant-scoped cache (sound)", None),
        ("kvfence twin (leak)", TWIN),
    ):
        with tempfile.TemporaryDirectory() as tmp:
            node = serve_unified(Path(tmp), env=env)
            try:
                counts: Counter[str] = Counter()
                for i in range(runs):
                    with contextlib.redirect_stdout(io.StringIO()):  # its summary each run
                        code, report = timing_check(node.url, Path(tmp), seed + i)
                    counts[f"{report['timing']['decision']} (exit {code})"] += 1
            finally:
                node.stop()
        print(f"{name}: {dict(counts)} over {runs} runs", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--seed", type=int, default=1000, help="first seed; runs use seed, seed+1, ...")
    p.add_argument("--kvfence", action="store_true", help="against a real kvfence serve")
    a = p.parse_args()
    if a.kvfence:
        kvfence(a.runs, a.seed)
        print("command: " + " ".join(sys.argv))
        return
    for name, shared, cache in (
        ("cache per tenant (sound)", False, True),
        ("cache shared across tenants (leak)", True, True),
        ("no cache", False, False),
    ):
        counts = Counter(one(shared, cache, a.seed + i, a.pairs) for i in range(a.runs))
        print(f"{name}: {dict(counts)} over {a.runs} runs", flush=True)
    print("command: " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
