"""The OpenAI HTTP layer over a fake engine, in-process: a TestClient per app and SSE bodies
parsed, shared by the API tests (test_api.py) and the status tests (test_i5_status.py)."""

from __future__ import annotations

import json
from typing import Any

from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from kvfence.server.api import build_app

MODEL = "fake-model"


def client_for(engine: FakeEngine, api_keys: dict[str, str] | None = None) -> TestClient:
    return TestClient(build_app(engine, api_keys=api_keys), raise_server_exceptions=False)


def sse_data(text: str) -> list[str]:
    events = [e for e in text.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: ") :] for e in events]


def sse_json(text: str) -> list[dict[str, Any]]:
    data = sse_data(text)
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]
