"""The cache-mix chaos soak (kvfence/tools/chaos_cache.py), bounded for CI: a fixed seed and a
fixed number of requests of the cache mix on a unified server and on 1P1D side by side (their
start-ups overlap on a loaded machine), every action fault point armed; and its twin, the
prefix cache's namespace guard off in an in-process server, which the soak's cross-tenant
credit check must catch. Restarts mid-soak, 2P1D and TP=2 run in the long soak
(`scripts/chaos_cache.sh`) and here with RUN_SLOW=1."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import TINY_MODEL
from fake_workers import ServerThread

from kvfence import env
from kvfence.config import EngineConfig
from kvfence.engine.engine import Engine
from kvfence.faults import Faults
from kvfence.role import UnifiedService
from kvfence.server.api import build_app
from kvfence.tools.chaos import TENANTS
from kvfence.tools.chaos_cache import FAULTS, make_mix, prefixes, run, soak, verdict

SEED = 7
# A floor the mix clears with room on a loaded machine (turns fail under faults or are cut):
# the check is that the cache serves repeat turns at all.
HIT_FLOOR = 0.2


def _soak(topology: str, **kw: object) -> dict:
    return run(topology, str(TINY_MODEL), seed=SEED, fault_seed=SEED, concurrency=6,
               **kw)  # type: ignore[arg-type]  # fmt: skip


def _passed(res: dict) -> None:
    print(json.dumps({k: v for k, v in res.items() if k != "pools"}, indent=1))
    assert verdict(res, HIT_FLOOR) == [], res
    assert res["outcomes"].get("ok_200", 0) > 0


def _over_length_refused(*results: dict) -> int:
    # 5% of turns run past the context: over a few hundred requests some always do.
    return sum(r["outcomes"].get("http_400_context_length_exceeded", 0) for r in results)


@pytest.mark.serial  # two clusters at once
def test_cache_mix_soak_unified_and_1p1d() -> None:
    with ThreadPoolExecutor(2) as pool:
        unified = pool.submit(_soak, "unified", requests=100, restarts=0)
        pd = pool.submit(_soak, "1P1D", requests=160, restarts=0, pool=768)
        u, p = unified.result(), pd.result()
    _passed(u)
    _passed(p)
    assert _over_length_refused(u, p) > 0
    assert p["fault_effects"] > 0 and p["guard_catches"] > 0, "no fault fired in 1P1D"


def test_twin_one_cache_for_all_tenants_is_caught_by_the_credit_check(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every tenant's pages keyed alike (prefix_cache_ignore_namespace). Every conversation
    opens with the system prompt all tenants share, so another tenant's pages get credited at
    once, and the soak's check must say so."""
    monkeypatch.setenv(env.FAULT_INJECTION, "1")
    faults = Faults(rate=1.0, seed=SEED)
    faults.arm("prefix_cache_ignore_namespace")
    shared = tmp_path / "shared.json"
    shared.write_text(json.dumps([prefixes(str(TINY_MODEL))[0]]))
    # One kernel thread: in the test's own process, beside its clients, every core's OpenMP
    # team only waits for the busiest core of a loaded machine.
    cfg = EngineConfig(model=str(TINY_MODEL), kv_pool_tokens=1024, context_length=512,
                       shared_prefix_file=str(shared), threads=1)  # fmt: skip
    engine = Engine(cfg, faults)
    engine.start()
    server = ServerThread(build_app(UnifiedService(engine), api_keys=TENANTS, faults=faults))
    try:
        server.start()
        mix = make_mix(str(TINY_MODEL), 512, SEED, heads=(("system", 1),))
        soak(server.url, mix, requests=12, duration=None, concurrency=3, seed=SEED)
    finally:
        server.stop()
        engine.shutdown()
    breaches = mix.ledger.credit_breaches(cfg.page_size)
    print(json.dumps({"requests": mix.tally.requests, "breaches": breaches}, indent=1))
    assert breaches, "another tenant's cached pages were credited and the soak did not see it"


def test_no_point_armed_through_the_environment_turns_a_guard_off_everywhere() -> None:
    """The environment arms a point in every process of a worker, TP ranks included: a point
    meant for one rank (or a twin) would switch the guard off in all of them at once."""
    assert "tp_rank_skips_tag_check" not in FAULTS
    assert "tp_leader_decides_alone" not in FAULTS
    assert not set(FAULTS) & {"kill_prefill", "kill_decode"}


SLOW = pytest.mark.skipif(not os.environ.get("RUN_SLOW"), reason="minutes: RUN_SLOW=1")


@SLOW
@pytest.mark.serial
@pytest.mark.parametrize("topology", ["unified", "1P1D", "2P1D", "TP2"])
def test_cache_mix_soak_with_restarts(topology: str) -> None:
    res = _soak(topology, requests=300, restarts=1, pool=768)
    _passed(res)
    assert _over_length_refused(res) > 0
