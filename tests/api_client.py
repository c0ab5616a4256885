"""The OpenAI HTTP layer over a fake engine, in-process: a TestClient per app, the `engine` and
`client` fixtures over it, and SSE bodies parsed, shared by the API tests (test_api.py,
test_api_conventions.py) and the status tests (test_i5_status.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fake_engine import FakeEngine
from fastapi import FastAPI
from fastapi.testclient import TestClient
from waiting import wait_for

from kvfence.server.api import build_app
from kvfence.server.operator import operator_headers

MODEL = "fake-model"
OPERATOR_KEY = "op-api-tests-0123456789abcdef"
OPERATOR = operator_headers(OPERATOR_KEY)


class LiveServer:
    """A real uvicorn on a free port, in a thread, for the openai client and real sockets."""

    def __init__(self, app: FastAPI) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        wait_for(lambda: self.server.started)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


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


def typed_events(text: str) -> list[dict[str, Any]]:
    """A Responses stream's events, each checked to carry its type as the SSE event name."""
    out = []
    for block in (b for b in text.split("\n\n") if b.strip()):
        name, data = block.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), block
        obj = json.loads(data[len("data: ") :])
        assert obj["type"] == name[len("event: ") :]
        out.append(obj)
    return out


def sse_json(text: str) -> list[dict[str, Any]]:
    data = sse_data(text)
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]
