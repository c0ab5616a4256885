"""I6: the tenant comes only from the credential. A body field, a header or a room id cannot
pick another tenant's identity, grant or pages; the tenant is in every grant."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvfence.engine.llm import LLM
from kvfence.role import UnifiedService
from kvfence.server.api import build_app

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}


@pytest.fixture(scope="module")
def setup(checkpoint_dir):
    engine = LLM(str(checkpoint_dir("llama")), kv_pool_tokens=1024, context_length=256).engine
    seen: list = []
    real_submit = engine.submit

    def spy(req, sink, *args):
        seen.append(req)
        return real_submit(req, sink, *args)

    engine.submit = spy
    engine.start()
    app = build_app(UnifiedService(engine), api_keys=KEYS, faults=engine.faults)
    yield TestClient(app), engine, seen
    engine.shutdown()


def test_i6_body_header_and_room_cannot_choose_tenant_or_room(setup) -> None:
    client, engine, seen = setup
    seen.clear()
    r = client.post(
        "/v1/completions",
        json={
            "model": engine.model_name,
            "prompt": [5, 6, 7],
            "max_tokens": 2,
            "tenant": "tenant-b",
            "user": "tenant-b",
        },
        headers={
            "Authorization": "Bearer key-a",
            "X-Tenant": "tenant-b",
            "X-Kvfence-Room": "0" * 32,
            "X-Kvfence-Tenant": "tenant-b",
        },
    )
    assert r.status_code == 200, r.text
    [req] = seen
    assert req.tenant == "tenant-a"
    assert req.request_id != "0" * 32 and len(req.request_id) == 32


def test_i6_every_grant_carries_the_credential_tenant(setup) -> None:
    client, engine, _ = setup
    grants: list = []
    real_new_grant = engine.pool.new_grant
    engine.pool.new_grant = lambda tenant, rid: grants.append(tenant) or real_new_grant(tenant, rid)
    try:
        for key in ("key-a", "key-b"):
            r = client.post(
                "/v1/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={
                    "model": engine.model_name,
                    "prompt": [9, 9],
                    "max_tokens": 1,
                    "tenant": "tenant-a",
                },
            )
            assert r.status_code == 200
    finally:
        engine.pool.new_grant = real_new_grant
    assert grants == ["tenant-a", "tenant-b"]


def test_i6_twin_a_header_trusting_server_is_caught(setup) -> None:
    _, engine, _ = setup
    with engine.faults.injected("tenant_from_header"), pytest.raises(AssertionError):
        test_i6_body_header_and_room_cannot_choose_tenant_or_room(setup)


def test_i6_two_authorization_headers_are_refused(setup) -> None:
    # A hop that checks the first header and one that forwards the last would pick different
    # tenants; the request is refused before anything is queued, in either order.
    client, engine, seen = setup
    for pair in (("key-a", "key-b"), ("key-b", "key-a"), ("key-a", "key-a")):
        seen.clear()
        r = client.post(
            "/v1/completions",
            json={"model": engine.model_name, "prompt": [5, 6, 7], "max_tokens": 2},
            headers=[("Authorization", f"Bearer {k}") for k in pair],
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "duplicate_authorization"
        assert seen == []
