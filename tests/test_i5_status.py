"""I5 status: every request ends exactly once, with the full correct answer or an error the
client sees; never an HTTP 200 with partial or foreign content.

The engine's side (`Engine._finish` sends one final output, abort included) runs on the tiny
model; the server's side (`kvfence/server/generate.py` turns an ERROR or ABORT finish into an
error status, or an error event once a stream has begun) runs on the fake engine. I5 has no fault
point: its twin patches the server's list of failed finishes empty and shows the partial 200 the
tests above refuse."""

from __future__ import annotations

import json
import threading

import pytest
from api_client import MODEL, client_for, fake_app_fixtures, sse_data
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from waiting import wait_for

from kvfence.engine.llm import LLM
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput, SamplingParams
from kvfence.server import generate


@pytest.fixture(scope="module")
def llm(checkpoint_dir) -> LLM:
    return LLM(str(checkpoint_dir("llama")), kv_pool_tokens=2048, context_length=256)


engine, client = fake_app_fixtures()


# ---- the engine ends a request once ------------------------------------------------------------


def test_i5_abort_returns_pages_and_finishes_once(llm: LLM) -> None:
    engine = llm.engine
    outs: list[RequestOutput] = []
    sp = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    engine.submit(GenerateRequest("ab", "t", (3,) * 40, sp), outs.append)
    engine.step()
    engine.step()
    assert engine.stats().pages_used > 0
    engine.abort("ab")
    engine.abort("ab")  # idempotent
    engine.step()
    assert engine.stats().pages_used == 0
    finals = [o for o in outs if o.finished]
    assert len(finals) == 1 and finals[0].finish_reason is FinishReason.ABORT


# ---- the server never answers a failed request with a 200 --------------------------------------


def test_i5_engine_error_before_first_token_is_a_500(engine: FakeEngine) -> None:
    engine.fail_after = 0
    with client_for(engine) as c:
        for stream in (False, True):
            r = c.post("/v1/completions",
                       json={"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": stream})
            assert r.status_code == 500
            assert r.json() == {"error": {"message": "KV grant check failed for this request.",
                                          "type": "server_error", "param": None,
                                          "code": "kv_grant_mismatch"}}


def test_i5_engine_error_after_tokens_is_never_a_partial_200(engine: FakeEngine) -> None:
    engine.fail_after = 3
    with client_for(engine) as c:
        r = c.post("/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                         "max_tokens": 10})
        assert r.status_code == 500 and "choices" not in r.json()
        assert r.json()["error"]["code"] == "kv_grant_mismatch"
        r = c.post("/v1/completions",
                   json={"model": MODEL, "prompt": "abcdef", "max_tokens": 10, "stream": True})
        assert r.status_code == 200  # headers went out with the first token
        data = sse_data(r.text)
        assert "[DONE]" not in data
        last = json.loads(data[-1])
        assert last == {"error": {"message": "KV grant check failed for this request.",
                                  "type": "server_error", "param": None,
                                  "code": "kv_grant_mismatch"}}
        assert all(json.loads(d)["choices"][0]["finish_reason"] is None for d in data[:-1])


def test_i5_server_side_abort_is_a_503_not_a_partial_answer(client: TestClient,
                                                            engine: FakeEngine) -> None:
    engine.hold = True

    def abort_when_submitted() -> None:
        wait_for(lambda: engine.submitted)
        engine.abort(engine.submitted[0].request_id)

    t = threading.Thread(target=abort_when_submitted)
    t.start()
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5})
    t.join()
    assert r.status_code == 503 and r.json()["error"]["code"] == "request_aborted"


def test_i5_twin_a_server_that_finishes_failures_normally_sends_a_partial_200(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The twin of the partial-200 test: with no finish counted as failed, the engine's error
    after 3 tokens reaches the client as a 200 carrying those 3 tokens, and the test fails."""
    monkeypatch.setattr(generate, "_FAILED", ())
    engine.fail_after = 3
    with client_for(engine) as c:
        r = c.post("/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                         "max_tokens": 10})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    with pytest.raises(AssertionError):
        test_i5_engine_error_after_tokens_is_never_a_partial_200(engine)
