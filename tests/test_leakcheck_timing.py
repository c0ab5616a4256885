"""leakcheck's timing probe against a fake server with a prefix cache (tests/fake_openai.py's
CachingServer, which charges simulated compute for uncached tokens): a cache per tenant is
clean with a positive control that saw caching, a shared cache is a finding (exit 1), no cache
is "no prefix caching detected" (exit 2 only when the timing probe runs alone), and the salt
arms catch a salt that is dropped. The tests assert verdicts, never a time: leakcheck times on
the fake server's own clock (simulated compute plus a seeded jitter), so the machine's load
cannot move a verdict."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fake_openai import KEYS, CachingServer

from kvfence.tools.leakcheck import (
    EXIT_CANNOT_RUN,
    EXIT_CLEAN,
    EXIT_FAILED,
    Report,
    Settings,
    Tenant,
    check,
    render_summary,
)
from kvfence.tools.leakcheck.timing_stats import auc, ks_pvalue, ks_statistic

TENANTS = tuple(Tenant(t, k) for k, t in KEYS.items())
# 320 prompt tokens at 0.25 ms each: a fresh prompt costs ~80 ms more than a cached one, far
# above the server's 10 ms of jitter.
TIMING = {"timing_prefix_tokens": 320, "timing_pairs": 12}


def run(server: CachingServer, seed: int = 1, **kw: Any) -> Report:
    kw.setdefault("probes", ("timing",))
    kw.setdefault("requests", 120)
    settings = Settings(base_url="http://fake:8000", tenants=TENANTS, seed=seed, **{**TIMING, **kw})
    transport = httpx.MockTransport(server.handle)
    with server.measured_by():
        return asyncio.run(check(settings, transport=transport, err=io.StringIO()))


def arm(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(a for a in report["timing"]["arms"] if a["name"] == name)


def test_cache_per_tenant_is_clean_after_a_positive_control() -> None:
    report = (rep := run(CachingServer(per_token_s=0.00025))).as_dict()
    timing = report["timing"]
    assert report["exit_code"] == EXIT_CLEAN and report["verdict"] == "clean", render_summary(rep)
    assert timing["decision"] == "clean" and timing["control_saw_caching"]
    assert timing["verdict"].startswith("no sharing detected (power:")
    assert timing["power"] >= 0.95
    assert (
        arm(report, "within tenant")["detected"] and not arm(report, "across tenants")["detected"]
    )
    assert arm(report, "across tenants")["pairs"] >= 8
    assert report["probe_states"]["timing"]["state"] == "ran"


def test_cache_shared_across_tenants_is_a_finding() -> None:
    report = (rep := run(CachingServer(per_token_s=0.00025, shared=True))).as_dict()
    assert report["exit_code"] == EXIT_FAILED, render_summary(rep)
    assert report["verdict"] == "shares_cache_across_tenants"
    assert report["timing"]["decision"] == "finding"
    assert "shares cache across tenants" in report["timing"]["verdict"]
    assert arm(report, "across tenants")["detected"]
    assert any(f["kind"] == "timing" for f in report["findings"])
    assert "TIMING: shares cache across tenants" in render_summary(rep)


def test_no_cache_is_inconclusive_never_a_pass(tmp_path: Path) -> None:
    alone = run(
        CachingServer(per_token_s=0.00025, cache=False), report=str(tmp_path / "r.json")
    ).as_dict()
    timing = alone["timing"]
    assert timing["decision"] == "inconclusive" and not timing["control_saw_caching"]
    assert timing["verdict"] == "no prefix caching detected; cross-tenant result inconclusive"
    # Alone, the timing probe decides the exit code: INCOMPLETE, exit 2.
    assert alone["verdict"] == "incomplete" and alone["exit_code"] == EXIT_CANNOT_RUN
    assert timing["plot"] or any("matplotlib" in n for n in alone["notes"])


def test_no_cache_in_the_default_set_is_reported_not_counted() -> None:
    server = CachingServer(per_token_s=0.00025, cache=False)
    report = (rep := run(server, probes=None, requests=200)).as_dict()
    assert report["timing"]["decision"] == "inconclusive", render_summary(rep)
    assert report["exit_code"] == EXIT_CLEAN and report["verdict"] == "clean"
    assert "no prefix caching detected" in render_summary(rep)


@pytest.mark.parametrize("salt_ignored", [False, True])
def test_cache_salt_arms(salt_ignored: bool) -> None:
    server = CachingServer(per_token_s=0.00025, salt_field="cache_salt", salt_ignored=salt_ignored)
    report = (
        rep := run(server, cache_salt_field="cache_salt", requests=160, timing_pairs=10)
    ).as_dict()
    names = {a["name"] for a in report["timing"]["arms"]}
    assert {"same tenant, other salt", "two tenants, same salt"} <= names
    if salt_ignored:  # a salt lost on the way: one tenant's two salts share its cache
        assert report["exit_code"] == EXIT_FAILED, render_summary(rep)
        assert arm(report, "same tenant, other salt")["detected"]
    else:
        assert report["exit_code"] == EXIT_CLEAN, render_summary(rep)
        assert not any(a["detected"] for a in report["timing"]["arms"][1:])


def test_one_tenant_leaves_timing_out_of_the_default_set() -> None:
    settings = Settings(
        base_url="http://fake:8000", tenants=TENANTS[:1], requests=60, seed=1, **TIMING
    )
    transport = httpx.MockTransport(CachingServer(per_token_s=0.00025).handle)
    report = asyncio.run(check(settings, transport=transport, err=io.StringIO())).as_dict()
    assert report["probe_states"]["timing"]["state"] == "not_applicable"
    assert report["timing"] is None


def test_too_small_a_budget_is_skipped_with_the_reason() -> None:
    report = run(CachingServer(per_token_s=0.00025), requests=30).as_dict()
    assert report["probe_states"]["timing"]["state"] == "skipped"
    assert "pairs" in report["probe_states"]["timing"]["reason"]
    assert report["exit_code"] == EXIT_CANNOT_RUN and report["verdict"] == "incomplete"


def test_statistics() -> None:
    hits, fresh = np.array([1.0, 2.0, 3.0]), np.array([4.0, 5.0, 6.0])
    assert auc(hits, fresh) == 1.0 and auc(fresh, hits) == 0.0 and auc(hits, hits) == 0.5
    # Complete separation of 12 vs 12: the exact KS p-value is 2 / C(24, 12).
    a, b = np.arange(12.0), np.arange(12.0) + 100
    assert ks_statistic(a, b) == 1.0
    assert ks_pvalue(1.0, 12, 12) == pytest.approx(2 / 2704156)
    assert ks_pvalue(0.0, 5, 5) == 1.0
