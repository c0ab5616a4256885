"""The OpenAI HTTP layer against the fake engine: shapes, streaming, tenancy (I6), admission (I1),
client disconnects, metrics, and the official openai client on uvicorn. How engine failures
reach the client (I5) is in test_i5_status.py."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from api_client import (
    MODEL,
    OPERATOR,
    OPERATOR_KEY,
    LiveServer,
    client_for,
    fake_app_fixtures,
    sse_json,
)
from fake_engine import BOS, EOS, ByteTokenizer, FakeEngine
from fastapi.testclient import TestClient
from waiting import wait_for

from kvfence.role import UnifiedService
from kvfence.server import auth as auth_mod
from kvfence.server.api import build_app
from kvfence.server.auth import ApiKeyFileError, Authenticator, load_api_keys, parse_api_keys

HEX32 = re.compile(r"^[0-9a-f]{32}$")
KEYS = {"sk-acme-123": "acme", "sk-globex-456": "globex"}


# ---- fixtures and helpers --------------------------------------------------------------------


engine, client = fake_app_fixtures()


# ---- completions -----------------------------------------------------------------------------


def test_completion_text_prompt_echoes_with_usage_and_ids(client: TestClient,
                                                          engine: FakeEngine) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    assert body["id"].startswith("cmpl-") and HEX32.match(body["id"][5:])
    assert body["choices"] == [
        {"index": 0, "text": "hellohe", "logprobs": None, "finish_reason": "length"}
    ]
    # BOS + 5 bytes: text prompts are encoded with special tokens.
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 7, "total_tokens": 13}
    (req,) = engine.submitted
    assert HEX32.match(req.request_id) and body["id"] == f"cmpl-{req.request_id}"
    assert req.prompt_token_ids == (BOS, *b"hello")


@pytest.mark.parametrize(
    "prompt",
    ["AB", [65, 66], ["AB"], [[65, 66]]],
    ids=["str", "ids", "list_of_one_str", "list_of_one_id_list"],
)
def test_completion_prompt_forms(client: TestClient, prompt: Any) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "ABAB"


def test_completion_defaults_to_16_tokens(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [65]})
    assert r.json()["usage"]["completion_tokens"] == 16


def test_multiple_prompts_and_n_become_separate_engine_requests(client: TestClient,
                                                                 engine: FakeEngine) -> None:
    r = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": ["ab", "cd"], "n": 2, "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "ab"), (1, "ab"), (2, "cd"), (3, "cd"),
    ]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14}
    ids = [req.request_id for req in engine.submitted]
    assert len(ids) == 4 and len(set(ids)) == 4 and all(HEX32.match(i) for i in ids)


def test_finish_reason_stop_on_eos(client: TestClient) -> None:
    r = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": [65, 66, EOS], "max_tokens": 10}
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == "AB"
    assert r.json()["usage"]["completion_tokens"] == 3


def test_sampling_fields_reach_the_engine(client: TestClient, engine: FakeEngine) -> None:
    r = client.post(
        "/v1/completions",
        json={
            "model": MODEL, "prompt": "x", "max_tokens": 3, "temperature": 0, "top_p": 0.5,
            "top_k": 7, "seed": 42, "stop": ["\n", "END"], "stop_token_ids": [10],
            "ignore_eos": True, "user": "someone", "some_future_field": {"x": 1},
        },
    )
    assert r.status_code == 200, r.text
    s = engine.submitted[0].sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (3, 0.0, 0.5, 7, 42)
    assert s.stop == ("\n", "END") and s.stop_token_ids == (10,) and s.ignore_eos
    assert s.greedy and s.logprobs is None


def test_completion_logprobs_shape(client: TestClient, engine: FakeEngine) -> None:
    r = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "AB", "max_tokens": 2, "logprobs": 2}
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert engine.submitted[0].sampling.logprobs == 2
    assert lp["tokens"] == ["A", "B"]
    assert lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["top_logprobs"] == [{"A": -0.5, "B": -1.5}, {"B": -0.5, "C": -1.5}]
    assert lp["text_offset"] == [0, 1]


# ---- chat ------------------------------------------------------------------------------------


def test_chat_renders_template_without_adding_special_tokens(client: TestClient,
                                                             engine: FakeEngine) -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user",
         "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "x"}]},
    ]
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 50, "max_completion_tokens": 3},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-") and HEX32.match(body["id"][9:])
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "<s>"}
    assert body["choices"][0]["finish_reason"] == "length"
    expected = ByteTokenizer().encode("<s><system>be brief\n<user>hi x\n<assistant>",
                                      add_special_tokens=False)
    req = engine.submitted[0]
    assert list(req.prompt_token_ids) == expected and BOS not in req.prompt_token_ids
    assert req.sampling.max_tokens == 3  # max_completion_tokens wins over max_tokens
    assert body["usage"]["prompt_tokens"] == len(expected)


def test_chat_logprobs_shape(client: TestClient) -> None:
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "q"}], "max_tokens": 1,
              "logprobs": True, "top_logprobs": 1},
    )
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content == [
        {"token": "<", "logprob": -0.5, "bytes": [60],
         "top_logprobs": [{"token": "<", "logprob": -0.5, "bytes": [60]}]}
    ]


# ---- streaming -------------------------------------------------------------------------------


def test_stream_completion_chunks_and_usage(client: TestClient) -> None:
    r = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": [65, 66, 67], "max_tokens": 5, "stream": True,
              "stream_options": {"include_usage": True}},
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_json(r.text)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert all(c["object"] == "text_completion" for c in chunks)
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == "ABCAB"
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["usage"] is None for c in text_chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


def test_stream_chat_role_then_content_then_finish(client: TestClient) -> None:
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "q"}], "max_tokens": 4,
              "stream": True},
    )
    chunks = sse_json(r.text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "<s><"
    assert chunks[-1]["choices"][0] == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"
    }
    assert all("usage" not in c for c in chunks)


def test_stream_n2_interleaves_choices(client: TestClient) -> None:
    r = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "ab", "max_tokens": 3, "n": 2, "stream": True},
    )
    chunks = sse_json(r.text)
    by_index: dict[int, str] = {0: "", 1: ""}
    for c in chunks:
        by_index[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert by_index == {0: "aba", 1: "aba"}


# ---- models, health, metrics -----------------------------------------------------------------


def test_models_lists_the_served_model_with_context_length(client: TestClient) -> None:
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL]
    assert data[0]["max_model_len"] == 512 and data[0]["object"] == "model"
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    r = client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_health_reflects_engine_thread() -> None:
    e = FakeEngine()
    e.start()
    with client_for(e) as c:
        assert c.get("/health").json() == {"status": "ok"}
        e.shutdown()
        r = c.get("/health")
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "engine_dead"


def test_metrics_expose_counters_gauges_and_histograms(client: TestClient) -> None:
    client.post("/v1/completions", json={"model": MODEL, "prompt": [65, 66], "max_tokens": 3})
    client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 600})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for needle in (
        'kvfence_requests_total{status="200",tenant="default"} 1.0',
        'kvfence_requests_total{status="400",tenant="default"} 1.0',
        'kvfence_prompt_tokens_total{tenant="default"} 2.0',
        'kvfence_completion_tokens_total{tenant="default"} 3.0',
        'kvfence_rejections_total{reason="context_length_exceeded"} 1.0',
        'kvfence_request_finish_total{reason="length"} 1.0',
        "kvfence_pool_pages_total 256.0",
        "kvfence_pool_pages_free 256.0",
        "kvfence_pool_pages_used 0.0",
        "kvfence_preemptions_total 0.0",
        "kvfence_time_to_first_token_seconds_count 1.0",
        "kvfence_e2e_request_latency_seconds_count 1.0",
        "kvfence_inter_token_latency_seconds_count 2.0",
    ):
        assert needle in text, needle


def test_metrics_registries_are_per_app(engine: FakeEngine) -> None:
    # Two apps in one process must not share (or clash on) metric names.
    a, b = client_for(engine), client_for(engine)
    a.post("/v1/completions", json={"model": MODEL, "prompt": [65], "max_tokens": 1})
    assert 'kvfence_requests_total{status="200",tenant="default"} 1.0' in a.get("/metrics").text
    assert "kvfence_requests_total{" not in b.get("/metrics").text


# ---- tenancy (I6) ----------------------------------------------------------------------------


@pytest.fixture
def authed(engine: FakeEngine) -> Iterator[TestClient]:
    with client_for(engine, KEYS, OPERATOR_KEY) as c:
        yield c


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-acme-123"},
     {"Authorization": "Basic sk-acme-123"}, {"Authorization": "Bearer "}],
    ids=["missing", "wrong", "no_scheme", "basic", "empty"],
)
def test_401_without_a_valid_key(authed: TestClient, engine: FakeEngine,
                                 headers: dict[str, str]) -> None:
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": "x"}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": []})):
        r = authed.post(path, json=body, headers=headers)
        assert r.status_code == 401
        assert r.json() == {"error": {"message": r.json()["error"]["message"],
                                      "type": "authentication_error", "param": None,
                                      "code": "invalid_api_key"}}
    assert authed.get("/v1/models", headers=headers).status_code == 401
    assert engine.submitted == []


def test_i6_tenant_comes_from_the_key_not_the_body_or_headers(authed: TestClient,
                                                               engine: FakeEngine) -> None:
    r = authed.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 1, "tenant": "globex",
              "user": "globex"},
        headers={"Authorization": "Bearer sk-acme-123", "X-Tenant": "globex"},
    )
    assert r.status_code == 200, r.text
    r = authed.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
              "tenant": "acme"},
        headers={"Authorization": "bearer sk-globex-456", "X-Tenant": "acme"},
    )
    assert r.status_code == 200, r.text
    assert [req.tenant for req in engine.submitted] == ["acme", "globex"]
    text = authed.get("/metrics", headers=OPERATOR).text
    assert 'kvfence_requests_total{status="200",tenant="acme"} 1.0' in text
    assert 'kvfence_requests_total{status="200",tenant="globex"} 1.0' in text


def test_health_needs_no_key_and_metrics_need_the_operator_key(authed: TestClient) -> None:
    # Changed in issue 15: /metrics names every tenant and their counts, so with tenant keys
    # configured it is the operator's alone (it needed no key before).
    assert authed.get("/health").status_code == 200
    assert authed.get("/metrics").status_code == 403
    tenant = {"Authorization": "Bearer sk-acme-123"}
    assert authed.get("/metrics", headers=tenant).status_code == 403
    assert authed.get("/metrics", headers=OPERATOR).status_code == 200


def test_without_key_file_everyone_is_the_default_tenant(client: TestClient,
                                                         engine: FakeEngine) -> None:
    client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1,
                                         "tenant": "acme"},
                headers={"Authorization": "Bearer anything", "X-Tenant": "acme"})
    assert engine.submitted[0].tenant == "default"


def test_key_file_parsing(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# tenants\n\nsk-a  acme   # trailing comment\nsk-b globex\n")
    assert load_api_keys(f) == {"sk-a": "acme", "sk-b": "globex"}
    with pytest.raises(ApiKeyFileError, match="duplicate"):
        parse_api_keys("sk-a acme\nsk-a globex\n")
    with pytest.raises(ApiKeyFileError, match=":1:"):
        parse_api_keys("sk-a acme extra\n")
    with pytest.raises(ApiKeyFileError, match="tenant"):
        parse_api_keys("sk-a acme/../x\n")
    with pytest.raises(ApiKeyFileError, match="no API keys"):
        parse_api_keys("# nothing\n")
    with pytest.raises(ApiKeyFileError, match="cannot read"):
        load_api_keys(tmp_path / "missing")


def test_key_check_is_constant_time_over_all_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = auth_mod.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth_mod.hmac, "compare_digest", counting)
    a = Authenticator({f"sk-{i}": f"t{i}" for i in range(5)})
    assert a.tenant_for("Bearer sk-0") == "t0"
    assert len(calls) == 5  # no early exit on the first match


# ---- admission (I1) ------------------------------------------------------------------------------


def test_i1_rejection_is_a_400_with_the_admission_reason(client: TestClient,
                                                         engine: FakeEngine) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 600})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert engine.submitted == [] and len(engine.rejected) == 1


def test_i1_one_rejected_prompt_aborts_its_admitted_siblings(client: TestClient,
                                                             engine: FakeEngine) -> None:
    engine.hold = True
    r = client.post("/v1/completions",
                    json={"model": MODEL, "prompt": [[65], [65] * 600], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    (admitted,) = engine.submitted
    wait_for(lambda: admitted.request_id in engine.aborted)


# ---- client disconnects ----------------------------------------------------------------------


def _scope(path: str) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "server": ("test", 80), "client": ("c", 1),
        "headers": [(b"content-type", b"application/json")],
    }


@pytest.mark.parametrize("stream", [False, True], ids=["non_stream", "stream"])
def test_disconnect_aborts_the_engine_request(stream: bool) -> None:
    """ASGI level, deterministic: the client hangs up while the engine holds the request."""
    engine = FakeEngine(hold=not stream, step_delay=0.01)
    engine.start()
    app = build_app(engine, api_keys=None)
    body = json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": 400, "stream": stream})

    async def run() -> list[dict[str, Any]]:
        hung_up = asyncio.Event()
        sent: list[dict[str, Any]] = []
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body.encode(), "more_body": False}
            await hung_up.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                hung_up.set()  # the client goes away after its first chunk

        async def hang_up_once_submitted() -> None:
            while not engine.submitted:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            hung_up.set()

        helper = asyncio.create_task(hang_up_once_submitted())
        await asyncio.wait_for(app(_scope("/v1/completions"), receive, send), timeout=10)
        helper.cancel()
        return sent

    try:
        sent = asyncio.run(run())
        rid = engine.submitted[0].request_id
        wait_for(lambda: rid in engine.aborted)
        # The generation stopped long before max_tokens: nothing kept running for nobody.
        wait_for(lambda: engine.stats().running == 0)
        assert sent  # the app finished its response cycle
    finally:
        engine.shutdown()


# ---- the official openai client against a real uvicorn ---------------------------------------


@pytest.fixture
def live(engine: FakeEngine) -> Iterator[LiveServer]:
    with LiveServer(build_app(engine, api_keys=KEYS)) as server:
        yield server


def oai(live: LiveServer, key: str = "sk-acme-123") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=10)


def test_openai_client_completions_and_chat(live: LiveServer, engine: FakeEngine) -> None:
    client = oai(live)
    comp = client.completions.create(model=MODEL, prompt="hey", max_tokens=3)
    assert comp.choices[0].text == "hey" and comp.choices[0].finish_reason == "length"
    assert comp.usage is not None and comp.usage.completion_tokens == 3
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=3,
        extra_body={"top_k": 5, "tenant": "globex"},
    )
    assert chat.choices[0].message.content == "<s>" and chat.choices[0].message.role == "assistant"
    assert [r.tenant for r in engine.submitted] == ["acme", "acme"]
    assert engine.submitted[1].sampling.top_k == 5
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_openai_client_streaming(live: LiveServer) -> None:
    client = oai(live)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "<s><u"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    stream2 = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, stream=True)
    assert "".join(c.choices[0].text for c in stream2) == "abca"


def test_openai_client_errors(live: LiveServer, engine: FakeEngine) -> None:
    with pytest.raises(openai.AuthenticationError) as auth_err:
        oai(live, key="sk-nope").completions.create(model=MODEL, prompt="x")
    assert auth_err.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as nf:
        oai(live).completions.create(model="gpt-4", prompt="x")
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        oai(live).completions.create(model=MODEL, prompt="x", temperature=3)
    assert br.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as ctx:
        oai(live).completions.create(model=MODEL, prompt="x", max_tokens=100_000)
    assert ctx.value.code == "context_length_exceeded"
    engine.fail_after = 2
    stream = oai(live).completions.create(model=MODEL, prompt="abcd", max_tokens=9, stream=True)
    with pytest.raises(openai.APIError, match="KV grant check failed"):
        list(stream)


def test_real_socket_disconnect_aborts(live: LiveServer, engine: FakeEngine) -> None:
    engine.step_delay = 0.01
    headers = {"Authorization": "Bearer sk-acme-123"}
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 400, "stream": True}
    with httpx.Client(base_url=live.url, headers=headers, timeout=10) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_raw())
    rid = engine.submitted[0].request_id
    wait_for(lambda: rid in engine.aborted)
    # Non-stream: the client times out while the engine holds the request.
    engine.hold = True
    with httpx.Client(base_url=live.url, headers=headers, timeout=0.3) as h:
        with pytest.raises(httpx.ReadTimeout):
            h.post("/v1/completions", json={**body, "stream": False})
    rid2 = engine.submitted[1].request_id
    wait_for(lambda: rid2 in engine.aborted)
    with httpx.Client(base_url=live.url) as h:
        assert h.get("/health").status_code == 200


# ---- the real engine behind the same HTTP layer ----------------------------------------------


@pytest.fixture(scope="module")
def real_engine(checkpoint_dir: Any) -> Iterator[Any]:
    from kvfence.config import EngineConfig
    from kvfence.engine.engine import Engine

    cfg = EngineConfig(model=str(checkpoint_dir("llama")), kv_pool_tokens=1024,
                       context_length=256, served_model_name="tiny")
    e = Engine(cfg)
    e.start()
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def real_live(real_engine: Any) -> Iterator[LiveServer]:
    with LiveServer(build_app(UnifiedService(real_engine), api_keys=KEYS)) as server:
        yield server


def test_real_engine_openai_client_end_to_end(real_live: LiveServer, real_engine: Any) -> None:
    client = oai(real_live)
    assert client.models.list().data[0].model_extra["max_model_len"] == 256
    kw: dict[str, Any] = dict(model="tiny", prompt="the quick brown fox", max_tokens=8,
                              temperature=0)
    full = client.completions.create(**kw)
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage is not None and 1 <= full.usage.completion_tokens <= 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert streamed == full.choices[0].text  # greedy: streaming changes framing, not content
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello world"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2,
    )
    assert chat.choices[0].logprobs is not None
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)
    assert real_engine.stats().pages_used == 0


def test_real_engine_i1_rejections_over_http_hold_nothing(real_live: LiveServer,
                                                         real_engine: Any) -> None:
    client = oai(real_live)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="tiny", prompt=[5] * 300, max_tokens=1)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as vocab:
        client.completions.create(model="tiny", prompt=[5, 100_000], max_tokens=1)
    assert vocab.value.code == "invalid_token_id"
    s = real_engine.stats()
    assert (s.pages_used, s.running, s.waiting) == (0, 0, 0)


def test_real_engine_disconnect_aborts_and_frees_pages(real_live: LiveServer, real_engine: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    aborted: list[str] = []
    real_abort = real_engine.abort

    def spy(request_id: str) -> None:
        aborted.append(request_id)
        real_abort(request_id)

    monkeypatch.setattr(real_engine, "abort", spy)
    real_run = real_engine.runner.run

    def slow_run(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.02)  # the tiny model would finish 200 tokens before the hang-up lands
        return real_run(*args, **kwargs)

    monkeypatch.setattr(real_engine.runner, "run", slow_run)
    body = {"model": "tiny", "prompt": "the lazy dog", "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    headers = {"Authorization": "Bearer sk-acme-123"}
    with httpx.Client(base_url=real_live.url, headers=headers, timeout=30) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_raw())
    wait_for(lambda: len(aborted) == 1, timeout=10)
    wait_for(lambda: real_engine.stats().pages_used == 0, timeout=10)
    assert real_engine.stats().running == 0


# ---- logging and serve() ---------------------------------------------------------------------


def test_one_log_line_per_request_with_tenant_id_status_tokens(
    authed: TestClient, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="kvfence.server"):
        authed.post("/v1/completions", json={"model": MODEL, "prompt": [65], "max_tokens": 2},
                    headers={"Authorization": "Bearer sk-acme-123"})
        authed.post("/v1/completions", json={"model": MODEL, "prompt": [65]})
    lines = [r.getMessage() for r in caplog.records if r.name == "kvfence.server"]
    assert len(lines) == 2
    rid = engine.submitted[0].request_id
    assert f"tenant=acme request_id={rid}" in lines[0]
    assert "status=200 prompt_tokens=1 completion_tokens=2 finish=length" in lines[0]
    assert "tenant=- " in lines[1] and "status=401" in lines[1]
    assert "error=invalid_api_key" in lines[1]


SERVE_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from fake_engine import FakeEngine
from kvfence.server.api import serve
engine = FakeEngine()
serve(engine, "127.0.0.1", int(sys.argv[2]), sys.argv[3], log_level="warning")
print("engine alive after serve:", engine.alive, flush=True)
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_serve_runs_uvicorn_owns_the_engine_and_stops_cleanly(tmp_path: Path, sig: str) -> None:
    import signal
    import socket
    import subprocess
    import sys

    keys = tmp_path / "keys"
    keys.write_text("sk-1 acme\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_SCRIPT, str(Path(__file__).parent), str(port), str(keys)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, timeout=30)
        ok = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"},
                        headers={"Authorization": "Bearer sk-1"})
        assert ok.status_code == 200
        assert httpx.post(f"{url}/v1/completions", json={}).status_code == 401
    finally:
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "engine alive after serve: False" in out


def test_serve_refuses_a_bad_key_file_before_starting_the_engine(tmp_path: Path) -> None:
    from kvfence.server.api import serve

    keys = tmp_path / "keys"
    keys.write_text("sk-1 acme\nsk-1 globex\n")
    engine = FakeEngine()
    with pytest.raises(ApiKeyFileError, match="duplicate"):
        serve(engine, "127.0.0.1", 0, str(keys))
    assert not engine.alive
