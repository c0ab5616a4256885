"""Fault points are a test harness's tool: none can be armed unless the process runs with
KVFENCE_FAULT_INJECTION=1, and nothing an HTTP request carries arms one. Each refusal has a twin
that shows the same step arms the point once fault injection is on, so no check passes vacuously.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_MODEL
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from kvfence import env
from kvfence.faults import (
    ACTION_POINTS,
    GUARD_POINTS,
    POINTS,
    Faults,
    FaultsDisabled,
    SimulatedCrash,
)
from kvfence.faults.effects import EFFECTS
from kvfence.server.api import build_app

KEYS = {"key-a": "tenant-a"}
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("value", [None, "", "0", "true"])
def test_fault_points_cannot_be_armed_without_fault_injection(monkeypatch, value) -> None:
    if value is None:
        monkeypatch.delenv(env.FAULT_INJECTION, raising=False)
    else:
        monkeypatch.setenv(env.FAULT_INJECTION, value)
    faults = Faults()
    for point in sorted(POINTS):
        with pytest.raises(FaultsDisabled):
            faults.arm(point)
    monkeypatch.setenv(env.FAULTS, "skip_tag_check,corrupt_page")
    with pytest.raises(FaultsDisabled):
        Faults.from_env()
    assert faults.armed == frozenset()
    assert faults.guards().off == frozenset()


def test_twin_with_fault_injection_the_same_steps_arm(monkeypatch) -> None:
    monkeypatch.setenv(env.FAULT_INJECTION, "1")
    monkeypatch.setenv(env.FAULTS, "skip_tag_check,corrupt_page")
    faults = Faults.from_env()
    assert faults.armed == {"skip_tag_check", "corrupt_page"}
    assert faults.guards().off == {"tag_check"}
    assert faults.active("corrupt_page") and not faults.active("late_write")


def test_a_child_started_with_faults_but_without_fault_injection_refuses_to_start() -> None:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KVFENCE_")}
    child_env[env.FAULTS] = "skip_admission"
    proc = subprocess.run(
        [sys.executable, "-m", "kvfence.cli", "serve", "--model", str(TINY_MODEL), "--port", "0"],
        env={**child_env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "fault injection is disabled" in proc.stderr


def test_the_fault_draw_is_seeded() -> None:
    """The chaos soak prints its seed: the same seed fires the same points at the same checks."""
    draws = []
    for _ in range(2):
        faults = Faults(rate=0.5, seed=1234)
        faults.arm("corrupt_page")
        draws.append([faults.active("corrupt_page") for _ in range(64)])
    assert draws[0] == draws[1]
    assert any(draws[0]) and not all(draws[0])


def test_fires_are_counted_and_shown_to_the_operator_only_when_armed(monkeypatch) -> None:
    """The chaos soaks count fault effects from /metrics: each fire of an armed point, by point;
    a process with nothing armed shows no such family."""
    from kvfence.server.metrics import ServerMetrics

    monkeypatch.setenv(env.FAULT_INJECTION, "1")
    quiet = Faults(rate=1.0)
    assert b"kvfence_fault_fires" not in ServerMetrics(FakeEngine(), quiet).render()[0]
    faults = Faults(rate=1.0)
    faults.arm("corrupt_page")
    assert faults.hook("corrupt_page", False) and faults.hook("corrupt_page", False)
    assert faults.hook("late_write", False) is False  # not armed: no fire
    text = ServerMetrics(FakeEngine(), faults).render()[0].decode()
    assert 'kvfence_fault_fires_total{point="corrupt_page"} 2.0' in text
    assert "late_write" not in text


def test_nothing_an_http_request_carries_arms_a_fault_point() -> None:
    engine = FakeEngine()
    engine.start()
    faults = Faults()  # this process may arm points (conftest): only the request path is tested
    try:
        client = TestClient(build_app(engine, api_keys=KEYS, faults=faults))
        names = ",".join(sorted(POINTS))
        headers = {
            "Authorization": "Bearer key-a",
            "X-Tenant": "tenant-b",
            "X-Kvfence-Faults": names,
            env.FAULTS: names,
            env.FAULT_INJECTION: "1",
        }
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
        for path, extra in (
            ("/v1/completions", {}),
            (f"/v1/completions?faults={names}", {"faults": names, "kvfence_faults": [names]}),
        ):
            r = client.post(path, json={**body, **extra}, headers=headers)
            assert r.status_code in (200, 400), r.text
        assert faults.armed == frozenset()
        assert {r.tenant for r in engine.submitted} <= {"tenant-a"}
        # Twin: armed in-process, the guard point the header names does take effect.
        with faults.injected("tenant_from_header"):
            r = client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        assert engine.submitted[-1].tenant == "tenant-b"
    finally:
        engine.shutdown()


def test_only_the_faults_module_arms_fault_points() -> None:
    """In kvfence only Faults arms (from_env, for the CLI's child entry); the HTTP layer, the
    services and the engine only read points. Tests arm the rest."""
    arming = [
        path.relative_to(REPO)
        for path in (REPO / "kvfence").rglob("*.py")
        if ".arm(" in path.read_text() or "injected(" in path.read_text()
    ]
    assert [str(p) for p in arming] == ["kvfence/faults/__init__.py"], arming
    assert set(GUARD_POINTS) <= POINTS


def test_kill_point_calls_the_harness_crash_action_and_the_room_fails_closed(
    checkpoint_dir,
) -> None:
    """kill_prefill never ends a process by itself: it calls the crash action its entry set (the
    CLI's child entry: SIGKILL); a harness's action records it, and the point then raises, so
    the room fails closed (I5) and both pools return to baseline."""
    from pd_harness import PDPair, Result

    from kvfence.engine.request import FinishReason, SamplingParams

    crashed: list[str] = []
    faults = Faults(crash=crashed.append)
    model = str(checkpoint_dir("llama"))
    pair = PDPair(model, faults=faults, kv_pool_tokens=512, context_length=128)
    try:
        with faults.injected("kill_prefill"):
            _, r = pair.submit([5] * 40, SamplingParams(max_tokens=2, temperature=0.0))
            assert isinstance(r, Result) and r.done.wait(60), "the request never ended"
        assert crashed == ["kill_prefill"]
        assert r.final is not None and r.final.finish_reason is FinishReason.ERROR
        assert r.token_ids == []
        assert pair.wait_idle(), pair.pages_used()
    finally:
        pair.close()


def test_every_action_point_has_one_effect_and_an_unarmed_hook_is_the_identity(
    monkeypatch,
) -> None:
    """The seam: production passes a value through hook(); only an armed point changes it, and
    what it changes it to lives in effects.py (one effect per action point)."""
    assert set(EFFECTS) == ACTION_POINTS and not set(EFFECTS) & set(GUARD_POINTS)
    monkeypatch.setenv(env.FAULT_INJECTION, "1")
    faults = Faults()
    pages = [7, 8, 9]
    assert faults.hook("write_sealed_page", pages, n_hit=2) is pages
    assert faults.hook("tp_leader_decides_alone", False) is False
    faults.hook("kill_decode")  # unarmed: nothing happens
    # Twin: armed, the same hooks return the faulty value (and a kill point crashes).
    with faults.injected("write_sealed_page", "tp_leader_decides_alone", "kill_decode"):
        assert faults.hook("write_sealed_page", pages, n_hit=2) == [7, 8, 8]
        assert faults.hook("write_sealed_page", pages, n_hit=0) == pages  # nothing sealed
        assert faults.hook("tp_leader_decides_alone", False) is True
        with pytest.raises(SimulatedCrash):
            faults.hook("kill_decode")
    assert pages == [7, 8, 9]  # the effect rewrote a copy, not the caller's list


def test_production_code_names_action_points_only_through_hooks() -> None:
    """No file outside kvfence/faults branches on an action point or crashes by hand: a reader
    of production code sees real behaviour and one hook line per point."""
    branching = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "kvfence").rglob("*.py")
        if "faults" not in path.relative_to(REPO).parts[1:2]
        and ("faults.active(" in path.read_text() or "faults.crash(" in path.read_text())
    )
    assert branching == [], branching
