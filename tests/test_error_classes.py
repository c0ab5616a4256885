"""Errors a client can act on (issue 47): one status per class of failure, decided in one place
(server/errors.py server_failure) and documented in the README's table. A KV transfer that fails
closed, a lost prefill or a draining node is a 503 with Retry-After (the same request may be
retried: nothing of it was answered); a bug or a guard that caught corrupt state is a 500; the
client's own fault keeps its 4xx."""

from __future__ import annotations

import pytest
from api_client import MODEL, fake_app_fixtures
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from kvfence.server.errors import RETRY_AFTER_S, RETRYABLE, server_failure, table_mismatch

engine, client = fake_app_fixtures()

BODY = {"model": MODEL, "prompt": "x", "max_tokens": 5}


@pytest.mark.parametrize("code", sorted(RETRYABLE))
def test_retryable_failures_are_a_503_with_retry_after(code: str) -> None:
    for reported in (None, 500, 504, 409, 503):
        err = server_failure(code, "m", reported)
        assert (err.status, err.type) == (503, "server_error"), (code, reported)
        assert err.headers == {"Retry-After": str(RETRY_AFTER_S)}


@pytest.mark.parametrize("code", ["internal_error", "kv_integrity_error", "kv_grant_mismatch"])
def test_bugs_and_tripped_integrity_guards_are_a_500_without_retry_after(code: str) -> None:
    for reported in (None, 500, 502):
        err = server_failure(code, "m", reported)
        assert (err.status, err.type, err.headers) == (500, "server_error", None)


def test_a_clients_fault_keeps_its_4xx() -> None:
    err = server_failure("exceeds_kv_pool", "too long", 400)
    assert (err.status, err.type, err.headers) == (400, "invalid_request_error", None)


@pytest.mark.parametrize(
    "code, status, retry_after",
    [
        ("kv_transfer_incomplete", 503, str(RETRY_AFTER_S)),
        ("kv_transfer_timeout", 503, str(RETRY_AFTER_S)),
        ("prefill_unavailable", 503, str(RETRY_AFTER_S)),
        ("kv_integrity_error", 500, None),
    ],
)
def test_http_answer_of_an_engine_failure_follows_the_table(
    engine: FakeEngine, client: TestClient, code: str, status: int, retry_after: str | None
) -> None:
    engine.fail_after, engine.fail_code = 0, code
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5}
    for path, body in (("/v1/completions", BODY), ("/v1/chat/completions", chat)):
        r = client.post(path, json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == code
        assert r.headers.get("retry-after") == retry_after


@pytest.mark.parametrize(
    ("status", "code", "type_", "after", "agrees"),
    [
        (503, "kv_transfer_incomplete", "server_error", "1", True),
        (503, "draining", "server_error", None, False),  # no Retry-After: the soak's finding
        (500, "kv_transfer_incomplete", "server_error", None, False),  # retryable as a 500
        (500, "kv_integrity_error", "server_error", None, True),
        (503, "kv_integrity_error", "server_error", "1", False),  # a caught guard as retryable
        (400, "context_length_exceeded", "invalid_request_error", None, True),
        (429, "slow_reader", "invalid_request_error", "2", True),
        (400, "context_length_exceeded", "server_error", None, False),
        (502, "upstream_failed", "server_error", None, True),
        (504, "upstream_timeout", "server_error", None, True),
        (500, "upstream_timeout", "server_error", None, False),
        (None, "kv_transfer_incomplete", "server_error", None, True),  # a started stream's event
        (None, "request_aborted", "invalid_request_error", None, False),
        (None, "grammar_error", "invalid_request_error", None, True),
    ],
)
def test_the_soaks_table_check_is_the_table(
    status: int | None, code: str, type_: str, after: str | None, agrees: bool
) -> None:
    """What the chaos soaks assert of every error answer (table_mismatch), rebuilt from
    server_failure, not restated: it agrees with the table's answers and names the rest."""
    assert (table_mismatch(status, code, type_, after) is None) == agrees
