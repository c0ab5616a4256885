"""The OpenAI HTTP layer over a fake engine, in-process: a TestClient per app, the `engine` and
`client` fixtures over it, and SSE bodies parsed, shared by the API tests (test_api.py,
test_api_conventions.py) and the status tests (test_i5_status.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from kvfence.server.api import build_app
from kvfence.server.operator import operator_headers

MODEL = "fake-model"
OPERATOR_KEY = "op-api-tests-0123456789abcdef"
OPERATOR = operator_headers(OPERATOR_KEY)


def client_for(
    engine: FakeEngine, api_keys: dict[str, str] | None = None, operator_key: str | None = None
) -> TestClient:
    app = build_app(engine, api_keys=api_keys, operator_key=operator_key)
    return TestClient(app, raise_server_exceptions=False)


def fake_app_fixtures(api_keys: dict[str, str] | None = None) -> tuple[Any, Any]:
    """A test module's `engine` (a started FakeEngine, one per test) and `client` (the app over
    it; `api_keys`: its tenants) fixtures: `engine, client = fake_app_fixtures()` at top level."""

    @pytest.fixture(name="engine")
    def engine_() -> Iterator[FakeEngine]:
        e = FakeEngine()
        e.start()
        yield e
        e.shutdown()

    @pytest.fixture(name="client")
    def client_(engine: FakeEngine) -> Iterator[TestClient]:
        with client_for(engine, api_keys) as c:
            yield c

    return engine_, client_


def sse_data(text: str) -> list[str]:
    events = [e for e in text.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: ") :] for e in events]


def sse_json(text: str) -> list[dict[str, Any]]:
    data = sse_data(text)
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]
