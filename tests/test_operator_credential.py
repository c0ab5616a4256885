"""Internal endpoints are the operator's (issue 15, items 2 and 7): with tenant keys or an
operator key configured, /metrics and /pd/info answer only the operator key, a tenant key gets
403, and anonymous /health says up or down, on workers and on the router. Nothing a tenant key can
read names another tenant. Twin: skip_operator_check (they were open to anyone)."""

from __future__ import annotations

import httpx
import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from kvfence.faults import Faults
from kvfence.server.api import build_app
from kvfence.server.operator import OperatorKeyError, load_operator_key, operator_headers
from kvfence.server.router import build_router_app
from kvfence.tools.cluster import free_port

OPERATOR_KEY = "op-operator-tests-0123456789abcdef"
OPERATOR = operator_headers(OPERATOR_KEY)
KEYS = {"sk-acme-123": "acme", "sk-globex-456": "globex"}
ACME = {"Authorization": "Bearer sk-acme-123"}
GLOBEX = {"Authorization": "Bearer sk-globex-456"}


def _get_paths(app) -> list[str]:
    """Every GET route of the app, path parameters filled with the served model's name."""
    paths = []
    for route in app.routes:
        if "GET" in getattr(route, "methods", set()):
            paths.append(route.path.replace("{model_id:path}", "fake-model"))
    return paths


def _worker(faults: Faults) -> tuple[TestClient, FakeEngine]:
    engine = FakeEngine()
    engine.start()
    app = build_app(engine, api_keys=KEYS, faults=faults, operator_key=OPERATOR_KEY)
    return TestClient(app, raise_server_exceptions=False), engine


def _acme_has_been_served(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "x",
                                             "max_tokens": 1}, headers=ACME)
    assert r.status_code == 200, r.text


def test_a_tenant_key_reads_nothing_of_another_tenant_on_any_worker_route() -> None:
    client, engine = _worker(Faults())
    try:
        _acme_has_been_served(client)
        paths = _get_paths(client.app)
        assert {"/health", "/metrics", "/pd/info"} <= set(paths)
        for path in paths:
            for headers in (GLOBEX, {}):
                r = client.get(path, headers=headers)
                assert "acme" not in r.text, (path, r.text)
                if path in ("/metrics", "/pd/info"):
                    assert r.status_code == 403, (path, r.status_code)
        assert client.get("/health").json() == {"status": "ok"}
        # The positive control: the operator key reads the tenant's counters.
        assert 'tenant="acme"' in client.get("/metrics", headers=OPERATOR).text
        assert client.get("/pd/info", headers=OPERATOR).status_code == 200
        assert client.get("/metrics", headers={**GLOBEX}).json()["error"]["code"] == (
            "operator_only"
        )
    finally:
        engine.shutdown()


def test_twin_without_the_operator_check_a_tenant_reads_another_tenants_counts() -> None:
    faults = Faults()
    client, engine = _worker(faults)
    try:
        _acme_has_been_served(client)
        with faults.injected("skip_operator_check"):
            r = client.get("/metrics", headers=GLOBEX)
        assert r.status_code == 200 and 'tenant="acme"' in r.text
    finally:
        engine.shutdown()


def test_router_tells_anonymous_and_tenants_only_up_or_down() -> None:
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    app = build_router_app(dead[:1], dead[1:], api_keys=KEYS, operator_key=OPERATOR_KEY,
                           health_timeout=0.5)
    with TestClient(app, raise_server_exceptions=False) as client:
        for path in _get_paths(app):
            for headers in (GLOBEX, {}):
                r = client.get(path, headers=headers)
                assert "127.0.0.1" not in r.text and "acme" not in r.text, (path, r.text)
        r = client.get("/health", headers=GLOBEX)
        assert r.status_code == 503 and r.json() == {"status": "unavailable"}
        assert client.get("/metrics", headers=GLOBEX).status_code == 403
        detail = client.get("/health", headers=OPERATOR).json()
        assert [w["url"] for w in detail["workers"]] == dead
        assert client.get("/metrics", headers=OPERATOR).status_code == 200


def test_operator_key_file_is_checked(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KVFENCE_ADMIN_API_KEY", raising=False)
    assert load_operator_key(None) is None
    short = tmp_path / "k"
    short.write_text("short\n")
    with pytest.raises(OperatorKeyError, match="at least"):
        load_operator_key(str(short))
    short.write_text(OPERATOR_KEY + "\n")
    assert load_operator_key(str(short)) == OPERATOR_KEY
    monkeypatch.setenv("KVFENCE_ADMIN_API_KEY", OPERATOR_KEY)
    assert load_operator_key(None) == OPERATOR_KEY


class _RoleEngine(FakeEngine):
    """The fake engine as a PD worker would describe itself in /pd/info."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role
        self.bootstrap_port = free_port() if role == "prefill" else None

    def info(self) -> dict:
        return {**super().info(), "role": self.role, "bootstrap_port": self.bootstrap_port}


def test_the_router_reads_its_workers_and_signs_the_hop_with_the_operator_key() -> None:
    """Real worker apps holding the operator key: the router's health poll gets past their
    operator-only /pd/info, and the decode accepts the prefill address the router signed. A router
    holding another key is refused at both."""
    from fake_workers import ServerThread, stop_all

    engines = [_RoleEngine("prefill"), _RoleEngine("decode")]
    servers = []
    try:
        for e in engines:
            e.start()
            app = build_app(e, api_keys=KEYS, operator_key=OPERATOR_KEY)
            servers.append(ServerThread(app).start())
        p_url, d_url = (s.url for s in servers)
        body = {"model": "fake-model", "prompt": "x", "max_tokens": 1}
        for key, healthy in ((OPERATOR_KEY, True), ("op-someone-else-0123456789ab", False)):
            router = ServerThread(build_router_app([p_url], [d_url], api_keys=KEYS,
                                                   operator_key=key)).start()
            servers.append(router)
            detail = httpx.get(f"{router.url}/health", headers=operator_headers(key)).json()
            assert [w["healthy"] for w in detail["workers"]] == [healthy, healthy], detail
            if not healthy:
                assert all("403" in w["detail"] for w in detail["workers"]), detail
                continue
            r = httpx.post(f"{router.url}/v1/completions", json=body, headers=ACME, timeout=10)
            assert r.status_code == 200, r.text
            (seen,) = engines[1].submitted
            assert seen.peer == f"127.0.0.1:{engines[0].bootstrap_port}"
        # The decode refuses the same address signed under another key.
        from kvfence.server.hop import sign_prefill

        forged = sign_prefill("op-someone-else-0123456789ab", "127.0.0.1:1")
        r = httpx.post(f"{d_url}/v1/completions", json=body, headers={**ACME, **forged})
        assert r.status_code == 403 and r.json()["error"]["code"] == "unsigned_prefill"
    finally:
        stop_all(servers)
        for e in engines:
            e.shutdown()
