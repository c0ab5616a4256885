"""Chaos soak (30 s): random faults with all guards on, three tenants with canaries of random
lengths. Behind RUN_SLOW=1: CI runs the cache-mix soak instead (test_chaos_cache.py: the same
checks and faults on unified and 1P1D, with shared prefixes, multi-turn reuse and its own
checks), and the long cache-mix soak covers 2P1D. `python -m kvfence.tools.chaos --duration
600` soaks 1P1D and 2P1D, longer."""

from __future__ import annotations

import json
import os

import pytest
from conftest import TINY_MODEL

from kvfence.tools.chaos import run

SLOW = pytest.mark.skipif(
    not os.environ.get("RUN_SLOW"), reason="CI soaks the cache mix instead: RUN_SLOW=1"
)


@SLOW
@pytest.mark.serial  # asserts a request count reached in a fixed 30 s: alone
@pytest.mark.parametrize("prefill", [1, 2], ids=["1P1D", "2P1D"])
def test_chaos_soak_all_guards_on(prefill: int) -> None:
    res = run(str(TINY_MODEL), prefill, duration=30.0)
    print(json.dumps(res, indent=1))  # the counts, for the CI log
    assert res["requests"] >= 40, res
    assert res["fault_effects_seen"] > 0, "no fault fired: the soak proved nothing"
    assert res["leaks"] == [], "a foreign canary reached an answer"
    assert res["short_or_wrong_200"] == [], "a 200 carried a short or over-length answer"
    assert res["pools_at_baseline"], "pages leaked"
    assert not res["crashed"]
    outcomes = res["outcomes"]
    assert outcomes.get("ok_200", 0) > 0 and outcomes.get("http_400", 0) > 0
    assert not any(k.startswith(("unexpected", "client_error")) for k in outcomes), outcomes
