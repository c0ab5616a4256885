"""The cache-mix chaos soak (kvfence/tools/chaos_cache.py), bounded for CI: a fixed seed, a
fixed number of requests of the cache mix on a unified server and on 1P1D at once, every
action fault point armed; and its twin, the prefix cache's namespace guard off, which the
soak's cross-tenant credit check must catch. The clusters start and soak side by side: on a
loaded machine their start-ups overlap. Restarts mid-soak, 2P1D and TP=2 run in the long soak
(`scripts/chaos_cache.sh`) and here with RUN_SLOW=1."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import TINY_MODEL

from kvfence.tools.chaos_cache import run, verdict

SEED = 7
# A floor the mix clears with room on a loaded machine (a few turns of each conversation fail
# under faults or are cut): the check is that the cache serves repeat turns at all.
HIT_FLOOR = 0.2


def _soak(topology: str, **kw: object) -> dict:
    return run(topology, str(TINY_MODEL), seed=SEED, fault_seed=SEED, concurrency=6,
               **kw)  # type: ignore[arg-type]  # fmt: skip


def _passed(res: dict) -> None:
    print(json.dumps({k: v for k, v in res.items() if k != "pools"}, indent=1))
    assert verdict(res, HIT_FLOOR) == [], res
    assert res["outcomes"].get("ok_200", 0) > 0
    assert res["outcomes"].get("http_400_context_length_exceeded", 0) > 0


@pytest.mark.serial  # three clusters at once
def test_cache_mix_soak_unified_and_1p1d_and_its_twin() -> None:
    with ThreadPoolExecutor(3) as pool:
        unified = pool.submit(_soak, "unified", requests=100, restarts=0)
        pd = pool.submit(_soak, "1P1D", requests=160, restarts=0, pool=768)
        # The twin: every tenant's cache pages keyed alike. Every conversation opens with the
        # system prompt all tenants share, so another tenant's pages get credited at once, and
        # the soak must say so.
        twin = pool.submit(
            _soak, "unified", requests=24, restarts=0, faults=["prefix_cache_ignore_namespace"],
            rate=1.0, heads=(("system", 1),),
        )  # fmt: skip
        u, p, t = unified.result(), pd.result(), twin.result()
    _passed(u)
    _passed(p)
    assert p["fault_effects"] > 0 and p["guard_catches"] > 0, "no fault fired in 1P1D"
    print(json.dumps({k: t[k] for k in ("requests", "cross_tenant_credit")}, indent=1))
    assert t["cross_tenant_credit"], "the twin credited another tenant's pages unseen"


SLOW = pytest.mark.skipif(not os.environ.get("RUN_SLOW"), reason="minutes: RUN_SLOW=1")


@SLOW
@pytest.mark.serial
@pytest.mark.parametrize("topology", ["unified", "1P1D", "2P1D", "TP2"])
def test_cache_mix_soak_with_restarts(topology: str) -> None:
    _passed(_soak(topology, requests=300, restarts=1, pool=768))
